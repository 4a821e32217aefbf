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

import mmap
import os
from typing import Optional, Tuple

from . import _contract, node


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
        ``segment.commit(checksum)`` (the agent seals it). Writing straight into it is the one copy."""
        _, fd = self._ask(_contract.NODE_OP_MEM_ALLOC, step=step, rank=rank, bytes=nbytes)
        if fd is None:
            raise MemoryTierError("memory checkpoint tier: the agent's reply carried no segment")
        return Segment(self, step, rank, fd, nbytes)

    def put(self, step: int, rank: int, payload, checksum: int = 0) -> None:
        """Copies `payload` (any bytes-like object) into a new segment of (step, rank) and commits it."""
        view = memoryview(payload).cast("B")
        with self.allocate(step, rank, view.nbytes) as segment:
            if view.nbytes:
                segment.buffer[:] = view
            segment.commit(checksum)

    def open(self, rank: int, step: Optional[int] = None) -> Optional["Snapshot"]:
        """The newest (or the given) committed snapshot of `rank` as a private copy-on-write
        mapping (no copy until read; writes to it stay in this process); None when the agent holds
        none. Close it (or use ``with``) when done."""
        fields = {"rank": rank} if step is None else {"rank": rank, "step": step}
        reply, fd = node.request(_contract.NODE_OP_MEM_GET, self.address, **fields)
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            return None
        if fd is None:
            raise MemoryTierError("memory checkpoint tier: the agent's reply carried no segment")
        try:
            size = int(reply["bytes"])
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None
        finally:
            os.close(fd)
        return Snapshot(int(reply["step"]), rank, int(reply.get("checksum", 0)), size, mapping)

    def get(self, rank: int, step: Optional[int] = None) -> Optional[Tuple[int, bytes, int]]:
        """(step, payload, checksum) of the newest (or the given) committed snapshot of `rank`; None
        when the agent holds none."""
        snapshot = self.open(rank, step)
        if snapshot is None:
            return None
        with snapshot:
            return snapshot.step, bytes(snapshot.buffer), snapshot.checksum

    def list(self) -> dict:
        """The agent's budget, bytes in use and segments."""
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
            self._mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if nbytes else None
        finally:
            os.close(fd)
        self.buffer = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")

    def _unmap(self) -> None:
        self.buffer.release()  # raises BufferError while a caller still holds a view into it
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def commit(self, checksum: int = 0) -> None:
        """Unmaps it (the agent refuses to seal a segment mapped writable) and commits it."""
        self._unmap()
        self.tier._ask(_contract.NODE_OP_MEM_COMMIT, step=self.step, rank=self.rank, checksum=checksum)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        if self._mapping is not None:  # not committed: left to the agent (an uncommitted segment is never restored)
            self._unmap()


class Snapshot:
    """A committed snapshot opened for reading (MemoryTier.open)."""

    def __init__(self, step: int, rank: int, checksum: int, nbytes: int, mapping):
        self.step, self.rank, self.checksum, self.nbytes = step, rank, checksum, nbytes
        self._mapping = mapping
        self.buffer = memoryview(mapping) if mapping is not None else memoryview(b"")

    def close(self) -> None:
        self.buffer.release()
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None

    def __enter__(self) -> "Snapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
