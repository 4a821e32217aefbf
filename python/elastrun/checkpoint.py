"""Sharded HDF5 checkpoints of PyTorch state_dicts: atomic, resharding, async, verified.

Every rank calls the same function with its state_dict; the C++ library (elastrun's ckpt/) writes
the tensors straight from their memory (DLPack, no copy), each rank 1/N of every replicated tensor,
into ``<ckpt_dir>/step-<N>/`` and commits the step atomically once every rank voted yes::

    import elastrun.checkpoint as ec

    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
    ec.save(state, "ckpt/", step)                    # all ranks; returns when durable

    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    info = ec.load(state, "ckpt/")                   # in place, any world size
    if info is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])    # its state was created by load()

Tensors are datasets named by their path ("model/layer1.weight", "optim/state/0/exp_avg"); the
rest of the tree (int keys, tuples such as Adam's betas, None, bools, floats, strings) is stored
as JSON metadata and comes back with its types. Plain tensors are *replicated* (every rank holds
the same values, as with DDP: checked at save); :class:`Shard` marks this rank's slice of a sharded
tensor. h5py reads the result: ``h5py.File("ckpt/latest/index.h5")["model/layer1.weight"]``.
Format: docs/checkpoint-format.md; guide: docs/python.md.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import struct
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.utils.dlpack import to_dlpack

try:
    from . import _core
except ImportError as e:  # the pure-Python sources without the build (python/ on the path)
    raise ImportError(f"elastrun.checkpoint needs the compiled module elastrun._core ({e}): run scripts/setup and "
                      "import the package from build/python (PYTHONPATH=build/python)") from e
from . import _comm, _contract, _tree
from . import memory as _memory
from ._tree import Shard, TreeError

__all__ = ["save", "load", "read", "AsyncSaver", "Shard", "SaveInfo", "LoadInfo", "list_steps", "verify", "memory_available",
           "CheckpointError", "CorruptCheckpointError", "CheckpointMismatchError", "TreeError"]

CheckpointError = _core.CheckpointError
CheckpointError.__doc__ = "A checkpoint failed (I/O, a failed vote, bad arguments found by the library)."
CorruptCheckpointError = _core.CorruptCheckpointError
CorruptCheckpointError.__doc__ = "The data on disk is damaged, truncated or missing."
CheckpointMismatchError = _core.CheckpointMismatchError
CheckpointMismatchError.__doc__ = "No checkpoint fits the given state_dict (another model: key, dtype or shape)."

DEFAULT_TIMEOUT = _comm.DEFAULT_TIMEOUT

_TORCH_DTYPES = {
    torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
    torch.bool: "bool",
}
_FROM_NAME = {name: dtype for dtype, name in _TORCH_DTYPES.items()}


@dataclass
class SaveInfo:
    """What a save wrote: the committed step directory, this rank's tensor bytes, and problems
    after the commit (the step is durable; e.g. ``latest`` could not be updated)."""

    step: int
    path: str
    bytes_written: int
    snapshot_bytes: int = 0
    warnings: List[str] = field(default_factory=list)


@dataclass
class LoadInfo:
    """What load() restored: the step, its directory ("memory" when it came from the agents'
    memory), the metadata passed to save(), why newer steps were skipped (damage found on some
    rank) and where it came from (`source`: "file", "memory-local" or "memory-partner")."""

    step: int
    path: str
    metadata: Dict[str, Any]
    skipped: List[str] = field(default_factory=list)
    # or "memory-local": every rank's snapshot was written on its own node; "memory-partner": some
    # rank's was copied from a peer agent (a node lost, a rank moved: load(memory=True))
    source: str = "file"


# ---- tensors <-> DLPack entries -------------------------------------------------------------------


def _host_tensor(value: Any, path: str) -> torch.Tensor:
    """A contiguous CPU tensor with the leaf's bytes: the leaf itself when it is one (zero-copy),
    else one copy (non-contiguous), a host copy (CUDA: staged through host memory) or a view
    (numpy arrays)."""
    if isinstance(value, Shard):
        value = value.local_tensor
    if not isinstance(value, torch.Tensor):
        value = _numpy_as_tensor(value, path, copy=True)
    if value.dtype not in _TORCH_DTYPES:
        raise TypeError(f"'{path}': dtype {value.dtype} is not one a checkpoint holds "
                        f"({', '.join(_TORCH_DTYPES.values())})")
    if value.device.type != "cpu":
        value = value.detach().to("cpu")
    if value.is_sparse or value.is_quantized:
        raise TypeError(f"'{path}': sparse and quantized tensors are not supported; save a dense copy")
    return value.detach().contiguous()


def _numpy_as_tensor(array: Any, path: str, copy: bool) -> torch.Tensor:
    """A tensor sharing the array's memory; dtypes torch lacks (numpy's RNG state is uint32) as
    their bytes (the spec keeps the numpy dtype and shape)."""
    import numpy

    if copy:
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        array = numpy.ascontiguousarray(array)
    elif not (array.flags.c_contiguous and array.flags.writeable):
        raise CheckpointMismatchError(f"'{path}': the numpy array in the state_dict is read-only or not "
                                      "C-contiguous; load cannot fill it in place")
    try:
        tensor = torch.from_numpy(array)
    except TypeError:
        tensor = None
    if tensor is None or tensor.dtype not in _TORCH_DTYPES:
        tensor = torch.from_numpy(array.reshape(-1).view(numpy.uint8))
    return tensor


def _capsule(tensor: torch.Tensor) -> Tuple[Any, Optional[str]]:
    # torch 1.13's DLPack export rejects bool: the same bytes as uint8, read back as bool.
    if tensor.dtype == torch.bool:
        return to_dlpack(tensor.view(torch.uint8)), "bool"
    return to_dlpack(tensor), None


def _save_entries(flat: _tree.Flat) -> Tuple[list, list]:
    """DLPack entries for the C++ library and the tensors they point into (kept alive)."""
    entries, keep = [], []
    for leaf in flat.tensors:
        tensor = _host_tensor(leaf.value, leaf.path)
        keep.append(tensor)
        capsule, as_dtype = _capsule(tensor)
        if isinstance(leaf.value, Shard):
            entries.append((leaf.name, capsule, as_dtype, list(leaf.value.global_shape), list(leaf.value.offsets)))
        else:
            entries.append((leaf.name, capsule, as_dtype, None, None))
    return entries, keep


def _metadata_text(state_dict: Any, flat: _tree.Flat, metadata: Optional[Dict[str, Any]]) -> str:
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict (got {type(state_dict).__name__})")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict of JSON values (got {type(metadata).__name__})")
    if _tree.SPEC_KEY in metadata:
        raise ValueError(f"metadata key '{_tree.SPEC_KEY}' is reserved for the state_dict's structure")
    try:
        user = json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata is not JSON-serialisable: {e}") from None
    spec = json.dumps({"version": _tree.SPEC_VERSION, "tree": flat.spec}, allow_nan=False)
    # Splice the spec in without re-encoding the user's part.
    return user[:-1] + ("," if len(user) > 2 else "") + f'"{_tree.SPEC_KEY}":' + spec + "}"


def _save_options(keep_last: int, keep_every: int, check_replicas: str, **extra: Any) -> dict:
    if keep_last < 0 or keep_every < 0:
        raise ValueError(f"keep_last={keep_last}, keep_every={keep_every}: must not be negative")
    options = {"keep_last": keep_last, "keep_every": keep_every, "check_replicas": check_replicas}
    options.update(extra)
    return options


def _check_step(step: int) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int (got {step!r})")
    return step


# ---- save -----------------------------------------------------------------------------------------


def save(state_dict: Dict[str, Any], ckpt_dir: str, step: int, *, metadata: Optional[Dict[str, Any]] = None,
         keep_last: int = 0, keep_every: int = 0, check_replicas: str = "sampled", store: Any = None,
         timeout: datetime.timedelta = DEFAULT_TIMEOUT, tier: str = "file") -> SaveInfo:
    """Saves `state_dict` as step `step` under `ckpt_dir`; every rank calls it. Returns when the step
    is committed and durable (all ranks voted, fsynced, renamed into place, ``latest`` updated).

    state_dict: nested dicts/lists/tuples of tensors (CPU or CUDA; numpy arrays too), Shard slices
        and plain values (int, float, str, bool, None, bytes). Plain tensors must be equal on every
        rank (replicated, as with DDP); each rank writes 1/N of each.
    metadata: a JSON-serialisable dict (epoch, data position, ...) returned by load().
    keep_last, keep_every: retention after the commit -- keep the newest `keep_last` steps (0: all)
        plus every step divisible by `keep_every`.
    check_replicas: "sampled" (default), "full" or "off" -- how replicated tensors are compared
        across ranks (a rank holding other values fails the save instead of mixing copies).
    store: a torch.distributed Store for the ranks' votes (default: the default process group's,
        or one the package opens itself when no group is initialised).

    tier: "file" (the above) or "memory": a snapshot of this rank's state_dict into its node
        agent's memory (``elastrun --memory-checkpoints``; see :func:`memory_available`), which
        outlives this process and is what load() resumes from when it is the newest step every
        rank's node holds. Not collective, no vote, no retention options: the call returns once the
        bytes are copied (one copy, straight into the agent's segment) and committed; `ckpt_dir`
        is not touched. Raises CheckpointError when the agent keeps no memory checkpoints or
        refuses (its budget).

    On failure every rank raises CheckpointError and the previous checkpoint is untouched.
    """
    if tier == "memory":
        return _save_to_memory(state_dict, _check_step(step), metadata)
    if tier != "file":
        raise ValueError(f"tier={tier!r}: expected 'file' or 'memory'")
    os.makedirs(ckpt_dir, exist_ok=True)
    with _comm.collective(ckpt_dir, "sync", store=store, timeout=timeout) as comm:
        _check_step(step)
        options = _save_options(keep_last, keep_every, check_replicas)
        try:
            flat = _tree.flatten(state_dict)
            text = _metadata_text(state_dict, flat, metadata)
            entries, keep = _save_entries(flat)
        except Exception as e:
            # The other ranks are about to wait for this rank's votes: vote no (they fail at once,
            # naming this rank), then raise the cause here.
            try:
                _core.fail_save(os.fspath(ckpt_dir), step, f"{type(e).__name__}: {e}", comm, options)
            except CheckpointError:
                pass
            raise
        result = _core.save(os.fspath(ckpt_dir), step, entries, text, comm, options)
        del keep
    return SaveInfo(step, result["path"], result["bytes_written"], result["snapshot_bytes"], result["warnings"])


# ---- load -----------------------------------------------------------------------------------------


class _Plan:
    """The tensors one checkpoint step needs, matched against the caller's state_dict."""

    def __init__(self, state_dict: Dict[str, Any], index: dict):
        self.index = {name: (dtype, shape) for name, dtype, shape, _ in index["tensors"]}
        meta = json.loads(index["metadata"])
        saved = meta.pop(_tree.SPEC_KEY, None) if isinstance(meta, dict) else None
        self.metadata = meta if isinstance(meta, dict) else {"value": meta}
        if saved is None:  # written by C++ (or without a structure): nested dicts by '/'
            self.spec = _tree.spec_from_names(sorted(self.index))
        else:
            if saved.get("version", 0) > _tree.SPEC_VERSION:
                raise CheckpointError(f"{index['path']}: written by a newer elastrun (state structure "
                                      f"version {saved.get('version')}); upgrade elastrun")
            self.spec = saved["tree"]
        self.step = index["step"]
        self.entries: list = []
        self.targets: List[Tuple[str, torch.Tensor, Optional[List[int]]]] = []  # (name, tensor to fill, Shard offsets)
        self.copy_back: List[Tuple[Any, torch.Tensor]] = []  # (caller's tensor, staging tensor)
        self._check_no_extra_tensors(state_dict, index["step"])
        self.tree = _tree.build(self.spec, state_dict, self._tensor_for)

    def _check_no_extra_tensors(self, state_dict: Dict[str, Any], step: int) -> None:
        wanted = _tree.tensor_paths(self.spec)
        for name, path in _tree.collect_tensor_paths(state_dict):
            if name not in wanted:
                raise CheckpointMismatchError(f"'{path}': in the state_dict but not in checkpoint step {step} "
                                              "(remove it before load, or load into the model it was saved from)")

    def _tensor_for(self, leaf: dict, existing: Any) -> Any:
        name, kind = leaf["name"], leaf["t"]
        if name not in self.index:
            raise CorruptCheckpointError(f"'{name}': in the checkpoint's structure but not in its index")
        dtype_name, shape = self.index[name]
        dtype = _FROM_NAME[dtype_name]
        if kind == "numpy":
            return self._numpy_for(leaf, existing, dtype, shape)
        if isinstance(existing, Shard):
            local = existing.local_tensor
            self._check(name, dtype, local.dtype, None, None)
            if list(existing.global_shape) != list(shape):
                raise CheckpointMismatchError(f"'{name}': global shape {list(shape)} in the checkpoint, "
                                              f"{list(existing.global_shape)} in the Shard")
            self._target(name, local, list(existing.offsets))
            return existing
        if isinstance(existing, torch.Tensor):
            self._check(name, dtype, existing.dtype, shape, list(existing.shape))
            self._target(name, existing, None)
            return existing
        created = torch.empty(shape, dtype=dtype)
        self._target(name, created, None)
        return created

    def _numpy_for(self, leaf: dict, existing: Any, dtype: Any, shape: List[int]) -> Any:
        import numpy

        want = numpy.dtype(leaf["dtype"])
        if existing is None or isinstance(existing, (torch.Tensor, Shard)) or existing.dtype != want \
                or list(existing.shape) != list(leaf["shape"]) or not existing.flags.writeable \
                or not existing.flags.c_contiguous:
            existing = numpy.empty(leaf["shape"], dtype=want)
        tensor = _numpy_as_tensor(existing, leaf["name"], copy=False)
        self._check(leaf["name"], dtype, tensor.dtype, shape, list(tensor.shape))
        self._target(leaf["name"], tensor, None)
        return existing

    @staticmethod
    def _check(name: str, want_dtype: Any, have_dtype: Any, want_shape: Any, have_shape: Any) -> None:
        if want_dtype != have_dtype:
            raise CheckpointMismatchError(f"'{name}': dtype {_TORCH_DTYPES.get(want_dtype)} in the checkpoint, "
                                          f"{have_dtype} in the state_dict")
        if want_shape is not None and list(want_shape) != list(have_shape):
            raise CheckpointMismatchError(f"'{name}': shape {list(want_shape)} in the checkpoint, "
                                          f"{list(have_shape)} in the state_dict")

    def _target(self, name: str, tensor: torch.Tensor, offset: Optional[List[int]]) -> None:
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            into = tensor.detach()
        else:  # read into host memory, then copy into the caller's tensor
            into = torch.empty(tensor.shape, dtype=tensor.dtype)
            self.copy_back.append((tensor, into))
        capsule, as_dtype = _capsule(into)
        self.entries.append((name, capsule, as_dtype, offset))
        self.targets.append((name, into, offset))

    def finish(self, state_dict: Dict[str, Any]) -> None:
        """Copies staged values into the caller's tensors and merges the tree into `state_dict`."""
        for tensor, staged in self.copy_back:
            with torch.no_grad():
                tensor.copy_(staged)
        _tree.merge_into(state_dict, self.tree)


def load(state_dict: Dict[str, Any], ckpt_dir: str, *, verify: bool = True, missing_ok: bool = False,
         memory: bool = True, allow_fresh_start: bool = False, store: Any = None,
         timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Optional[LoadInfo]:
    """Restores the newest valid checkpoint under `ckpt_dir` into `state_dict`, in place; every rank
    calls it, at any world size.

    Tensors already in `state_dict` are filled in place (their dtype and shape must match; a
    Shard reads its box); entries the dict lacks (a fresh optimizer's ``state: {}``) are created
    and inserted; plain values (param_groups' lr, betas, ...) are replaced by the saved ones. A
    damaged step (hash mismatch, missing shard on any rank) is skipped for the previous one.
    Returns None when `ckpt_dir` holds no checkpoint yet.

    missing_ok: a `ckpt_dir` that does not exist means "no checkpoint yet" instead of an error
        (by default a mistyped path fails rather than silently starting afresh).
    memory: when the node's agent keeps memory checkpoints (save(..., tier="memory")), the ranks
        agree on the newest step that every rank's node holds in memory and restore it, from this
        node's agent, when it is not older than the newest step on disk; otherwise (or if any
        rank cannot use it: damaged, another model, a Shard box that moved) the file tier as
        above. Every snapshot in this node's agent newer than the step restored (or than 0, when
        nothing is) is then dropped: an abandoned history, which retention would otherwise keep
        in place of new snapshots. Call load() before the first training step on every rank.
    allow_fresh_start: when steps exist but every one is damaged, return None (one warning line)
        instead of raising CorruptCheckpointError -- by default a job never starts afresh silently.
    Raises CheckpointMismatchError (naming the key) if no checkpoint fits the state_dict,
    CorruptCheckpointError (one line per step) if every step is damaged, and CheckpointError naming
    the rank and node if some rank sees no checkpoint (or no directory) while others do: a
    node-local directory is not a checkpoint directory of the job.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    tier = _memory_tier() if memory else None
    # Without a process group the ranks meet through a file in ckpt_dir (its own store), so a
    # missing directory is "no checkpoint" on its own; with one, the ranks agree on it first.
    if missing_ok and not os.path.isdir(ckpt_dir) and not (tier is not None and _votes_without_dir()) \
            and (store is None and not _comm.group_initialized()):
        return None
    plans: List[_Plan] = []  # the step being tried (restore stops at the one that loads)

    def targets_for(index: dict) -> list:
        plans[:] = [_Plan(state_dict, index)]
        return plans[0].entries

    with _comm.collective(ckpt_dir, "sync", store=store, timeout=timeout) as comm:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (got {type(state_dict).__name__})")
        have_dir = os.path.isdir(ckpt_dir)
        if comm.world_size > 1:
            views = [json.loads(v) for v in _allgather(comm, {"dir": have_dir, "host": os.environ.get(_contract.ENV_NODE) or socket.gethostname()})]
            without = [f"rank {r} (node {v['host']})" for r, v in enumerate(views) if not v["dir"]]
            if without and len(without) < len(views):
                raise CheckpointError(f"{', '.join(without[:4])}{' and more' if len(without) > 4 else ''}: no "
                                      f"directory {ckpt_dir!r} there, while the other ranks have it: is it on a "
                                      "shared filesystem, mounted on every node? Nothing was restored")
        if not have_dir and not missing_ok:
            raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} does not exist "
                                    "(create it, or pass missing_ok=True to start without a checkpoint)")
        if tier is not None:
            info = _restore_from_memory(state_dict, ckpt_dir if have_dir else None, tier, comm)
            if info is not None:
                _forget_after(tier, info.step, comm)
                return info
        result = _core.restore(ckpt_dir, comm, targets_for, verify, allow_fresh_start) if have_dir else None
        if tier is not None:
            _forget_after(tier, 0 if result is None else result["step"], comm)
    if result is None:
        return None
    plan = plans[0]
    assert plan.step == result["step"], (plan.step, result["step"])
    plan.finish(state_dict)
    return LoadInfo(result["step"], result["path"], plan.metadata, result["skipped"])


# ---- the memory tier ------------------------------------------------------------------------------
# A snapshot in the node agent's memory is one segment (docs/checkpoint-format.md, "Memory tier"):
#   [8 bytes: magic][8 bytes: little-endian length H of the header][H bytes: header JSON]
#   [zero padding to a multiple of 64][the tensors' bytes, each at a multiple of 64 from here]
# header: {"step", "rank", "world_size", "metadata": <the metadata text a file checkpoint holds, with
# the state's structure>, "tensors": [[name, dtype, shape, offset, nbytes, shard], ...]} where
# shard is null for a replicated tensor, else [global shape, offsets] of this rank's box. The
# segment's checksum (kept by the agent) is the XXH3-64 of all of it, computed while the tensors
# are copied in (_core.copy_and_hash: one pass, so a snapshot costs about one memcpy).

_MEMORY_MAGIC = b"ERMEM\x001\x00"
_MEMORY_ALIGN = 64


def _aligned(n: int) -> int:
    return (n + _MEMORY_ALIGN - 1) // _MEMORY_ALIGN * _MEMORY_ALIGN


def _memory_tier() -> Optional[_memory.MemoryTier]:
    tier = _memory.MemoryTier()
    return tier if tier.enabled else None


def memory_available() -> bool:
    """True when this process's node agent keeps memory checkpoints (``elastrun
    --memory-checkpoints``): save(..., tier="memory") works and load() looks there too."""
    return _memory_tier() is not None


def _votes_without_dir() -> bool:
    # the votes need no checkpoint directory unless the package must open a store of its own in it
    dist = _comm._dist()
    return (dist is not None and dist.is_initialized()) or _comm.rank_and_world()[1] == 1


class _MemoryCommit:
    """A memory snapshot copied into its segment, not yet committed: finish() hashes the segment
    (XXH3-64, without the GIL) and commits it. AsyncSaver runs it on a thread, so that training is
    blocked only for the copy."""

    def __init__(self, segment: "_memory.Segment", rank: int, total: int, world: int):
        self.segment, self.rank, self.total, self.world = segment, rank, total, world

    def finish(self) -> SaveInfo:
        segment = self.segment
        try:
            with segment:
                segment.commit(_core.xxh3(segment.buffer), self.world)
        except _memory.MemoryTierError as e:
            raise CheckpointError(f"rank {self.rank}: memory snapshot of step {segment.step}: {e}") from None
        return SaveInfo(segment.step, "memory", self.total)


def _save_to_memory(state_dict: Dict[str, Any], step: int, metadata: Optional[Dict[str, Any]],
                    background: bool = False):
    """The snapshot, committed (a SaveInfo); with `background`, copied only (a _MemoryCommit)."""
    tier = _memory_tier()
    if tier is None:
        raise CheckpointError("save(tier='memory'): this node's agent keeps no memory checkpoints "
                              "(start elastrun with --memory-checkpoints)")
    rank, world = _comm.rank_and_world()
    flat = _tree.flatten(state_dict)
    text = _metadata_text(state_dict, flat, metadata)
    tensors, layout, end = [], [], 0
    for leaf in flat.tensors:
        tensor = _host_tensor(leaf.value, leaf.path)
        nbytes = tensor.numel() * tensor.element_size()
        shard = [list(leaf.value.global_shape), list(leaf.value.offsets)] if isinstance(leaf.value, Shard) else None
        tensors.append(tensor)
        layout.append([leaf.name, _TORCH_DTYPES[tensor.dtype], list(tensor.shape), end, nbytes, shard])
        end = _aligned(end + nbytes)
    del flat
    header = json.dumps({"step": step, "rank": rank, "world_size": world, "metadata": text, "tensors": layout},
                        allow_nan=False).encode()
    data_start = _aligned(16 + len(header))
    total = data_start + end
    pieces = []
    for tensor, (name, _, _, offset, nbytes, _) in zip(tensors, layout):
        if nbytes:
            capsule, as_dtype = _capsule(tensor)
            pieces.append((name, capsule, as_dtype, data_start + offset))
    handed_over = False
    try:
        segment = tier.allocate(step, rank, total)
        try:
            buffer = segment.buffer
            buffer[0:16] = _MEMORY_MAGIC + struct.pack("<Q", len(header))
            buffer[16:16 + len(header)] = header
            if background:
                _core.copy_and_hash(buffer, pieces, hash=False)
                handed_over = True
                return _MemoryCommit(segment, rank, total, world)
            segment.commit(_core.copy_and_hash(buffer, pieces), world)
        finally:
            if not handed_over:
                segment.__exit__(None, None, None)  # an uncommitted segment is released, never restored
    except _memory.MemoryTierError as e:
        raise CheckpointError(f"rank {rank}: memory snapshot of step {step}: {e}") from None
    return SaveInfo(step, "memory", total)


def _newest_in_memory(tier: _memory.MemoryTier) -> int:
    """The newest step this node's agent holds a committed snapshot of (any rank; not the replicas it
    keeps for its partner node), or -1 (also when the agent cannot be asked: this rank must still
    vote, or its peers would wait for it)."""
    try:
        steps = [int(s["step"]) for s in tier.list().get("segments", [])
                 if s.get("committed") and s.get("origin", "own") != "replica"]
    except (OSError, ValueError, KeyError, _memory.MemoryTierError) as e:
        print(f"elastrun.checkpoint: asking this node's agent for memory snapshots: {e}", file=sys.stderr, flush=True)
        return -1
    return max(steps, default=-1)


def _open_from_memory(tier: _memory.MemoryTier, step: int, rank: int, world: int, problems: List[str]):
    """(snapshot, header) of `step` from this node's agent that this rank can restore from: its own
    rank's, else (everything replicated) any rank's -- one written here before one copied from a
    peer; checked (magic, checksum). The header's "origin" says where the agent got it. None if none."""
    origins, generations = {}, {}
    for s in tier.list().get("segments", []):
        if s.get("committed") and int(s["step"]) == step:
            origins.setdefault(int(s["rank"]), s.get("origin", "own"))
            generations.setdefault(int(s["rank"]), int(s.get("generation", 0)))
    ranks = sorted(origins, key=lambda r: (r != rank, origins[r] != "own", r))
    for r in ranks:
        for refetch in (False, True):  # a copy that fails its checksum: a peer agent's copy is tried next
            snapshot = tier.open(r, step, refetch=refetch)
            if snapshot is None:
                if refetch:
                    problems.append(f"no peer agent has another copy of rank {r}'s snapshot")
                break
            try:
                start = snapshot.read(0, 16)
                if len(start) < 16 or start[0:8] != _MEMORY_MAGIC or \
                        _core.xxh3_fd(snapshot.fd, snapshot.nbytes) != snapshot.checksum:
                    problems.append(f"the snapshot of rank {r} fails its checksum"
                                    + (" (and so does a peer agent's copy)" if refetch else ""))
                    print(f"elastrun.checkpoint: rank {rank}: the memory snapshot of step {step} rank {r} fails its "
                          f"checksum{' again' if refetch else ': asking a peer agent for its copy'}",
                          file=sys.stderr, flush=True)
                    continue
                (length,) = struct.unpack("<Q", start[8:16])
                header = json.loads(snapshot.read(16, length))
                header["data_start"] = _aligned(16 + length)
                header["origin"] = "fetched" if refetch else origins[r]
                header["generation"] = generations[r]  # the rendezvous round that wrote it
                sharded = any(entry[5] is not None for entry in header["tensors"])
                if not sharded or (r == rank and header["world_size"] == world):
                    result, snapshot = (snapshot, header), None
                    return result
                problems.append(f"the snapshot of rank {r} holds sharded tensors of another rank or world")
                break
            finally:
                if snapshot is not None:
                    snapshot.close()
    return None


