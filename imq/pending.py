"""A prepared, unwritten diff and the locks it holds (SEMANTICS §4).

A pending diff holds the facade's read lock and its shard's mutex until it is written,
discarded or dropped (the last reference to an unwritten one gone: a rollback). The
registry remembers which thread prepared which shard, so the two calls that would
deadlock are refused instead: a second prepare of the same shard by the thread that
holds it, and a commit or clear by a thread holding a pending diff. A diff handed to
another thread still counts as its preparing thread's until written or discarded.

A dropped diff releases its locks from ``__del__``, which cyclic GC may run in the
middle of any allocation, including inside this module's own critical sections: so the
registry's mutex and the read lock's condition are re-entrant, and every section leaves
its state consistent at each allocation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import TracebackType

from imq.errors import ImqError
from imq.locks import LongWait, RWLock, ShardLocks
from imq.storage import TransactionProtocol
from imq.types import BlockIdShort, ShardIdent

__all__ = ["LockGuard", "PendingDiff", "PendingRegistry"]


_CLOSED_CHECK = 0.05  # seconds: how often a wait for a shard's mutex looks for a close


class PendingRegistry:
    __slots__ = ("_held", "_kinds", "_mutex", "_owners", "_waiting")

    def __init__(self) -> None:
        self._mutex = threading.RLock()  # re-entrant: see the module's docstring
        # Keyed by the thread object, not its ident: a new thread may reuse a dead one's.
        self._held: dict[threading.Thread, list[ShardIdent]] = {}
        # Who holds each registered shard, and which shard each thread waits for: the
        # wait-for graph, to refuse a wait that closes a cycle (two threads, each holding
        # a shard the other is about to wait for) instead of hanging both.
        self._owners: dict[ShardIdent, threading.Thread] = {}
        # What each registered shard's hold is, for a report of a long wait.
        self._kinds: dict[ShardIdent, str] = {}
        self._waiting: dict[threading.Thread, ShardIdent] = {}

    def hold_shard(
        self,
        rw: RWLock,
        shard_locks: ShardLocks,
        shard: ShardIdent,
        on_stuck: LongWait | None = None,
        *,
        kind: str = "pending diff",
    ) -> LockGuard:
        """Take the read lock and ``shard``'s mutex for this thread and remember it:
        what a pending diff holds until written or discarded, and what an export holds
        while it reads the shard (so neither can be followed by a commit or clear, or a
        second hold of the shard, in the same thread, nor by a wait for a shard whose
        holder waits, directly or through others, for one this thread holds).
        ``on_stuck``: the call's wait, reported once if a lock is still not free
        ``STUCK_AFTER`` seconds after the call began (the wait goes on)."""
        thread = threading.current_thread()
        with self._mutex:
            held = list(self._held.get(thread, ()))
        if shard in held:
            raise ImqError(
                f"this thread already holds a pending diff of shard {shard} (or is "
                "exporting it); write or discard it before preparing another diff of the "
                "shard or exporting it"
            )
        rw.acquire_read(jump_queue=bool(held), on_stuck=on_stuck)
        lock = shard_locks.get(shard)
        try:
            if not lock.acquire(blocking=False):
                self._wait_for(lock, thread, shard, held, rw, on_stuck=on_stuck)
        except BaseException:
            rw.release_read()
            raise
        try:
            with self._mutex:
                self._held.setdefault(thread, []).append(shard)
                self._owners[shard] = thread
                self._kinds[shard] = kind
            return LockGuard(self, rw, lock, thread, shard)
        except BaseException:  # a KeyboardInterrupt here must not keep the locks
            self._forget(thread, shard)
            lock.release()
            rw.release_read()
            raise

    def _wait_for(
        self,
        lock: threading.Lock,
        thread: threading.Thread,
        shard: ShardIdent,
        held: list[ShardIdent],
        rw: RWLock,
        *,
        on_stuck: LongWait | None,
    ) -> None:
        """Block on ``shard``'s mutex, unless this thread holds shards and the wait
        would close a cycle of waits: then ``ImqError``. The check and the registration
        of this wait are one step, so of two threads closing a cycle the later one sees
        the earlier one's wait. A diff handed to another thread counts as its preparing
        thread's, as everywhere in this registry."""
        if held:
            with self._mutex:
                cycle = self._cycle(thread, shard)
                if cycle is None:
                    self._waiting[thread] = shard
            if cycle is not None:
                raise ImqError(
                    f"preparing shard {shard} would deadlock: {cycle}; write or discard "
                    f"this thread's pending diffs of {', '.join(map(str, held))} first"
                )
        try:
            # In steps, so that a close of the queue ends the wait (rw.check_closed).
            while not lock.acquire(timeout=_CLOSED_CHECK):
                rw.check_closed()
                if on_stuck is not None:
                    on_stuck.report_if_due()
        finally:
            if held:
                with self._mutex:
                    self._waiting.pop(thread, None)

    def _cycle(self, thread: threading.Thread, shard: ShardIdent) -> str | None:
        """Under ``_mutex``: the chain of waits that leads from ``shard`` back to
        ``thread``, described, or ``None``."""
        steps: list[str] = []
        seen: set[threading.Thread] = set()
        wanted: ShardIdent | None = shard
        while wanted is not None:
            owner = self._owners.get(wanted)
            if owner is None or owner in seen:
                return None
            steps.append(f"shard {wanted} is held by thread {owner.name!r}")
            if owner is thread:
                return ", which waits for it; ".join(steps)
            seen.add(owner)
            wanted = self._waiting.get(owner)
        return None

    def _forget(self, thread: threading.Thread, shard: ShardIdent) -> None:
        with self._mutex:
            shards = self._held.get(thread)
            if shards is not None and shard in shards:
                shards.remove(shard)
                if not shards:
                    del self._held[thread]
            if self._owners.get(shard) is thread:
                del self._owners[shard]
                self._kinds.pop(shard, None)

    def holders(self) -> str:
        """Who holds which shard now (pending diffs and exports), for a report of a long
        wait: each shard with the thread that took it, and whether that thread still
        runs (a diff whose thread has exited can be written only by a thread it was
        handed to)."""
        with self._mutex:
            owners = sorted(
                (
                    (shard, thread, self._kinds.get(shard, "pending diff"))
                    for shard, thread in self._owners.items()
                ),
                key=lambda item: str(item[0]),
            )
        if not owners:
            return "no pending diff or export (a GC batch or another call holds the lock)"
        return "; ".join(
            f"shard {shard}: {kind} of thread {thread.name!r} "
            f"({'running' if thread.is_alive() else 'exited'})"
            for shard, thread, kind in owners
        )

    def check_no_pending(self, operation: str) -> None:
        with self._mutex:
            held = self._held.get(threading.current_thread())
        if held:
            raise ImqError(
                f"{operation} would deadlock: this thread prepared pending diffs of "
                f"{', '.join(map(str, held))} that are not written yet; write or discard "
                "them first (a pending diff handed to another thread counts as its "
                "preparing thread's until then)"
            )


