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
from . import _comm, _tree
from ._tree import Shard, TreeError

__all__ = ["save", "load", "AsyncSaver", "Shard", "SaveInfo", "LoadInfo", "list_steps", "verify",
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
    """What load() restored: the step, its directory, the metadata passed to save(), and why newer
    steps were skipped (damage found on some rank)."""

    step: int
    path: str
    metadata: Dict[str, Any]
    skipped: List[str] = field(default_factory=list)


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
         timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> SaveInfo:
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

    On failure every rank raises CheckpointError and the previous checkpoint is untouched.
    """
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


def load(state_dict: Dict[str, Any], ckpt_dir: str, *, verify: bool = True, missing_ok: bool = False,
         store: Any = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Optional[LoadInfo]:
    """Restores the newest valid checkpoint under `ckpt_dir` into `state_dict`, in place; every rank
    calls it, at any world size.

    Tensors already in `state_dict` are filled in place (their dtype and shape must match; a
    Shard reads its box); entries the dict lacks (a fresh optimizer's ``state: {}``) are created
    and inserted; plain values (param_groups' lr, betas, ...) are replaced by the saved ones. A
    damaged step (hash mismatch, missing shard on any rank) is skipped for the previous one.
    Returns None when `ckpt_dir` holds no checkpoint yet.

    missing_ok: a `ckpt_dir` that does not exist means "no checkpoint yet" instead of an error
        (by default a mistyped path fails rather than silently starting afresh).
    Raises CheckpointMismatchError (naming the key) if no checkpoint fits the state_dict.
    """
    ckpt_dir = os.fspath(ckpt_dir)
    if missing_ok and not os.path.isdir(ckpt_dir):
        return None
    plans: List[_Plan] = []  # the step being tried (restore stops at the one that loads)

    def targets_for(index: dict) -> list:
        plans[:] = [_Plan(state_dict, index)]
        return plans[0].entries

    with _comm.collective(ckpt_dir, "sync", store=store, timeout=timeout) as comm:
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict (got {type(state_dict).__name__})")
        if not os.path.isdir(ckpt_dir):
            raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} does not exist "
                                    "(create it, or pass missing_ok=True to start without a checkpoint)")
        result = _core.restore(ckpt_dir, comm, targets_for, verify)
    if result is None:
        return None
    plan = plans[0]
    assert plan.step == result["step"], (plan.step, result["step"])
    for tensor, staged in plan.copy_back:
        with torch.no_grad():
            tensor.copy_(staged)
    _tree.merge_into(state_dict, plan.tree)
    return LoadInfo(result["step"], result["path"], plan.metadata, result["skipped"])


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
    """

    def __init__(self, ckpt_dir: str, *, keep_last: int = 0, keep_every: int = 0, check_replicas: str = "sampled",
                 snapshot: str = "copy", store: Any = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        self.ckpt_dir = os.fspath(ckpt_dir)
        os.makedirs(self.ckpt_dir, exist_ok=True)
        comm = _comm.communicator(self.ckpt_dir, _comm.async_purpose(), store=store, timeout=timeout)
        self._saver = _core.AsyncSaver(self.ckpt_dir, comm,
                                       _save_options(keep_last, keep_every, check_replicas, snapshot=snapshot))
        self._pending_step: Optional[int] = None
        _live_savers.add(self)

    def save(self, state_dict: Dict[str, Any], step: int, *, metadata: Optional[Dict[str, Any]] = None) -> None:
        """Snapshots `state_dict` and returns; the tensors may be modified right after. Raises the
        previous save's error, if it failed (this one is then not started)."""
        if self._saver is None:
            raise CheckpointError("this AsyncSaver is closed")
        _check_step(step)
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
        result = self._saver.wait()
        if result is None:
            return None
        return SaveInfo(self._pending_step if self._pending_step is not None else -1, result["path"],
                        result["bytes_written"], result["snapshot_bytes"], result["warnings"])

    @property
    def busy(self) -> bool:
        """True while a save is being written."""
        return self._saver is not None and self._saver.busy

    def close(self) -> None:
        """Waits for the save in flight (raising its error) and releases the writer thread."""
        if self._saver is None:
            return
        try:
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


def verify(step_dir: str) -> List[str]:
    """Reads every shard of one step directory and checks its hashes; one line per problem."""
    return list(_core.verify(os.fspath(step_dir)))
