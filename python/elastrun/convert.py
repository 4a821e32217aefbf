"""Existing PyTorch checkpoints in and out of elastrun's format: ``torch.save`` files and
``torch.distributed.checkpoint`` (DCP) directories. ``elastrun-ckpt import`` and ``elastrun-ckpt
export --format torch|dcp`` hand over to this module (the C++ tool links no torch)::

    elastrun-ckpt import checkpoint.pth.tar --to ckpt/          # one state, or one file per rank
    elastrun-ckpt import dcp_dir/ --to ckpt/                    # a DCP directory (.metadata)
    elastrun-ckpt export ckpt/ --format torch --to model.pt      # '{rank}' in --to: one file per rank
    elastrun-ckpt export ckpt/ --format dcp --to dcp_out/

An import writes one committed step (world size 1) that ``elastrun.checkpoint.load`` restores at
any world size: tensors become datasets, everything else (``epoch``, ``arch``, ``param_groups``)
keeps its type in the state's structure, and the top level's plain values are also the step's
metadata (``LoadInfo.metadata``). Files of several ranks are merged: what all of them hold bit for
bit is stored once (replicated, as DDP's ranks hold it); what differs is stacked along a new first
dimension (one row per rank) and named in the metadata, so export can split it again.

Pickles (``torch.save``'s format, DCP's ``.metadata``) are read with a restricted unpickler, as
``torch.load(weights_only=True)`` does: tensors, containers, numbers, strings, numpy values and
DCP's metadata records; any other global (a pickle can call anything it names) is refused.
torch 1.13's own ``weights_only`` cannot be used: it refuses floats, so every optimizer state.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import shutil
import struct
import sys
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _tree
from . import checkpoint as _checkpoint

__all__ = ["import_checkpoint", "export_checkpoint", "read_torch", "read_dcp", "ConvertError", "main"]

# The metadata key an import writes: where the state came from and which entries are per rank.
IMPORT_KEY = "elastrun_import"
# Top-level int entries an import takes as the step number when none is given, in this order.
STEP_KEYS = ("step", "global_step", "iteration")


class ConvertError(Exception):
    """The input cannot be converted (the message names the file and the entry)."""


# ---- the restricted unpickler ---------------------------------------------------------------------

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed._shard.checkpoint.metadata",
                "torch.distributed.checkpoint.filesystem", "torch.distributed._shard.checkpoint.filesystem")
# TensorProperties (and torch 2's encoding of its memory format) live with ShardedTensor's metadata.
_TENSOR_PROPERTIES = ("torch.distributed._shard.sharded_tensor.metadata",
                      {"TensorProperties", "MEM_FORMAT_ENCODING", "_MEM_FORMAT_ENCODING"})
_NUMPY_GLOBALS = {"scalar", "_reconstruct", "dtype", "ndarray"}
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("_codecs", "encode"): None,  # protocol 2 pickles bytes as _codecs.encode(str, "latin1")
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): None,  # a layout by its name
    ("torch", "device"): torch.device,
    ("torch", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch._utils", "_rebuild_tensor_v2"): None,
    ("torch._utils", "_rebuild_parameter"): None,
    ("torch._utils", "_rebuild_parameter_with_state"): None,
    ("torch._tensor", "_rebuild_from_type_v2"): None,
}


def _path_text(*parts: Any) -> str:
    """A pickled pathlib path (torch >= 2.4 keeps DCP's checkpoint_id as one) as its text."""
    import pathlib

    return str(pathlib.PurePosixPath(*[str(p) for p in parts]))


_PATH_CLASSES = {"PosixPath", "PurePosixPath", "Path", "PurePath", "WindowsPath", "PureWindowsPath"}


class _Refused(pickle.UnpicklingError):
    """A global the restricted unpickler does not call."""


class _Record:
    """One of DCP's metadata records (Metadata, TensorStorageMetadata, MetadataIndex, ...) as plain
    attributes, whichever torch version wrote it (1.13 keeps them in torch.distributed._shard)."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif isinstance(state, tuple) and len(state) == 2 and all(p is None or isinstance(p, dict) for p in state):
            for part in state:  # (__dict__, __slots__ values)
                self.__dict__.update(part or {})
        else:
            self.state = state  # e.g. torch 2's TensorProperties.__getstate__: a tuple, dtype first


_record_types: Dict[str, type] = {}


def _record_type(name: str) -> type:
    if name not in _record_types:
        _record_types[name] = type(name, (_Record,), {})
    return _record_types[name]


def _record_member(owner: Any, name: str) -> Any:
    """builtins.getattr as the unpickler offers it: Python >= 3.11 pickles an enum member (DCP's
    memory-format encoding) as getattr(EnumClass, name); only a record's members are looked up."""
    if isinstance(owner, type) and issubclass(owner, _Record) and isinstance(name, str):
        return owner(name)
    raise _Refused(f"refusing getattr on {owner!r} (only DCP metadata enums are read)")


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) names Python 2's modules: __builtin__.set is builtins.set
        import _compat_pickle

        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) == ("builtins", "getattr"):
            return _record_member
        if (module, name) in _SAFE_GLOBALS:
            import importlib

            found = _SAFE_GLOBALS[(module, name)]
            return found if found is not None else getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format)):
            return getattr(torch, name)
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
            return _path_text
        if module in _DCP_MODULES or (module == _TENSOR_PROPERTIES[0] and name in _TENSOR_PROPERTIES[1]):
            return _record_type(name)
        if module in ("numpy.core.multiarray", "numpy._core.multiarray", "numpy") and name in _NUMPY_GLOBALS:
            import importlib

            return getattr(importlib.import_module(module), name)
        raise _Refused(f"refusing the global {module}.{name} (only tensors, containers, numbers, "
                                     "strings and numpy values are read)")