class LockGuard:
    """The read lock and shard mutex of one pending diff; release is idempotent, also
    when two threads release at once (the locks are released exactly once)."""

    __slots__ = ("_lock", "_once", "_registry", "_rw", "_shard", "_thread")

    def __init__(
        self,
        registry: PendingRegistry,
        rw: RWLock,
        lock: threading.Lock,
        thread: threading.Thread,
        shard: ShardIdent,
    ) -> None:
        self._registry = registry
        self._rw = rw
        self._lock = lock
        self._thread = thread
        self._shard = shard
        # Taken by the first release: an atomic test-and-set (a flag tested, then set,
        # let two racing releases both pass and release the locks twice, the second
        # time someone else's hold).
        self._once = threading.Lock()

    def release(self) -> None:
        if not self._once.acquire(blocking=False):
            return
        # Each step runs even if the one before it was cut short (a KeyboardInterrupt):
        # a lock left held would hold every later commit and clear up.
        try:
            self._registry._forget(self._thread, self._shard)
        finally:
            try:
                self._lock.release()
            finally:
                self._rw.release_read()


class PendingDiff:
    """A diff that passed every check and is staged in one batch, not yet written.

    ``write()`` writes it atomically; ``discard()`` drops it. Either releases the locks;
    using the object afterwards raises ``ImqError``. As a context manager it discards on
    exit unless written. Dropped unwritten (its last reference gone), it is discarded:
    the batch is rolled back and the locks released, with a warning logged, since a
    caller that forgets one would otherwise hold every commit up.
    """

    __slots__ = (
        "_guard",
        "_on_drop",
        "_on_interrupt",
        "_state",
        "_transition",
        "_write",
        "block",
        "messages",
        "txn",
    )

    def __init__(
        self,
        write: Callable[[PendingDiff], None],
        txn: TransactionProtocol,
        guard: LockGuard,
        block: BlockIdShort,
        messages: int,
        *,
        on_drop: Callable[[PendingDiff], None] = lambda pending: None,
        on_interrupt: Callable[[str, BaseException], None] = lambda operation, exc: None,
    ) -> None:
        """``write(self)`` writes ``txn`` (the queue's writer); it runs while the locks
        are held. ``on_drop(self)`` runs when it is dropped unwritten (after the locks
        are released). ``on_interrupt(operation, exc)`` runs when ``write`` or
        ``discard`` is cut short by an exception other than an error (a
        ``KeyboardInterrupt``), which may leave the locks held."""
        self._write = write
        self._on_drop = on_drop
        self._on_interrupt = on_interrupt
        self.txn = txn
        self._guard = guard
        self.block = block
        self.messages = messages
        # Guards the state's check-and-change: a write and a discard (or two writes)
        # racing from two threads both passed a bare check, so a discard "succeeded"
        # while the write went on without locks, or the batch was written twice (which
        # RocksDB refuses, killing the store's handle).
        self._transition = threading.Lock()
        self._state = "pending"

    @property
    def state(self) -> str:
        """``pending``, ``written``, ``discarded`` or ``failed``."""
        return self._state

    def _finish(self, state: str) -> None:
        if not self._try_finish(state):
            done = "failed to write" if self._state == "failed" else f"was already {self._state}"
            raise ImqError(
                f"pending diff of block {self.block} {done}: a pending diff is written or "
                "discarded once; prepare the diff again (Queue.prepare_diff) to retry it"
            )

    def _try_finish(self, state: str) -> bool:
        """Move from ``pending`` to ``state``, atomically; ``False`` if it was not
        pending any more. (No ``__del__`` of this object can run inside: it is alive.)"""
        with self._transition:
            if self._state != "pending":
                return False
            self._state = state
            return True

    def write(self) -> None:
        with self._interruptible("PendingDiff.write"):
            self._finish("failed")
            try:
                self._write(self)
                self._state = "written"
            finally:  # a KeyboardInterrupt inside the write too: its store is dead then
                self._guard.release()

    def discard(self) -> None:
        with self._interruptible("PendingDiff.discard"):
            self._finish("discarded")
            self._guard.release()

    @contextmanager
    def _interruptible(self, operation: str) -> Iterator[None]:
        """Report an exception other than an error (a ``KeyboardInterrupt``) that cuts
        ``operation`` short to ``on_interrupt``: the locks may be left held."""
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._on_interrupt(operation, exc)
            raise

    def __del__(self) -> None:
        if getattr(self, "_state", None) != "pending":
            return
        try:
            self._state = "discarded"
            self._guard.release()
            self._on_drop(self)
        except Exception:  # pragma: no cover -- interpreter shutdown: nothing to release to
            pass
        except BaseException as exc:  # a KeyboardInterrupt inside: a lock may stay held
            with suppress(Exception):
                self._on_interrupt("PendingDiff.__del__", exc)
            raise

    def __enter__(self) -> PendingDiff:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Unless written meanwhile, possibly by another thread: then nothing to do.
        with self._interruptible("PendingDiff.__exit__"):
            if self._try_finish("discarded"):
                self._guard.release()
