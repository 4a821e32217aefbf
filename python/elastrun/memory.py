"""The memory checkpoint tier, worker side: a rank's snapshot goes into a segment its node's agent
owns (a memfd the agent creates and passes over the node endpoint), so it outlives the worker that
wrote it (a crash, a restart) and goes with the agent (its exit, kill -9). On when the agent runs
with --memory-checkpoints. The C++ twin is <elastrun/worker/memory.hpp>.

    tier = elastrun.memory.MemoryTier()
    if tier.enabled:
        tier.put(step, rank, payload, checksum=zlib.crc32(payload))
    got = tier.get(rank)            # None, or (step, bytes, checksum) of the newest snapshot
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

    def put(self, step: int, rank: int, payload, checksum: int = 0) -> None:
        """Copies `payload` (any bytes-like object) into a new segment of (step, rank) and commits it."""
        view = memoryview(payload).cast("B")
        _, fd = self._ask(_contract.NODE_OP_MEM_ALLOC, step=step, rank=rank, bytes=view.nbytes)
        if fd is None:
            raise MemoryTierError("memory checkpoint tier: the agent's reply carried no segment")
        try:
            if view.nbytes:
                with mmap.mmap(fd, view.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as m:
                    m[:] = view
        finally:
            os.close(fd)
        self._ask(_contract.NODE_OP_MEM_COMMIT, step=step, rank=rank, checksum=checksum)

    def get(self, rank: int, step: Optional[int] = None) -> Optional[Tuple[int, bytes, int]]:
        """(step, payload, checksum) of the newest (or the given) committed snapshot of `rank`; None
        when the agent holds none."""
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
            payload = b""
            if size:
                with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                    payload = m[:]
        finally:
            os.close(fd)
        return int(reply["step"]), payload, int(reply.get("checksum", 0))

    def list(self) -> dict:
        """The agent's budget, bytes in use and segments."""
        return self._ask(_contract.NODE_OP_MEM_LIST)[0]

    def forget_after(self, step: int) -> int:
        """After a restore to `step` (from files, or a fresh start: 0): the agent drops every
        snapshot of a later step (an abandoned history). Returns how many segments it dropped."""
        return int(self._ask(_contract.NODE_OP_MEM_FORGET, after_step=step)[0].get("dropped", 0))