def _plan_from_memory(state_dict: Dict[str, Any], header: dict) -> _Plan:
    """The plan of `state_dict` against a memory snapshot, every target checked against the
    snapshot's boxes (raises on a mismatch); nothing is copied yet."""
    by_name = {entry[0]: entry for entry in header["tensors"]}
    index = {"tensors": [(name, dtype, shard[0] if shard else shape, None)
                         for name, dtype, shape, _, _, shard in header["tensors"]],
             "metadata": header["metadata"], "step": header["step"], "path": "memory"}
    plan = _Plan(state_dict, index)
    for name, into, offset in plan.targets:
        _, _, shape, _, nbytes, shard = by_name[name]
        if (shard[1] if shard else None) != offset or list(into.shape) != list(shape) \
                or into.numel() * into.element_size() != nbytes:
            raise CheckpointMismatchError(f"'{name}': the memory snapshot holds another box of it")
    return plan


def _copy_from_memory(plan: _Plan, snapshot: Any, header: dict, state_dict: Dict[str, Any]) -> None:
    # pread straight into the plan's targets (contiguous host tensors: _Plan stages any other) --
    # a new mapping of the segment would pay a fault per page
    by_name = {entry[0]: entry for entry in header["tensors"]}
    start = header["data_start"]
    reads = [(name, capsule, as_dtype, start + by_name[name][3])
             for name, capsule, as_dtype, _ in plan.entries if by_name[name][4]]
    _core.read_into(snapshot.fd, reads)
    plan.finish(state_dict)


