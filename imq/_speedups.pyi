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
