"""The memory checkpoint tier, worker side: a rank's snapshot goes into a segment its node's agent
owns (a memfd the agent creates and passes over the node endpoint), so it outlives the worker that
wrote it (a crash, a restart) and goes with the agent (its exit, kill -9). On when the agent runs
with --memory-checkpoints. The C++ twin is <elastrun/worker/memory.hpp>.

    tier = elastrun.memory.MemoryTier()
    if tier.enabled:
        tier.put(step, rank, payload, checksum=zlib.crc32(payload))
    got = tier.get(rank)            # None, or (step, bytes, checksum) of the newest snapshot

allocate()/open() do the same without the intermediate bytes (elastrun.checkpoint's memory tier:
save(..., tier="memory") writes the tensors straight into the segment, load() reads them from it).
"""

import collections
import mmap
import os
from typing import Optional, Tuple

from . import _contract, node


# This process's writable mappings of segments, by (device, inode), newest last. The agent hands a
# rank the segment retention dropped from it (its "spare"), so a snapshot every step cycles through
# three segments; writing through a mapping made before is about one memcpy, while a new mapping
# pays a fault per page at its first write (10x the copy on a VM). Bounded: a mapping keeps its
# segment's memory alive after the agent frees it.
_WRITABLE_MAPPINGS: "collections.OrderedDict[Tuple[int, int], mmap.mmap]" = collections.OrderedDict()
_KEEP_MAPPINGS = 4


def _close_quietly(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view of it is still held somewhere: it goes when that does
        pass


def _writable_mapping(fd: int, nbytes: int) -> mmap.mmap:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    mapping = _WRITABLE_MAPPINGS.pop(key, None)
    if mapping is not None and (mapping.closed or len(mapping) != nbytes):
        _close_quietly(mapping)
        mapping = None
    if mapping is None:
        # MAP_POPULATE: its pages are mapped in one call, not a fault per page during the copy
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                            mmap.PROT_READ | mmap.PROT_WRITE)
    _WRITABLE_MAPPINGS[key] = mapping
    while len(_WRITABLE_MAPPINGS) > _KEEP_MAPPINGS:
        _close_quietly(_WRITABLE_MAPPINGS.popitem(last=False)[1])
    return mapping


class MemoryTierError(RuntimeError):
    """The agent refused a request (the reason is the message), e.g. its budget cannot hold it."""


