"""Fuzzing ``Queue.import_state`` with mutated real and synthetic states (D10, D11, D13).

Real files (``shard.bin``, ``master.bin``, a zstd ``.queue``) and small synthetic states
of several chunks (raw and zstd, with multi-cell messages and routed partitions) get
flipped, overwritten, inserted, deleted and truncated bytes, in the compressed stream or
in the decompressed content, and are imported into a queue that already holds data.

What may happen, and why nothing else may:

* into a queue holding only *other* shards (``test_mutated_state_into_other_shards``):
  the import succeeds or raises ``StateFormatError``. No stored diff or commit pointer of
  the state's shard exists, so neither ``DiffConflictError`` nor ``CommitError`` has
  anything to conflict with, and the block id fixes the shard and the seqno;
* into a queue that already holds the unmutated file (``test_mutated_state_over_itself``):
  also ``DiffConflictError``, but only for a state whose header reads correctly and whose
  diffs differ from the stored ones (a diff of a stored seqno with another hash).
  ``CommitError`` stays impossible: the top diff's seqno is fixed by the block id, so a
  state either conflicts at the top diff first or keeps every diff, pointer included.

On any failure every table, the cached pointers and the last committed masterchain block
are as before, and no import marker is left.
"""

from __future__ import annotations

import io
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from builders import BASE, MC, Chain, dump, open_queue
from tycho_data import TYCHO

from imq import BlockId, CommitPointer, Queue, ShardIdent
from imq.errors import DiffConflictError, StateFormatError
from imq.state import importer
from imq.state.source import ByteSource
from imq.state.synth import synth_state, write_synth_state
from imq.state.tl import StateHeader, read_state_header
from imq.storage import Table, codec

OTHER = ShardIdent(0, 0x2000_0000_0000_0000)
APPLIED = ShardIdent(0, 0xA000_0000_0000_0000)
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
EXAMPLES = 4 * settings().max_examples  # scales with the profile: dev 120, ci 160


@dataclass(frozen=True, eq=False)
class Source:
    """A state to mutate: its bytes as stored, its block and top update."""

    name: str
    data: bytes
    block_id: BlockId
    top_update: tuple[bytes, int]
    content: bytes = field(init=False, repr=False)  # the decompressed state
    header_end: int = field(init=False, repr=False)  # where its first chunk starts

    def __post_init__(self) -> None:
        content = self.data
        if self.compressed:
            content = zstandard.ZstdDecompressor().decompressobj().decompress(self.data)
        src = ByteSource.from_bytes(content)
        read_state_header(src)
        object.__setattr__(self, "content", content)
        object.__setattr__(self, "header_end", src.offset)

    @property
    def compressed(self) -> bool:
        return self.data[:4] == ZSTD_MAGIC


def header_of(content: bytes) -> StateHeader:
    return read_state_header(ByteSource.from_bytes(content))


def real_source(name: str, path: Path, block_id: BlockId) -> Source:
    data = path.read_bytes()
    probe = Source(name, data, block_id, (bytes(32), 0))
    header = header_of(probe.content)
    return Source(name, data, block_id, (header.diff_hashes[0], len(header.diffs)))


def synth_source(name: str, *, compressed: bool) -> Source:
    state = synth_state(
        BASE,
        top_seqno=70,
        diffs=3,
        messages_per_diff=[7, 0, 9],
        routed_every=3,
        masterchain_every=4,
        body_bytes=150 if compressed else 40,
        seed=41,
    )
    out = io.BytesIO()
    assert write_synth_state(state, out, max_chunk_roots=4) == 4
    data = out.getvalue()
    if compressed:  # streamed, so without a content size, as the node writes it
        compressor = zstandard.ZstdCompressor(level=3).compressobj()
        data = compressor.compress(data) + compressor.flush()
    return Source(name, data, state.block_id, state.top_update)