def _restore_from_memory(state_dict: Dict[str, Any], ckpt_dir: Optional[str], tier: _memory.MemoryTier,
                         comm: Any) -> Optional[LoadInfo]:
    """Every rank: the newest step every node holds in memory, if not older than the newest on disk
    and usable by every rank; None (nothing changed in `state_dict`) to let the file tier decide."""
    rank, world = comm.rank, comm.world_size
    mine = _newest_in_memory(tier)
    newest_file = max((step for step, _ in list_steps(ckpt_dir)), default=-1) if ckpt_dir else -1
    votes = [json.loads(v) for v in _allgather(comm, {"memory": mine, "file": newest_file})]
    step = min(v["memory"] for v in votes)
    newest_file = max(v["file"] for v in votes)
    if step < 0 or step < newest_file:
        return None
    problems: List[str] = []
    try:
        opened = _open_from_memory(tier, step, rank, world, problems)
    except (OSError, ValueError, KeyError, _memory.MemoryTierError) as e:
        opened = None
        problems.append(f"reading this node's agent: {e}")
    try:
        plan = None
        if opened is not None:
            try:
                plan = _plan_from_memory(state_dict, opened[1])
            except (CheckpointError, TreeError, KeyError, ValueError) as e:
                problems.append(f"{type(e).__name__}: {e}")
        elif not problems:
            problems.append(f"this node's agent holds no snapshot of step {step} for rank {rank}")
        # The caller's tensors are written only once every rank knows it can restore this step.
        mine_from = None
        if plan is not None:
            mine_from = (f"rank {opened[1]['rank']}'s snapshot, "
                         + ("written on this node" if opened[1]["origin"] == "own" else "copied from a peer agent"))
        usable = [json.loads(v) for v in _allgather(comm, {"ok": plan is not None, "why": problems[:1],
                                                           "partner": plan is not None and opened[1]["origin"] != "own",
                                                           "generation": opened[1]["generation"] if plan else None})]
        # one step written in two rounds is two histories (a node that was cut off and came back):
        # never restored together
        if len({v["generation"] for v in usable}) > 1 and all(v["ok"] for v in usable):
            if rank == 0:
                print(f"elastrun.checkpoint: the ranks' memory snapshots of step {step} were written in different "
                      f"rendezvous rounds ({sorted({v['generation'] for v in usable})}): restoring from the file tier",
                      file=sys.stderr, flush=True)
            return None
        if not all(v["ok"] for v in usable):
            if rank == 0:
                why = next((f"rank {r}: {v['why'][0]}" for r, v in enumerate(usable) if v["why"]), "")
                print(f"elastrun.checkpoint: the memory snapshot of step {step} is not usable on every rank "
                      f"({why}): restoring from the file tier", file=sys.stderr, flush=True)
            return None
        # Every rank learns whether every copy worked (a rank that raised alone would leave the
        # others waiting in the next collective; its tensors may be partly written).
        failure = None
        try:
            _copy_from_memory(plan, opened[0], opened[1], state_dict)
        except Exception as e:  # noqa: BLE001 -- reported on every rank below
            failure = f"{type(e).__name__}: {e}"
        copied = [json.loads(v) for v in _allgather(comm, {"ok": failure is None, "why": failure})]
        failed = [(r, v["why"]) for r, v in enumerate(copied) if not v["ok"]]
        if failed:
            raise CheckpointError(f"restoring step {step} from the agents' memory failed on rank {failed[0][0]}: "
                                  f"{failed[0][1]} (its tensors may be partly written: load again, "
                                  "memory=False for the file tier)")
    finally:
        if opened is not None:
            opened[0].close()
    print(f"elastrun.checkpoint: rank {rank} restored step {step} from the agents' memory: {mine_from}",
          file=sys.stderr, flush=True)
    source = "memory-partner" if any(v.get("partner") for v in usable) else "memory-local"
    return LoadInfo(step, "memory", plan.metadata, [], source=source)