class MemoryTier:
    def __init__(self, address: Optional[str] = None):
        self.address = address if address is not None else node.address_from_environment()
        self.enabled = bool(self.address) and (address is not None or
                                              bool(os.environ.get(_contract.ENV_MEMORY_CHECKPOINTS)))

    def _ask(self, op: str, **fields):
        reply, fd = node.request(op, self.address, **fields)
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            raise MemoryTierError(f"memory checkpoint tier: {reply.get('error', 'no reason given')}")
        return reply, fd

    def allocate(self, step: int, rank: int, nbytes: int) -> "Segment":
        """A new writable segment of `nbytes` for (step, rank): fill ``segment.buffer``, then
        ``segment.commit(checksum)`` (the agent keeps it). Writing straight into it is the one copy."""
        _, fd = self._ask(_contract.NODE_OP_MEM_ALLOC, step=step, rank=rank, bytes=nbytes)
        if fd is None:
            raise MemoryTierError("memory checkpoint tier: the agent's reply carried no segment")
        return Segment(self, step, rank, fd, nbytes)

    def put(self, step: int, rank: int, payload, checksum: int = 0, world: int = 0) -> None:
        """Copies `payload` (any bytes-like object) into a new segment of (step, rank) and commits it."""
        view = memoryview(payload).cast("B")
        with self.allocate(step, rank, view.nbytes) as segment:
            if view.nbytes:
                segment.buffer[:] = view
            segment.commit(checksum, world)

    def open(self, rank: int, step: Optional[int] = None, refetch: bool = False) -> Optional["Snapshot"]:
        """The newest (or the given) committed snapshot of `rank`, opened read-only: ``read()``
        (pread: no mapping) or ``buffer`` (mapped on first use); None when the agent holds none.
        `refetch` (with `step`): the copy this agent holds failed its checksum -- it replaces it with
        a peer agent's copy of the same round first (None when no peer has one). Close it (or use
        ``with``) when done."""
        fields = {"rank": rank} if step is None else {"rank": rank, "step": step}
        if refetch:
            fields["refetch"] = True
        reply, fd = node.request(_contract.NODE_OP_MEM_GET, self.address, **fields)
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            return None
        if fd is None:
            raise MemoryTierError("memory checkpoint tier: the agent's reply carried no segment")
        try:
            return Snapshot(int(reply["step"]), rank, int(reply.get("checksum", 0)), int(reply["bytes"]), fd)
        except (KeyError, TypeError, ValueError):
            os.close(fd)
            raise MemoryTierError(f"memory checkpoint tier: a malformed mem_get reply: {reply}") from None

    def get(self, rank: int, step: Optional[int] = None) -> Optional[Tuple[int, bytes, int]]:
        """(step, payload, checksum) of the newest (or the given) committed snapshot of `rank`; None
        when the agent holds none."""
        snapshot = self.open(rank, step)
        if snapshot is None:
            return None
        with snapshot:
            return snapshot.step, bytes(snapshot.buffer), snapshot.checksum

    def list(self) -> dict:
        """The agent's budget, bytes in use and segments (each: step, rank, bytes, committed, world,
        origin -- "own": written on this node; "fetched": copied from a peer agent for this node's
        ranks after a re-form; "replica": held for the partner node, not this node's to restore)."""
        return self._ask(_contract.NODE_OP_MEM_LIST)[0]

    def forget_after(self, step: int) -> int:
        """After a restore to `step` (from files, or a fresh start: 0): the agent drops every
        snapshot of a later step (an abandoned history). Returns how many segments it dropped."""
        return int(self._ask(_contract.NODE_OP_MEM_FORGET, after_step=step)[0].get("dropped", 0))


class Segment:
    """A segment being written (MemoryTier.allocate): ``buffer`` is a writable shared mapping."""

    def __init__(self, tier: MemoryTier, step: int, rank: int, fd: int, nbytes: int):
        self.tier, self.step, self.rank, self.nbytes = tier, step, rank, nbytes
        try:
            self._mapping = _writable_mapping(fd, nbytes) if nbytes else None
        finally:
            os.close(fd)
        self.buffer = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")

    def _unmap(self) -> None:
        # the view goes; the mapping stays in this process's cache for the next snapshot into the
        # same segment (nothing writes through it before the agent hands the segment out again)
        self.buffer.release()  # raises BufferError while a caller still holds a view into it
        self._mapping = None

    def commit(self, checksum: int = 0, world: int = 0) -> None:
        """Releases its buffer (nothing writes into a committed snapshot) and commits it. `world`:
        the world size that wrote it (the agents tell from it when a step is complete job-wide)."""
        self._unmap()
        self.tier._ask(_contract.NODE_OP_MEM_COMMIT, step=self.step, rank=self.rank, checksum=checksum, world=world)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        if self._mapping is not None:  # not committed: left to the agent (an uncommitted segment is never restored)
            self._unmap()


class Snapshot:
    """A committed snapshot opened for reading (MemoryTier.open): ``fd`` is a read-only descriptor
    of it (this object closes it)."""

    def __init__(self, step: int, rank: int, checksum: int, nbytes: int, fd: int):
        self.step, self.rank, self.checksum, self.nbytes, self.fd = step, rank, checksum, nbytes, fd
        self._mapping: Optional[mmap.mmap] = None
        self._buffer: Optional[memoryview] = None

    def read(self, offset: int, nbytes: int) -> bytes:
        """`nbytes` from `offset` (fewer at the end of the snapshot)."""
        return os.pread(self.fd, nbytes, offset)

    @property
    def buffer(self) -> memoryview:
        """The whole snapshot as a read-only view, mapped on first use (its pages in one call:
        MAP_POPULATE)."""
        if self._buffer is None:
            if self.nbytes:
                self._mapping = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                          mmap.PROT_READ)
            self._buffer = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")
        return self._buffer

    def close(self) -> None:
        if self._buffer is not None:
            self._buffer.release()
            self._buffer = None
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