def sources() -> list[Source]:
    queues = TYCHO / "dump_one_shard" / "queues"
    return [
        real_source("shard.bin", TYCHO / "persistent_state" / "shard.bin", BlockId(BASE, 160)),
        real_source("master.bin", TYCHO / "persistent_state" / "master.bin", BlockId(MC, 90)),
        real_source(
            "83.queue", next(queues.glob("0_8000000000000000_83_*.queue")), BlockId(BASE, 83)
        ),
        synth_source("synth.bin", compressed=False),
        synth_source("synth.queue", compressed=True),
    ]


SOURCES = sources()


# -- mutations ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutation:
    kind: str
    at: int
    value: bytes = b""
    length: int = 0

    def apply(self, data: bytes) -> bytes:
        at = min(self.at, len(data))
        if self.kind == "flip" and at < len(data):
            return data[:at] + bytes([data[at] ^ self.value[0]]) + data[at + 1 :]
        if self.kind == "overwrite":
            return data[:at] + self.value + data[at + len(self.value) :]
        if self.kind == "insert":
            return data[:at] + self.value + data[at:]
        if self.kind == "delete":
            return data[:at] + data[at + self.length :]
        if self.kind == "truncate":
            return data[:at]
        return data


def offsets(size: int, header_end: int) -> st.SearchStrategy[int]:
    """Anywhere, mostly in the header and near the end, where the structure is."""
    last = max(size - 1, 0)
    return st.one_of(
        st.integers(0, last),
        st.integers(0, min(header_end, last)),
        st.integers(max(last - 64, 0), last),
    )


def mutation(size: int, header_end: int) -> st.SearchStrategy[Mutation]:
    at = offsets(size, header_end)
    return st.one_of(
        st.builds(Mutation, st.just("flip"), at, st.integers(1, 255).map(lambda b: bytes([b]))),
        st.builds(Mutation, st.just("overwrite"), at, st.binary(min_size=1, max_size=8)),
        st.builds(Mutation, st.just("insert"), at, st.binary(min_size=1, max_size=8)),
        st.builds(Mutation, st.just("delete"), at, st.just(b""), st.integers(1, 16)),
        st.builds(Mutation, st.just("truncate"), at),
    )


@dataclass(frozen=True)
class Case:
    source: Source
    layer: str  # "file": the stored bytes; "content": decompressed, mutated, recompressed
    mutations: tuple[Mutation, ...]
    with_top_update: bool

    def describe(self) -> str:
        return f"{self.source.name} {self.layer} {self.mutations} top={self.with_top_update}"

    def data(self) -> bytes:
        if self.layer == "file":
            out = self.source.data
            for m in self.mutations:
                out = m.apply(out)
            return out
        out = self.source.content
        for m in self.mutations:
            out = m.apply(out)
        return zstandard.ZstdCompressor(level=1).compress(out)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    source = draw(st.sampled_from(SOURCES))
    layer = draw(st.sampled_from(["file", "content"])) if source.compressed else "file"
    target = source.data if layer == "file" else source.content
    header_end = 64 if layer == "file" and source.compressed else source.header_end
    found = draw(st.lists(mutation(len(target), header_end), min_size=1, max_size=3))
    return Case(source, layer, tuple(found), draw(st.booleans()))


# -- the queue ----------------------------------------------------------------------------------


@dataclass
class Before:
    rows: dict[str, list[tuple[bytes, bytes]]]
    pointers: dict[ShardIdent, CommitPointer]
    last_mc: BlockId | None


@dataclass
class Bench:
    """One working queue, restored from a closed template directory after any import
    that changed it; a template per (source, whether it already holds that source)."""

    root: Path
    templates: dict[tuple[str, bool], tuple[Path, Before]] = field(default_factory=dict)
    queue: Queue | None = None
    current: tuple[str, bool] | None = None
    dirty: bool = False

    def template(self, source: Source, over_itself: bool) -> tuple[Path, Before]:
        key = (source.name, over_itself)
        if key not in self.templates:
            path = self.root / f"template-{len(self.templates)}"
            with open_queue(path) as queue:
                fill_prior(queue)
                if over_itself:
                    queue.import_state(io.BytesIO(source.data), source.block_id, source.top_update)
                before = Before(
                    dump(queue), queue.get_commit_pointers(), queue.get_last_committed_mc_block_id()
                )
            self.templates[key] = (path, before)
        return self.templates[key]

    def open(self, source: Source, over_itself: bool) -> tuple[Queue, Before]:
        path, before = self.template(source, over_itself)
        key = (source.name, over_itself)
        if self.queue is None or self.dirty or self.current != key:
            self.close()
            work = self.root / "work"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(path, work)
            self.queue = open_queue(work)
            self.current, self.dirty = key, False
        return self.queue, before

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()
            self.queue = None


