"""Exactly-once data for elastic training: a sample order that does not depend on the world size.

The job consumes one global stream of sample positions 0, 1, 2, ...; step s takes the positions
[s*B, (s+1)*B) for a constant global batch B, and rank r of W takes a contiguous share of them
(shares differ by at most one). Position p is sample ``perm_e[p % N]`` of a dataset of N samples,
where e = p // N is the epoch and perm_e a permutation drawn from (seed, e) alone. So a job that
resumes at position p -- after a failure, at another world size -- sees exactly the samples the
failure-free run would have, none twice, none skipped.

    sampler = ElasticSampler(len(dataset), global_batch_size=256, start_index=resume_position)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    for step, batch in enumerate(loader, start=first_step):
        ...
        next_position = sampler.position_after(step + 1 - first_step)   # store it in the checkpoint

Scale the loss by W / B times the sum over this rank's samples (DDP averages over the ranks) and
every world size computes the same update (up to float summation order).
"""

from __future__ import annotations

import os
from typing import Iterator, List, Optional

__all__ = ["ElasticSampler", "share_of"]


def share_of(total: int, world_size: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `total` items over `world_size` ranks: total // W each,
    one more for the first total % W ranks (the C++ reference trainer's split)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world size {world_size} is not a valid rank")
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class ElasticSampler:
    """A ``torch.utils.data`` batch sampler (pass it as ``batch_sampler=``) yielding this rank's
    dataset indices of each global batch, from a world-size-independent global position.

    dataset_size: N, the number of samples.
    global_batch_size: B, samples per step over all ranks (constant whatever the world size).
    rank, world_size: default torch.distributed's, else $RANK / $WORLD_SIZE, else 0 / 1.
    shuffle, seed: a fresh permutation of the dataset per epoch, drawn from (seed, epoch) alone;
        without shuffle the order is 0..N-1 every epoch.
    start_index: the global position to start at (the value stored in the checkpoint).
    num_steps: stop after this many steps (default: never -- the training loop decides).
    """

    def __init__(self, dataset_size: int, global_batch_size: int, *, rank: Optional[int] = None,
                 world_size: Optional[int] = None, shuffle: bool = True, seed: int = 0, start_index: int = 0,
                 num_steps: Optional[int] = None):
        if dataset_size < 1:
            raise ValueError(f"dataset_size must be positive (got {dataset_size})")
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be positive (got {global_batch_size})")
        if start_index < 0:
            raise ValueError(f"start_index must not be negative (got {start_index})")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if self.world_size > global_batch_size:
            raise ValueError(f"global batch {global_batch_size} is smaller than the world size {self.world_size}: "
                             "some ranks would get no samples")
        self.shuffle = shuffle
        self.seed = seed
        self.start_index = start_index
        self.num_steps = num_steps
        self._epoch: Optional[int] = None
        self._permutation: Optional[List[int]] = None

    def position_after(self, steps: int) -> int:
        """The global position after `steps` steps from start_index (what a checkpoint stores)."""
        return self.start_index + steps * self.global_batch_size

    def indices(self, position: int, count: int) -> List[int]:
        """Dataset indices of the global positions [position, position + count)."""
        return [self._index_at(p) for p in range(position, position + count)]

    def batch_at(self, step: int) -> List[int]:
        """This rank's dataset indices of step `step` counted from start_index."""
        share = share_of(self.global_batch_size, self.world_size, self.rank)
        return self.indices(self.position_after(step) + share.start, len(share))

    def __iter__(self) -> Iterator[List[int]]:
        step = 0
        while self.num_steps is None or step < self.num_steps:
            yield self.batch_at(step)
            step += 1

    def __len__(self) -> int:
        if self.num_steps is None:
            raise TypeError("ElasticSampler without num_steps has no length (it never ends)")
        return self.num_steps

    def _index_at(self, position: int) -> int:
        epoch, offset = divmod(position, self.dataset_size)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            import torch
            generator = torch.Generator()
            generator.manual_seed((self.seed * 1_000_003 + epoch) & 0x7FFF_FFFF_FFFF_FFFF)
            self._permutation = torch.randperm(self.dataset_size, generator=generator).tolist()
            self._epoch = epoch
        assert self._permutation is not None
        return self._permutation[offset]


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> tuple:
    r = w = None
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    if r is None:
        r, w = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    r = r if rank is None else rank
    w = w if world_size is None else world_size
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"rank {r} of world size {w} is not a valid rank")
    return r, w