class _SafePickleModule:
    """What torch.load's pickle_module needs: Unpickler and load."""

    Unpickler = _SafeUnpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(f: Any, **kwargs: Any) -> Any:
        return _SafeUnpickler(f, **kwargs).load()


def _safe_torch_load(source: Any) -> Any:
    """torch.load's two readers (zip, and the legacy format before torch 1.6) with the restricted
    unpickler: torch 1.13's torch.load replaces any pickle_module by pickle unless weights_only."""
    from torch import serialization

    with serialization._open_file_like(source, "rb") as opened:
        if serialization._is_zipfile(opened):
            with serialization._open_zipfile_reader(opened) as archive:
                if serialization._is_torchscript_zip(archive):
                    raise _Refused("a TorchScript archive (torch.jit.save), not a torch.save state")
                return serialization._load(archive, "cpu", _SafePickleModule, encoding="utf-8")
        return serialization._legacy_load(opened, "cpu", _SafePickleModule, encoding="utf-8")


def _torch_load(source: Any, what: str) -> Any:
    try:
        return _safe_torch_load(source)
    except _Refused as e:
        raise ConvertError(f"{what}: {e}; re-save it with torch.save of a state made of tensors, dicts, lists and "
                           "plain values") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, KeyError, TypeError,
            AttributeError, IndexError) as e:
        raise ConvertError(f"{what}: not a file torch.save wrote ({type(e).__name__}: {one_line(str(e))})") from None


def one_line(text: str) -> str:
    return " ".join(text.split())


# ---- reading --------------------------------------------------------------------------------------


def read_torch(path: str) -> Any:
    """The object a torch.save file holds, read with the restricted unpickler, on the CPU."""
    if not os.path.isfile(path):
        raise ConvertError(f"{path}: no such file")
    return _torch_load(path, path)


def _dcp_dtype(properties: Any, where: str) -> torch.dtype:
    dtype = getattr(properties, "dtype", None)
    if dtype is None and isinstance(getattr(properties, "state", None), tuple):
        dtype = properties.state[0]
    if not isinstance(dtype, torch.dtype):
        raise ConvertError(f"{where}: no dtype in the tensor's metadata")
    return dtype


