from imq.types import Address, IteratedMessage, Message, QueueKey, ShardIdent

def init(
    iterated: type[IteratedMessage],
    message: type[Message],
    queue_key: type[QueueKey],
    address: type[Address],
    /,
) -> None: ...
def decode_run(
    keys: list[bytes], values: list[bytes], shard: ShardIdent, /
) -> list[IteratedMessage]: ...
def encode_diff(
    put: object, target: object, shard_bytes: bytes, messages: object, partition_for: object, /
) -> tuple[int, list[tuple[int, int, bytes]], list[tuple[int, int]]]: ...
def sources_in_shard(messages: object, workchain: int, prefix: int, prefix_len: int, /) -> bool: ...
def strictly_ascending(messages: object, message_type: type, /) -> bool: ...
