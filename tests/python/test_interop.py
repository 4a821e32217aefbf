"""One format, two languages: a checkpoint written by C++ (elastrun::ckpt) loads in Python and the
reverse, bit-exactly (interop_fixture.cpp is the C++ side)."""

import json
import os
import subprocess

import numpy as np
import torch

import elastrun.checkpoint as ec

FIXTURE = os.environ.get("ELASTRUN_INTEROP_FIXTURE", "")


def fixture(*args):
    assert os.path.exists(FIXTURE), f"ELASTRUN_INTEROP_FIXTURE={FIXTURE!r}: build the interop_fixture target"
    return subprocess.run([FIXTURE, *map(str, args)], check=True, capture_output=True, text=True, timeout=60).stdout


def raw_bytes(tensor):
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    if tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    return tensor.contiguous().numpy().tobytes()


def test_a_cpp_checkpoint_loads_in_python(tmp_path):
    fixture("write", tmp_path)
    state = {}  # everything created; C++ names nest by '/'
    info = ec.load(state, tmp_path)
    assert info.step == 11 and info.metadata == {"epoch": 4, "writer": "c++"}
    assert torch.equal(state["model"]["w"], torch.arange(15, dtype=torch.float32).reshape(5, 3) * 0.25)
    assert torch.equal(state["model"]["steps"], torch.tensor([1, -2, 3, -4]))
    assert torch.equal(state["flags"], torch.tensor([True, False, True]))
    assert torch.equal(state["half"], torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    assert torch.equal(state["table"], torch.arange(8, dtype=torch.float64).reshape(4, 2))
    # in place, with a Shard of the sharded table at another split
    mine = {"model": {"w": torch.zeros(5, 3), "steps": torch.zeros(4, dtype=torch.int64)},
            "table": ec.Shard(torch.zeros(3, 2, dtype=torch.float64), (4, 2), (1, 0))}
    ec.load(mine, tmp_path)
    assert torch.equal(mine["table"].local_tensor, torch.arange(2, 8, dtype=torch.float64).reshape(3, 2))


def test_a_python_checkpoint_loads_in_cpp(tmp_path):
    state = {"model": {"layer.weight": torch.randn(4, 3), "layer.bias": torch.randn(3).to(torch.bfloat16)},
             "optim": {"state": {0: {"step": torch.tensor(5.0), "mask": torch.tensor([True, False])}},
                       "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]},
             "counts": np.arange(6, dtype=np.int16).reshape(2, 3)}
    ec.save(state, tmp_path, 21, metadata={"epoch": 1})
    out = json.loads(fixture("read", tmp_path))
    assert out["step"] == 21 and out["metadata"]["epoch"] == 1
    tensors = out["tensors"]
    expected = {"model/layer.weight": state["model"]["layer.weight"], "model/layer.bias": state["model"]["layer.bias"],
                "optim/state/0/step": state["optim"]["state"][0]["step"],
                "optim/state/0/mask": state["optim"]["state"][0]["mask"],
                "counts": torch.from_numpy(state["counts"])}
    assert sorted(tensors) == sorted(expected)
    for name, tensor in expected.items():
        assert tensors[name]["shape"] == list(tensor.shape), name
        assert bytes.fromhex(tensors[name]["hex"]) == raw_bytes(tensor), name
    assert tensors["model/layer.bias"]["dtype"] == "bfloat16" and tensors["optim/state/0/mask"]["dtype"] == "bool"