def read_dcp(path: str) -> Dict[str, Any]:
    """The state a torch.distributed.checkpoint directory holds (every chunk of every tensor,
    assembled on the CPU), nested again as torch >= 2.0 flattened it."""
    metadata_file = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata_file):
        raise ConvertError(f"{path}: no .metadata file; a DCP directory holds one (give torch.save files or a "
                           "DCP directory)")
    try:
        with open(metadata_file, "rb") as f:
            meta = _SafeUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise ConvertError(f"{metadata_file}: {one_line(str(e)) or type(e).__name__}") from None
    if type(meta).__name__ != "Metadata" or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
        raise ConvertError(f"{metadata_file}: not DCP metadata (a {type(meta).__name__})")
    where: Dict[Tuple[str, Optional[Tuple[int, ...]]], Any] = {}
    for index, info in getattr(meta, "storage_data", {}).items():
        offset = getattr(index, "offset", None)
        where[(index.fqn, None if offset is None else tuple(offset))] = info

    def item_bytes(fqn: str, offset: Optional[Tuple[int, ...]]) -> Tuple[bytes, str]:
        info = where.get((fqn, offset))
        if info is None:
            raise ConvertError(f"{path}: '{fqn}' has no storage entry{'' if offset is None else f' at {list(offset)}'}")
        name = os.path.join(path, info.relative_path)
        if os.path.dirname(os.path.normpath(info.relative_path)):
            raise ConvertError(f"{path}: '{fqn}' names the file {info.relative_path!r} outside the directory")
        with open(name, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        if len(data) != info.length:
            raise ConvertError(f"{name}: truncated ({len(data)} of {info.length} bytes at offset {info.offset} for "
                               f"'{fqn}')")
        return data, f"{name} ('{fqn}')"

    try:
        flat = _read_dcp_items(path, meta, item_bytes)
        paths = meta.planner_data if isinstance(getattr(meta, "planner_data", None), dict) else {}
        return _unflatten(flat, paths)
    except (AttributeError, TypeError, KeyError, IndexError, ValueError) as e:
        raise ConvertError(f"{metadata_file}: malformed DCP metadata ({type(e).__name__}: {one_line(str(e))})") from None


def _read_dcp_items(path: str, meta: Any, item_bytes: Callable[[str, Any], Tuple[bytes, str]]) -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    for fqn, entry in meta.state_dict_metadata.items():
        kind = type(entry).__name__
        if kind == "BytesStorageMetadata":
            data, what = item_bytes(fqn, None)
            flat[fqn] = _torch_load(io.BytesIO(data), what)
        elif kind == "TensorStorageMetadata":
            tensor = torch.zeros(tuple(entry.size), dtype=_dcp_dtype(entry.properties, f"{path}: '{fqn}'"))
            covered = 0
            for chunk in entry.chunks:
                data, what = item_bytes(fqn, tuple(chunk.offsets))
                piece = _torch_load(io.BytesIO(data), what)
                box = tensor
                for dim, (start, length) in enumerate(zip(chunk.offsets, chunk.sizes)):
                    if start < 0 or length < 0 or start + length > tensor.shape[dim]:
                        raise ConvertError(f"{what}: chunk at {list(chunk.offsets)} of {list(chunk.sizes)} is outside "
                                           f"the tensor's {list(tensor.shape)}")
                    box = box.narrow(dim, start, length)
                if not isinstance(piece, torch.Tensor) or piece.numel() != box.numel() or piece.dtype != tensor.dtype:
                    raise ConvertError(f"{what}: the chunk is not a {tensor.dtype} tensor of {list(chunk.sizes)}")
                box.copy_(piece.reshape(box.shape))
                covered += box.numel()
            if covered != tensor.numel():
                raise ConvertError(f"{path}: '{fqn}': its chunks hold {covered} of {tensor.numel()} elements")
            flat[fqn] = tensor
        else:
            raise ConvertError(f"{path}: '{fqn}' is a {kind}, which this reader does not know")
    return flat


def _unflatten(flat: Dict[str, Any], paths: Dict[str, Any]) -> Dict[str, Any]:
    """torch >= 2.0's DCP keeps nested dicts flat ("model.layer.weight") with each key's path in
    planner_data; ints in a path index lists (torch's own convention)."""
    root: Dict[str, Any] = {}
    for fqn, value in flat.items():
        path = paths.get(fqn)
        path = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
        node: Any = root
        for key, next_key in zip(path, path[1:]):
            empty: Any = [] if isinstance(next_key, int) else {}
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                node[key] = empty if node[key] is None else node[key]
                node = node[key]
            else:
                node = node.setdefault(key, empty)
        last = path[-1]
        if isinstance(node, list):
            node.extend([None] * (last + 1 - len(node)))
        node[last] = value
    return root


# ---- several ranks' files -> one state ----------------------------------------------------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
    return torch.equal(as_bytes[0], as_bytes[1])


def merge_ranks(states: Sequence[Any], names: Sequence[str]) -> Tuple[Any, List[list]]:
    """One state from each rank's: entries equal on every rank are kept once; tensors that differ
    are stacked (row r = rank r), other values that differ become a list by rank. Returns the
    state and the key paths of the per-rank entries."""
    per_rank: List[list] = []

    def merge(nodes: Sequence[Any], path: list) -> Any:
        first = nodes[0]
        where = "/".join(map(str, path)) or "the top level"
        if isinstance(first, torch.Tensor):
            if not all(isinstance(n, torch.Tensor) for n in nodes):
                raise ConvertError(f"'{where}': a tensor in {names[0]} but not in every file")
            if all(_same_bits(first, n) for n in nodes[1:]):
                return first
            if any(n.dtype != first.dtype or n.shape != first.shape for n in nodes):
                raise ConvertError(f"'{where}': dtype or shape differs between the files ("
                                   + ", ".join(f"{nm}: {n.dtype} {list(n.shape)}" for nm, n in zip(names, nodes))
                                   + "); per-rank tensors must have one shape")
            per_rank.append(list(path))
            return torch.stack([n.detach() for n in nodes])
        if isinstance(first, dict):
            for name, node in zip(names, nodes):
                if not isinstance(node, dict) or list(node.keys()) != list(first.keys()):
                    raise ConvertError(f"'{where}': {name} has other keys than {names[0]} "
                                       f"({sorted(map(str, node.keys())) if isinstance(node, dict) else type(node)})")
            merged = {key: merge([n[key] for n in nodes], path + [key]) for key in first}
            return OrderedDict(merged) if isinstance(first, OrderedDict) else merged
        if isinstance(first, (list, tuple)):
            for name, node in zip(names, nodes):
                if type(node) is not type(first) or len(node) != len(first):
                    raise ConvertError(f"'{where}': {name} holds another {type(first).__name__} than {names[0]}")
            items = [merge([n[i] for n in nodes], path + [i]) for i in range(len(first))]
            return tuple(items) if isinstance(first, tuple) else items
        if all(type(n) is type(first) and _plain_equal(n, first) for n in nodes[1:]):
            return first
        per_rank.append(list(path))
        return list(nodes)

    if len(states) == 1:
        return states[0], []
    return merge(states, []), per_rank


def _plain_equal(a: Any, b: Any) -> bool:
    try:
        import numpy

        if isinstance(a, numpy.ndarray):
            return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    except ImportError:
        pass
    if isinstance(a, float):  # bit for bit: nan equals nan, -0.0 differs from 0.0
        return isinstance(b, float) and struct.pack("<d", a) == struct.pack("<d", b)
    return bool(a == b)


def _split_rank(state: Any, per_rank: List[list], rank: int) -> Any:
    """Rank `rank`'s state from a merged one (the inverse of merge_ranks)."""
    wanted = {tuple(p) for p in per_rank}

    def split(node: Any, path: tuple) -> Any:
        if path in wanted:
            return node[rank].clone() if isinstance(node, torch.Tensor) else node[rank]
        if isinstance(node, dict):
            items = {key: split(value, path + (key,)) for key, value in node.items()}
            return OrderedDict(items) if isinstance(node, OrderedDict) else items
        if isinstance(node, (list, tuple)):
            items = [split(value, path + (i,)) for i, value in enumerate(node)]
            return tuple(items) if isinstance(node, tuple) else items
        return node

    return split(state, ())


# ---- import ---------------------------------------------------------------------------------------


def _plain_scalars(node: Any) -> Any:
    """numpy scalars (a best accuracy kept as numpy.float64) as the Python values they hold."""
    if isinstance(node, dict):
        items = {key: _plain_scalars(value) for key, value in node.items()}
        return OrderedDict(items) if isinstance(node, OrderedDict) else items
    if isinstance(node, (list, tuple)):
        items = [_plain_scalars(value) for value in node]
        return tuple(items) if isinstance(node, tuple) else items
    if type(node).__module__ == "numpy" and hasattr(node, "item") and getattr(node, "shape", None) == ():
        return node.item()
    return node


def _plain_json(value: Any) -> bool:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return True
    return isinstance(value, float) and math.isfinite(value)


def _chosen_step(state: Dict[str, Any], step: Optional[int]) -> Tuple[int, str]:
    if step is not None:
        return step, "given"
    for key in STEP_KEYS:
        value = state.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value, f"its '{key}' entry"
    return 0, f"no {'/'.join(STEP_KEYS)} entry; --step sets it"


def import_checkpoint(sources: Sequence[str], ckpt_dir: str, step: Optional[int] = None,
                      log: Callable[[str], None] = print) -> _checkpoint.SaveInfo:
    """Writes the state of `sources` (torch.save files, one per rank, or one DCP directory) as one
    committed step under `ckpt_dir`, which must hold no checkpoint yet."""
    if not sources:
        raise ConvertError("nothing to import: give torch.save files or a DCP directory")
    directories = [s for s in sources if os.path.isdir(s)]
    if directories and len(sources) > 1:
        raise ConvertError(f"{directories[0]}: a DCP directory is imported alone (it holds every rank's chunks)")
    if os.path.isdir(ckpt_dir) and _checkpoint.list_steps(ckpt_dir):
        steps = [s for s, _ in _checkpoint.list_steps(ckpt_dir)]
        raise ConvertError(f"--to {ckpt_dir}: already holds checkpoint steps {steps[:5]}{'...' if len(steps) > 5 else ''}"
                           "; import into a new directory (an import never mixes with or hides a run's steps)")
    form = "dcp" if directories else "torch"
    states = []
    for source in sources:
        states.append(read_dcp(source) if form == "dcp" else read_torch(source))
        log(f"read {source} ({form})")
    state, per_rank = merge_ranks([_plain_scalars(s) for s in states], list(sources))
    if not isinstance(state, dict):
        raise ConvertError(f"{sources[0]}: holds a {type(state).__name__}, not a dict (a state_dict or a dict of "
                           "them); wrap it: torch.save({{'model': obj}}, ...)")
    chosen, why = _chosen_step(state, step)
    metadata = {str(k): v for k, v in state.items() if isinstance(k, str) and _plain_json(v)
                and k not in (IMPORT_KEY, _tree.SPEC_KEY)}
    metadata[IMPORT_KEY] = {"format": form, "sources": [os.path.abspath(s) for s in sources],
                            "world_size": len(states), "per_rank": per_rank}
    try:
        json.dumps(per_rank)
    except TypeError:
        raise ConvertError(f"per-rank entries under keys that are neither str nor int: {per_rank}") from None
    info = _checkpoint.save(state, ckpt_dir, chosen, metadata=metadata, check_replicas="off")
    tensors = len(_tree.flatten(state).tensors)
    log(f"wrote {info.path}: step {chosen} ({why}), {tensors} tensors, {info.bytes_written} bytes"
        + (f"; per rank (stacked by rank): {', '.join('/'.join(map(str, p)) for p in per_rank)}" if per_rank else ""))
    return info


# ---- export ---------------------------------------------------------------------------------------


def _torch_dcp() -> Any:
    """torch's DCP API: torch.distributed.checkpoint (torch >= 2.0), else torch 1.13's
    torch.distributed._shard.checkpoint -- which Python 3.11 refuses to import (its
    ShardedTensorMetadata has an unhashable dataclass default, TensorProperties(): torch fixed it
    in 2.0 by making TensorProperties hashable, which this does for the import's duration)."""
    try:
        import torch.distributed.checkpoint as dcp  # type: ignore[import-not-found]

        return dcp
    except ImportError:
        pass
    import dataclasses

    original = dataclasses.dataclass

    def hashable_tensor_properties(cls: Any = None, /, **kwargs: Any) -> Any:
        def wrap(c: Any) -> Any:
            if c.__name__ == "TensorProperties" and c.__module__.startswith("torch.distributed._shard"):
                kwargs["unsafe_hash"] = True
            return original(c, **kwargs)

        return wrap if cls is None else wrap(cls)

    dataclasses.dataclass = hashable_tensor_properties
    try:
        import torch.distributed._shard.checkpoint as dcp_113
    finally:
        dataclasses.dataclass = original
    return dcp_113


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def export_checkpoint(step_path: str, output: str, form: str, log: Callable[[str], None] = print) -> List[str]:
    """Writes one step (a step directory, or a checkpoint directory's newest) as torch.save file(s)
    or a DCP directory; returns what it wrote."""
    try:
        state, info = _checkpoint.read(step_path)
    except FileNotFoundError as e:
        raise ConvertError(str(e)) from None
    imported = info.metadata.get(IMPORT_KEY) if isinstance(info.metadata.get(IMPORT_KEY), dict) else {}
    per_rank = imported.get("per_rank", [])
    written: List[str] = []
    if form == "torch":
        if "{rank}" in output:
            world = int(imported.get("world_size", 1))
            try:
                for rank in range(world):
                    name = output.replace("{rank}", str(rank))
                    _write_atomically(name, lambda tmp, r=rank: torch.save(_split_rank(state, per_rank, r), tmp))
                    written.append(name)
            except BaseException:
                for name in written:  # all ranks' files or none
                    os.unlink(name)
                raise
        else:
            if per_rank:
                raise ConvertError(f"step {info.step} holds per-rank entries ({len(per_rank)}, from "
                                   f"{imported.get('world_size')} files): put {{rank}} in --to for one file per rank")
            _write_atomically(output, lambda tmp: torch.save(state, tmp))
            written.append(output)
    elif form == "dcp":
        if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
            raise ConvertError(f"--to {output}: exists and is not an empty directory; give a new one")
        dcp = _torch_dcp()
        staging = f"{output.rstrip('/')}.tmp-{os.getpid()}"  # renamed into place once complete
        os.makedirs(staging)
        try:
            writer = dcp.FileSystemWriter(staging)
            if hasattr(dcp, "save_state_dict"):
                dcp.save_state_dict(state, storage_writer=writer, no_dist=True)
            else:
                dcp.save(state, storage_writer=writer)
            if os.path.isdir(output):
                os.rmdir(output)  # empty (checked above)
            os.rename(staging, output)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if type(e).__name__ == "CheckpointException":  # DCP's error is a BaseException
                raise ConvertError(f"torch's DCP writer failed: {one_line(str(e))}") from None
            raise
        written.append(output)
    else:
        raise ConvertError(f"--format {form}: use torch or dcp (safetensors is elastrun-ckpt's own)")
    log(f"wrote {', '.join(written)} (step {info.step} of {info.path}, {form})")
    return written


# ---- command line (elastrun-ckpt import / export --format torch|dcp) -------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="elastrun-ckpt", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    imp = verbs.add_parser("import", help="torch.save files (one per rank) or a DCP directory -> a checkpoint step")
    imp.add_argument("sources", nargs="+", metavar="SOURCE")
    imp.add_argument("--to", required=True, metavar="DIR", help="checkpoint directory (new, or without steps)")
    imp.add_argument("--step", type=int, default=None, help=f"step number (default: a top-level {'/'.join(STEP_KEYS)} "
                                                               "entry, else 0)")
    exp = verbs.add_parser("export", help="a checkpoint step -> torch.save file(s) or a DCP directory")
    exp.add_argument("step", metavar="STEP", help="step directory, or a checkpoint directory for its newest step")
    exp.add_argument("--to", required=True, metavar="OUT")
    exp.add_argument("--format", required=True, choices=["torch", "dcp"])
    args = parser.parse_args(argv)
    # One process writes the whole state: not a rank of whatever job this runs in.
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(name, None)
    try:
        if args.verb == "import":
            if args.step is not None and args.step < 0:
                raise ConvertError(f"--step {args.step}: must not be negative")
            import_checkpoint(args.sources, args.to, args.step)
        else:
            export_checkpoint(args.step, args.to, args.format)
    except (ConvertError, _checkpoint.CheckpointError, _checkpoint.TreeError, OSError, RuntimeError) as e:
        print(f"elastrun-ckpt: {one_line(str(e))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
