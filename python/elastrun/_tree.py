"""State-dict trees <-> (tensor leaves, JSON structure): the pure logic of elastrun.checkpoint.

A state_dict is a tree of dicts (str/int/... keys), lists and tuples whose leaves are tensors
(torch tensors, numpy arrays, Shard slices) or plain values (int, float, str, bool, None, bytes).
`flatten` gives every tensor leaf a dataset name from its path ("model/layer1.weight",
"optim/state/0/exp_avg") and describes everything else in a JSON-able `spec`, so that `build`
can recreate the tree -- int dict keys, tuples and None included -- from a checkpoint.

No torch import at module level: numpy and torch are imported by the caller's objects' types.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

# The key under which save() stores the spec in the checkpoint's metadata.
SPEC_KEY = "_elastrun_state"
SPEC_VERSION = 1


class TreeError(TypeError):
    """A state_dict holds something a checkpoint cannot represent (the message names the key)."""


@dataclass
class Shard:
    """This rank's slice of a sharded tensor (FSDP-style or tensor-parallel state).

    ``local_tensor`` holds the box of the global tensor that starts at ``offsets`` (one offset per
    dimension) and has ``local_tensor``'s shape; ``global_shape`` is the whole tensor's shape. On
    save every rank passes its slice (slices must tile the tensor without overlap); on load the
    same wrapper says which box to read into ``local_tensor`` -- from any sharding and world size
    the checkpoint was written with.
    """

    local_tensor: Any
    global_shape: Sequence[int]
    offsets: Sequence[int]

    def __post_init__(self) -> None:
        self.global_shape = tuple(int(x) for x in self.global_shape)
        self.offsets = tuple(int(x) for x in self.offsets)
        shape = tuple(self.local_tensor.shape)
        if len(self.offsets) != len(self.global_shape) or len(shape) != len(self.global_shape):
            raise ValueError(f"Shard: local tensor of shape {list(shape)}, offsets {list(self.offsets)} and "
                             f"global shape {list(self.global_shape)} must have the same number of dimensions")
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape)):
            if o < 0 or o + n > g:
                raise ValueError(f"Shard: dimension {d}: offset {o} + extent {n} exceeds the global extent {g}")


def component(key: Any, top: bool) -> str:
    """The dataset-name component of a dict key or list index (unique per level, valid in HDF5)."""
    if isinstance(key, bool) or key is None:
        text = repr(key)
    elif isinstance(key, (int, str)):
        text = str(key)
    else:
        text = repr(key)
    text = text.replace("%", "%25").replace("/", "%2F")
    if text == "":
        return "%"
    if text in (".", ".."):
        return text.replace(".", "%2E")
    if top and text == "_elastrun":
        return "%5Felastrun"
    return text


def encode_key(key: Any, path: str) -> list:
    if isinstance(key, bool):
        return ["b", key]
    if isinstance(key, int):
        return ["i", str(key)]
    if isinstance(key, str):
        return ["s", key]
    if key is None:
        return ["n", None]
    if isinstance(key, float):
        return ["f", _encode_float(key)]
    raise TreeError(f"'{path}': dict key {key!r} of type {type(key).__name__} cannot be saved "
                    "(use str, int, float, bool or None keys)")


def decode_key(encoded: list) -> Any:
    kind, value = encoded
    return {"b": bool, "i": int, "s": str, "n": lambda v: None, "f": _decode_float}[kind](value)


def _encode_float(value: float) -> Any:
    return value if math.isfinite(value) else repr(value)  # 'nan', 'inf', '-inf': not JSON


def _decode_float(value: Any) -> float:
    return float(value)


@dataclass
class TensorLeaf:
    """A tensor leaf found by flatten: its dataset name and the object."""

    name: str
    path: str  # for messages: "optim/state/0/exp_avg"
    value: Any  # torch.Tensor, numpy.ndarray or Shard


@dataclass
class Flat:
    spec: dict
    tensors: List[TensorLeaf] = field(default_factory=list)


def _kind(value: Any) -> Optional[str]:
    if isinstance(value, Shard):
        return "shard"
    module = type(value).__module__
    if module.startswith("torch") and hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return "torch"
    if module == "numpy" and type(value).__name__ == "ndarray":
        return "numpy"
    return None


def flatten(tree: Any) -> Flat:
    """Splits a state_dict into tensor leaves and a JSON-able spec of everything else."""
    flat = Flat(spec={})
    names: Dict[str, str] = {}

    def walk(node: Any, parts: List[str], path: str) -> dict:
        kind = _kind(node)
        if kind is not None:
            name = "/".join(parts) if parts else "%"
            if name in names:
                raise TreeError(f"'{path}' and '{names[name]}' map to the same dataset name '{name}'; "
                                "rename one of the keys")
            names[name] = path
            flat.tensors.append(TensorLeaf(name, path, node))
            if kind == "numpy":  # numpy dtypes torch lacks (uint32 RNG state) are saved as bytes
                if node.dtype.hasobject:
                    raise TreeError(f"'{path}': a numpy array of Python objects cannot be saved")
                return {"t": kind, "name": name, "dtype": node.dtype.newbyteorder("=").str, "shape": list(node.shape)}
            return {"t": kind, "name": name}
        if isinstance(node, dict):
            items = []
            for key, child in node.items():
                child_path = f"{path}/{key}" if path else str(key)
                encoded = encode_key(key, child_path)
                items.append([encoded, walk(child, parts + [component(key, not parts)], child_path)])
            spec = {"t": "dict", "items": items}
            if isinstance(node, OrderedDict):
                spec["ordered"] = True
            return spec
        if isinstance(node, (list, tuple)):
            children = [walk(child, parts + [str(i)], f"{path}/{i}" if path else str(i)) for i, child in enumerate(node)]
            return {"t": "tuple" if isinstance(node, tuple) else "list", "items": children}
        return leaf_spec(node, path)

    flat.spec = walk(tree, [], "")
    return flat


def leaf_spec(value: Any, path: str) -> dict:
    if value is None:
        return {"t": "none"}
    if isinstance(value, bool):
        return {"t": "bool", "v": value}
    module = type(value).__module__
    if module == "numpy" and hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalar (float64 is a float)
        return {"t": "npscalar", "dtype": str(value.dtype), "v": leaf_spec(value.item(), path)}
    if isinstance(value, int):
        # JSON readers (nlohmann) turn integers beyond 64 bits into floats: keep the digits.
        return {"t": "int", "v": str(value)}
    if isinstance(value, float):
        return {"t": "float", "v": _encode_float(value)}
    if isinstance(value, str):
        return {"t": "str", "v": value}
    if isinstance(value, (bytes, bytearray)):
        return {"t": "bytes", "v": base64.b64encode(bytes(value)).decode("ascii")}
    if module == "torch" and type(value).__name__ == "dtype":
        return {"t": "torch.dtype", "v": str(value)}
    raise TreeError(f"'{path or '<root>'}': a {type(value).__module__}.{type(value).__name__} cannot be saved "
                    "in a checkpoint (tensors, numpy arrays, dicts, lists, tuples, str, int, float, bool, "
                    "None and bytes can): convert it or keep it out of the state_dict")


def leaf_value(spec: dict) -> Any:
    kind = spec["t"]
    if kind == "none":
        return None
    if kind == "bool":
        return bool(spec["v"])
    if kind == "int":
        return int(spec["v"])
    if kind == "float":
        return _decode_float(spec["v"])
    if kind == "str":
        return spec["v"]
    if kind == "bytes":
        return base64.b64decode(spec["v"])
    if kind == "npscalar":
        import numpy
        return numpy.dtype(spec["dtype"]).type(leaf_value(spec["v"]))
    if kind == "torch.dtype":
        import torch
        return getattr(torch, spec["v"].split(".", 1)[1])
    raise TreeError(f"unknown leaf kind '{kind}' in the checkpoint's structure (written by a newer elastrun?)")


def tensor_paths(spec: dict) -> Dict[str, str]:
    """Dataset names of every tensor leaf of a spec -> its kind."""
    found: Dict[str, str] = {}

    def walk(node: dict) -> None:
        kind = node["t"]
        if kind in ("torch", "numpy", "shard"):
            found[node["name"]] = kind
        elif kind == "dict":
            for _, child in node["items"]:
                walk(child)
        elif kind in ("list", "tuple"):
            for child in node["items"]:
                walk(child)

    walk(spec)
    return found


def spec_from_names(names: Sequence[str]) -> dict:
    """The spec of a checkpoint written without one (by C++): nested dicts of str keys by '/'."""
    root: dict = {"t": "dict", "items": []}
    for name in names:
        node = root
        parts = name.split("/")
        for part in parts[:-1]:
            for key, child in node["items"]:
                if key == ["s", part] and child["t"] == "dict":
                    node = child
                    break
            else:
                child = {"t": "dict", "items": []}
                node["items"].append([["s", part], child])
                node = child
        node["items"].append([["s", parts[-1]], {"t": "torch", "name": name}])
    return root


def build(spec: dict, current: Any, make_tensor: Callable[[dict, Any], Any], path: str = "") -> Any:
    """The tree `spec` describes, reusing `current` (the caller's tree at the same place).

    make_tensor(leaf_spec, existing) returns the object for a tensor leaf, given what the caller
    has at that place (None if nothing); plain leaves come from the spec.
    """
    kind = spec["t"]
    if kind in ("torch", "numpy", "shard"):
        return make_tensor(spec, current if _kind(current) is not None else None)
    if kind == "dict":
        mine = current if isinstance(current, dict) else {}
        built = OrderedDict() if spec.get("ordered") else {}
        for encoded, child in spec["items"]:
            key = _caller_key(mine, decode_key(encoded), top=not path)
            child_path = f"{path}/{key}" if path else str(key)
            built[key] = build(child, mine.get(key), make_tensor, child_path)
        return built
    if kind in ("list", "tuple"):
        mine = current if isinstance(current, (list, tuple)) else ()
        items = [build(child, mine[i] if i < len(mine) else None, make_tensor, f"{path}/{i}" if path else str(i))
                 for i, child in enumerate(spec["items"])]
        return tuple(items) if kind == "tuple" else items
    return leaf_value(spec)


def _caller_key(mine: dict, key: Any, top: bool) -> Any:
    """`key`, or the caller's key with the same dataset name when the checkpoint does not know its
    type (written by C++: every key a str, while an optimizer's state has int keys)."""
    if key in mine:
        return key
    name = component(key, top)
    for candidate in mine:
        if component(candidate, top) == name:
            return candidate
    return key


def merge_into(target: Any, built: Any) -> Any:
    """Puts `built` into `target` in place where both are dicts or equally long lists (so the
    caller's objects, e.g. an optimizer's param_groups, stay the same objects); returns what the
    parent should hold."""
    if isinstance(target, dict) and isinstance(built, dict):
        for key, value in built.items():
            target[key] = merge_into(target[key], value) if key in target else value
        return target
    if isinstance(target, list) and isinstance(built, list) and len(target) == len(built):
        for i, value in enumerate(built):
            target[i] = merge_into(target[i], value)
        return target
    return built


def collect_tensor_paths(tree: Any) -> List[Tuple[str, str]]:
    """(dataset name, path) of every tensor leaf in a caller's tree (flatten's naming)."""
    return [(leaf.name, leaf.path) for leaf in flatten_tensors_only(tree)]


def flatten_tensors_only(tree: Any) -> List[TensorLeaf]:
    found: List[TensorLeaf] = []

    def walk(node: Any, parts: List[str], path: str) -> None:
        if _kind(node) is not None:
            found.append(TensorLeaf("/".join(parts) if parts else "%", path, node))
        elif isinstance(node, dict):
            for key, child in node.items():
                walk(child, parts + [component(key, not parts)], f"{path}/{key}" if path else str(key))
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                walk(child, parts + [str(i)], f"{path}/{i}" if path else str(i))

    walk(tree, [], "")
    return found