def fill_prior(queue: Queue) -> None:
    """A state of shard OTHER and two applied diffs of shard APPLIED: none of the
    sources' shards."""
    other = synth_state(OTHER, top_seqno=40, diffs=2, messages_per_diff=5, seed=7)
    out = io.BytesIO()
    write_synth_state(other, out, max_chunk_roots=3)
    queue.import_state(io.BytesIO(out.getvalue()), other.block_id, other.top_update)
    chain = Chain(queue)
    chain.apply(APPLIED, 3)
    chain.apply(APPLIED, 2)


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    bench = Bench(tmp_path_factory.mktemp("fuzz"))
    try:
        yield bench
    finally:
        bench.close()


@pytest.fixture(scope="module", autouse=True)
def _small_batches() -> Iterator[None]:
    """Batches of 5 rows, so a late failure has rows on disk to roll back."""
    saved = importer.BATCH_ROWS
    importer.BATCH_ROWS = 5
    try:
        yield
    finally:
        importer.BATCH_ROWS = saved


def assert_unchanged(queue: Queue, before: Before) -> None:
    assert queue._store.get_latest(Table.VARS, codec.IMPORT_MARKER) is None
    assert queue.get_commit_pointers() == before.pointers
    assert queue.get_last_committed_mc_block_id() == before.last_mc
    assert dump(queue) == before.rows


def parsed_header(content: bytes) -> StateHeader | None:
    try:
        return header_of(content)
    except StateFormatError:
        return None


def decompressed(data: bytes) -> bytes | None:
    if data[:4] != ZSTD_MAGIC:
        return data
    try:
        out: bytes = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    except zstandard.ZstdError:
        return None
    return out


def run_case(bench: Bench, case: Case, over_itself: bool) -> str:
    source = case.source
    queue, before = bench.open(source, over_itself)
    data = case.data()
    top = source.top_update if case.with_top_update else None
    try:
        report = queue.import_state(io.BytesIO(data), source.block_id, top)
    except StateFormatError:
        assert_unchanged(queue, before)
        return "StateFormatError"
    except DiffConflictError:
        assert over_itself, "nothing stored in the state's shard to conflict with"
        content = decompressed(data)
        header = parsed_header(content) if content is not None else None
        assert header is not None, "a conflict needs a header that reads correctly"
        assert header.diff_hashes != header_of(source.content).diff_hashes
        assert_unchanged(queue, before)
        return "DiffConflictError"
    except Exception as exc:  # the point of the test: nothing else may escape
        pytest.fail(f"{type(exc).__name__} escaped the import: {exc}")
    bench.dirty = True
    assert queue._store.get_latest(Table.VARS, codec.IMPORT_MARKER) is None
    content = decompressed(data)
    assert content is not None
    header = header_of(content)
    top_diff = header.diffs[0]
    assert queue.get_commit_pointers()[source.block_id.shard] == CommitPointer(
        top_diff.max_message, top_diff.seqno
    )
    assert report.messages == sum(d.n_messages for d in header.diffs)
    return "imported"


FUZZ = settings(
    max_examples=EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(case=cases())
def test_mutated_state_into_other_shards(bench: Bench, case: Case) -> None:
    note(case.describe())
    event(run_case(bench, case, False))


@FUZZ
@given(case=cases())
def test_mutated_state_over_itself(bench: Bench, case: Case) -> None:
    note(case.describe())
    event(run_case(bench, case, True))


def test_unmutated_sources_import(bench: Bench) -> None:
    """The control: every source imports as it is, both ways."""
    for source in SOURCES:
        for over_itself in (False, True):
            case = Case(source, "file", (), True)
            assert run_case(bench, case, over_itself) == "imported"
