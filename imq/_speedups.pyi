from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, final

from imq.types import Address, IteratedMessage, Message, QueueKey, QueueShardRange, ShardIdent

_T = TypeVar("_T", bound=tuple[object, ...])

def init(
    iterated: type[IteratedMessage],
    message: type[Message],
    queue_key: type[QueueKey],
    address: type[Address],
    /,
) -> None: ...
def value_deallocs(on: bool, /) -> bool: ...
def set_constructors() -> None: ...
def value_constructors(on: bool, /) -> bool: ...
def key_from_bytes(cls: type[QueueKey], data: bytes, /) -> QueueKey: ...
def decode_run(
    keys: list[bytes], values: list[bytes], shard: ShardIdent, /
) -> list[IteratedMessage]: ...
def encode_diff(
    put: object, target: object, shard_bytes: bytes, messages: object, partition_for: object, /
) -> tuple[int, list[tuple[int, int, bytes]], list[tuple[int, int]]]: ...
def merge_fill(
    sources: list[Any],
    heads: list[Any],
    lastkeys: list[bytes | None],
    need: list[int],
    limit: int,
    wc_byte: int,
    prefix_len: int,
    want: int,
    shards: list[ShardIdent],
    positions: list[Any],
    /,
) -> tuple[list[IteratedMessage], list[Any], list[Any], list[int], list[int], int]: ...
def put_rows(
    put: object,
    target: object,
    shard_bytes: bytes,
    messages: object,
    partition_for: object,
    counts: dict[int, int],
    /,
) -> int: ...
def stat_value(counts: dict[Address, int], /) -> bytes: ...
def diff_record(
    version: int,
    min_message: QueueKey,
    max_message: QueueKey,
    shards_messages_count: object,
    diff_hash: bytes,
    processed_to: object,
    router_src: object,
    router_dst: object,
    seqno: int,
    prev_hash: bytes | None,
    partitions: object,
    /,
) -> bytes: ...
def sources_in_shard(messages: object, workchain: int, prefix: int, prefix_len: int, /) -> bool: ...
def strictly_ascending(messages: object, message_type: type, /) -> bool: ...
def chunk_check(data: bytes | bytearray, offs: bytes | bytearray, /) -> tuple[int, int, bool]: ...
def chunk_trim(buffer: object, /) -> None: ...
def chunk_bisect(data: bytes | bytearray, offs: bytes | bytearray, key: bytes, /) -> int: ...
def chunk_cut(
    data: bytes | bytearray, offs: bytes | bytearray, i: int, j: int, /
) -> tuple[bytes, bytes]: ...
def chunk_pack(rows: list[tuple[bytes, bytes]], /) -> tuple[bytes, bytes]: ...
def cache_scan(
    segments: dict[bytes, object],
    prefix_len: int,
    bounds: list[tuple[bytes, bytes]],
    reader: tuple[int, int, int] | None,
    /,
) -> list[ChunkRows | None]: ...

@final
class ChunkRows:
    dropped: int
    def __new__(
        cls,
        datas: list[bytes | bytearray],
        offss: list[bytes | bytearray],
        start: int,
        stop: int,
        reader: tuple[int, int, int] | None = None,
    ) -> ChunkRows: ...
    def __iter__(self) -> ChunkRows: ...
    def __next__(self) -> tuple[bytes, bytes]: ...
    @property
    def rows(self) -> ChunkRows: ...
    @property
    def items(self) -> ChunkRows: ...
    def finish(self, last_key: bytes | None, /) -> None: ...
    def close(self) -> None: ...
    def count(self, lo: bytes, hi: bytes, /) -> int: ...

@final
class Tee:
    unordered: int
    invalid: int
    def __new__(
        cls, put: object, segments: dict[bytes, list[bytearray]], prefix_len: int
    ) -> Tee: ...
    def __call__(self, key: bytes, value: bytes, target: object, /) -> None: ...

@final
class Guard:
    def __new__(cls, gen: Iterator[Any], busy: Iterator[Any]) -> Guard: ...
    def __iter__(self) -> Guard: ...
    def __next__(self) -> Any: ...

def message_bounds(
    partition: int, ranges: Sequence[QueueShardRange], /
) -> list[tuple[bytes, bytes]]: ...
def value_new(cls: type[_T], fields: tuple[object, ...], /) -> _T: ...