def _allgather(comm: Any, value: Dict[str, Any]) -> List[bytes]:
    return comm.allgather(json.dumps(value).encode())


def _forget_after(tier: _memory.MemoryTier, step: int, comm: Any) -> None:
    try:
        tier.forget_after(step)
    except (OSError, _memory.MemoryTierError) as e:
        print(f"elastrun.checkpoint: dropping memory snapshots after step {step}: {e}", file=sys.stderr, flush=True)
    # Every rank's drop happens before any rank's next snapshot: without this, a fast rank's
    # snapshot of step+1 could be dropped by a slower rank's forget_after (a race seen in tests).
    _allgather(comm, {})


# ---- async ----------------------------------------------------------------------------------------

_live_savers: "weakref.WeakSet[AsyncSaver]" = weakref.WeakSet()


@atexit.register
def _drain_savers() -> None:
    # The writer thread takes the GIL for its votes: it must be done before the interpreter goes.
    for saver in list(_live_savers):
        try:
            saver.close()
        except Exception as e:  # noqa: BLE001 -- reported, never raised at exit
            print(f"elastrun.checkpoint: the last async save failed: {e}", flush=True)


class AsyncSaver:
    """Saves in the background: ``save()`` returns once this rank's tensors are copied (a memcpy of
    its 1/N share into a reused staging buffer), then a C++ thread writes, fsyncs and votes without
    the GIL (it takes the GIL only for the few store calls of a vote). One save in flight: the next
    save() first waits for the previous one, and raises its error if it failed.

        saver = ec.AsyncSaver("ckpt/", keep_last=3)
        for step in ...:
            train_step()
            if step % 100 == 0:
                saver.save({"model": model.state_dict(), "optim": opt.state_dict()}, step)
        saver.wait()   # before exiting: the last save is durable (also done at interpreter exit)

    snapshot="fork" copies on write in a forked child instead of copying (docs/checkpoint-format.md).

    save(..., tier="memory") puts the snapshot into the node agent's memory like
    ``save(..., tier="memory")`` does, but returns right after the copy into the agent's segment:
    this saver's thread then hashes the segment and commits it. Until then the agent's newest
    snapshot of this rank is the previous one (what a crash in between restores). Keep file and
    memory saves in two savers: a memory snapshot every step should not wait for a file save in
    flight.
    """

    def __init__(self, ckpt_dir: str, *, keep_last: int = 0, keep_every: int = 0, check_replicas: str = "sampled",
                 snapshot: str = "copy", store: Any = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        self.ckpt_dir = os.fspath(ckpt_dir)
        os.makedirs(self.ckpt_dir, exist_ok=True)
        comm = _comm.communicator(self.ckpt_dir, _comm.async_purpose(), store=store, timeout=timeout)
        self._saver = _core.AsyncSaver(self.ckpt_dir, comm,
                                       _save_options(keep_last, keep_every, check_replicas, snapshot=snapshot))
        self._pending_step: Optional[int] = None
        self._last_tier = "file"
        self._memory_thread: Optional[threading.Thread] = None
        self._memory_outcome: List[Any] = []  # [SaveInfo] or [exception] of the memory commit in flight
        _live_savers.add(self)

    def _wait_memory(self) -> Optional[SaveInfo]:
        """Waits for the memory commit in flight; returns its result or raises its error."""
        if self._memory_thread is None:
            return None
        self._memory_thread.join()
        self._memory_thread = None
        outcome, self._memory_outcome = self._memory_outcome, []
        if not outcome:
            raise CheckpointError("the memory snapshot's commit thread ended without a result")
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    def _save_memory(self, state_dict: Dict[str, Any], step: int, metadata: Optional[Dict[str, Any]]) -> None:
        self._saver.wait()  # one save in flight: a file save first
        self._wait_memory()
        pending = _save_to_memory(state_dict, step, metadata, background=True)
        self._pending_step, self._last_tier = step, "memory"
        outcome = self._memory_outcome

        def commit():
            try:
                outcome.append(pending.finish())
            except BaseException as e:  # raised by the next save() or wait()
                outcome.append(e)

        thread = threading.Thread(target=commit, name=f"elastrun-memory-commit-{step}")
        try:
            thread.start()
        except BaseException:
            pending.segment.__exit__(None, None, None)  # uncommitted: released, never restored
            raise
        self._memory_thread = thread

    def save(self, state_dict: Dict[str, Any], step: int, *, metadata: Optional[Dict[str, Any]] = None,
             tier: str = "file") -> None:
        """Snapshots `state_dict` and returns; the tensors may be modified right after. Raises the
        previous save's error, if it failed (this one is then not started). tier="memory": into
        the node agent's memory (see the class's doc)."""
        if self._saver is None:
            raise CheckpointError("this AsyncSaver is closed")
        _check_step(step)
        if tier == "memory":
            self._save_memory(state_dict, step, metadata)
            return
        if tier != "file":
            raise ValueError(f"tier={tier!r}: expected 'file' or 'memory'")
        self._wait_memory()
        self._last_tier = "file"
        try:
            flat = _tree.flatten(state_dict)
            text = _metadata_text(state_dict, flat, metadata)
            entries, keep = _save_entries(flat)
        except Exception as e:
            # The other ranks' writers are about to wait for this rank's votes: vote no, so that
            # every rank's next wait()/save() raises this instead of timing out, and raise here.
            self._saver.fail(step, f"{type(e).__name__}: {e}")
            self._pending_step = step
            raise
        self._saver.save(step, entries, text)
        del keep
        self._pending_step = step

    def wait(self) -> Optional[SaveInfo]:
        """Blocks until no save is in flight; returns the last save's result, or raises its error."""
        if self._saver is None:
            return None
        memory = self._wait_memory()
        result = self._saver.wait()
        if self._last_tier == "memory":
            return memory
        if result is None:
            return None
        return SaveInfo(self._pending_step if self._pending_step is not None else -1, result["path"],
                        result["bytes_written"], result["snapshot_bytes"], result["warnings"])

    @property
    def busy(self) -> bool:
        """True while a save is being written (or a memory snapshot committed)."""
        return self._saver is not None and (self._saver.busy or
                                            (self._memory_thread is not None and self._memory_thread.is_alive()))

    def close(self) -> None:
        """Waits for the save in flight (raising its error) and releases the writer thread."""
        if self._saver is None:
            return
        try:
            try:
                self._wait_memory()
            finally:
                self._saver.wait()
        finally:
            self._saver = None
            _live_savers.discard(self)

    def __enter__(self) -> "AsyncSaver":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- inspection -----------------------------------------------------------------------------------


def list_steps(ckpt_dir: str) -> List[Tuple[int, str]]:
    """Committed steps under `ckpt_dir`, oldest first, as (step, directory)."""
    return [(step, path) for step, path in _core.list_steps(os.fspath(ckpt_dir))]


def read(path: str, *, verify: bool = True) -> Tuple[Dict[str, Any], LoadInfo]:
    """The whole state of one step in this process, as ``torch.load`` would give it: every tensor
    at its global shape (Shard slices of any world size come back whole), plain values with their
    types. `path`: a step directory, or a checkpoint directory for its newest committed step. No
    vote and no process group: for tools (export, inspection), not for resuming training."""
    path = os.fspath(path)
    step_dir = path
    if not os.path.isfile(os.path.join(path, "index.h5")):
        steps = list_steps(path) if os.path.isdir(path) else []
        if not steps:
            raise FileNotFoundError(f"{path!r} is neither a step directory (no index.h5) nor a checkpoint "
                                    "directory with a committed step")
        step_dir = steps[-1][1]
    state: Dict[str, Any] = {}
    plans: List[_Plan] = []

    def targets_for(index: dict) -> list:
        plans[:] = [_Plan(state, index)]
        return plans[0].entries

    index = _core.read_step(step_dir, targets_for, verify)
    plans[0].finish(state)
    return state, LoadInfo(index["step"], index["path"], plans[0].metadata)


def verify(step_dir: str) -> List[str]:
    """Reads every shard of one step directory and checks its hashes; one line per problem."""
    return list(_core.verify(os.fspath(step_dir)))
