"""elastrun-ckpt import / export --format torch|dcp (elastrun.convert): checkpoints users already
have, written by torch 1.13's own torch.save and torch.distributed.checkpoint, turned into elastrun
steps and back, bit for bit; pickles that would run code are refused."""

import math
import os
import subprocess
from collections import OrderedDict

import pytest
import torch

import elastrun.checkpoint as ec
from elastrun import convert
from conftest import run_world
from trees import same

TOOL = os.environ.get("ELASTRUN_CKPT_TOOL", "elastrun-ckpt")


def tool(*args, expect_rc=0):
    """Runs the C++ elastrun-ckpt (which hands these verbs to python -m elastrun.convert)."""
    env = dict(os.environ, ELASTRUN_PYTHON="/usr/bin/python3")
    proc = subprocess.run([TOOL, *map(str, args)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect_rc, f"{args}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def one_error_line(proc, *words):
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("elastrun-ckpt: "), proc.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


def imagenet_checkpoint(seed=1):
    """What pytorch/elastic's ImageNet example saves: epoch, arch, state_dict, best_acc1, optimizer."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(4, 6)).pow(2).sum().backward()
        optim.step()
    return {"epoch": 7, "arch": "resnet18", "state_dict": model.state_dict(), "best_acc1": torch.tensor(71.25),
            "optimizer": optim.state_dict()}


def odd_tensors():
    """Every dtype, NaN payloads, -0.0, a 0-d tensor and an empty one."""
    floats = torch.tensor([0.0, -0.0, math.inf, -math.inf, 1e-40, 3.5])
    nan_bits = torch.tensor([0x7FC00001, 0xFFC12345], dtype=torch.int64).to(torch.int32).view(torch.float32)
    return {"f32": torch.cat([floats, nan_bits]), "f64": torch.randn(3, 2, dtype=torch.float64),
            "f16": floats.half(), "bf16": floats.bfloat16(), "i8": torch.tensor([-128, 127], dtype=torch.int8),
            "u8": torch.arange(5, dtype=torch.uint8), "i16": torch.tensor([-3], dtype=torch.int16),
            "i32": torch.tensor([[1, 2]], dtype=torch.int32), "i64": torch.tensor(2**62), "b": torch.tensor([True, False]),
            "empty": torch.zeros(0, 4)}


def test_an_imagenet_checkpoint_imports_resumes_at_world_2_and_exports_bit_exactly(tmp_path):
    original = imagenet_checkpoint()
    torch.save(original, tmp_path / "checkpoint.pth.tar")
    out = tool("import", tmp_path / "checkpoint.pth.tar", "--to", tmp_path / "ckpt").stdout
    assert "step 0" in out, out  # no step/global_step/iteration entry: 0, said so
    state, info = ec.read(tmp_path / "ckpt")
    assert info.metadata["epoch"] == 7 and info.metadata["arch"] == "resnet18", info.metadata
    assert info.metadata["elastrun_import"]["format"] == "torch"
    same(state, original)
    run_world(2, "load_imported", tmp_path / "ckpt", tmp_path / "checkpoint.pth.tar")
    # .pth.tar: torch's format without --format
    tool("export", tmp_path / "ckpt", "--to", tmp_path / "back.pth.tar")
    same(torch.load(tmp_path / "back.pth.tar"), original)


def test_every_dtype_and_the_step_entry_survive_the_round_trip(tmp_path):
    original = {"step": 1200, "lr": 0.5, "name": "x", "flags": (True, None), "tensors": odd_tensors(),
                "groups": [{"params": [0, 1], "betas": (0.9, 0.99)}], 3: "int key"}
    torch.save(original, tmp_path / "in.pt")
    tool("import", tmp_path / "in.pt", "--to", tmp_path / "ckpt")
    [(step, step_dir)] = ec.list_steps(tmp_path / "ckpt")
    assert step == 1200
    tool("export", step_dir, "--format", "torch", "--to", tmp_path / "out.bin")
    same(torch.load(tmp_path / "out.bin"), original)
    tool("import", tmp_path / "in.pt", "--to", tmp_path / "ckpt2", "--step", 5)
    assert [s for s, _ in ec.list_steps(tmp_path / "ckpt2")] == [5]


def test_one_file_per_rank_keeps_replicas_once_and_stacks_what_differs(tmp_path):
    model = imagenet_checkpoint()["state_dict"]
    ranks = []
    for rank in range(3):
        ranks.append({"model": model, "rng": torch.arange(4, dtype=torch.int64) + rank, "rank": rank, "epoch": 2})
        torch.save(ranks[-1], tmp_path / f"rank{rank}.pt")
    files = [tmp_path / f"rank{r}.pt" for r in range(3)]
    out = tool("import", *files, "--to", tmp_path / "ckpt").stdout
    assert "rng" in out and "rank" in out, out
    state, info = ec.read(tmp_path / "ckpt")
    assert info.metadata["elastrun_import"]["world_size"] == 3
    assert sorted(info.metadata["elastrun_import"]["per_rank"]) == [["rank"], ["rng"]]
    assert list(state["rng"].shape) == [3, 4] and state["rank"] == [0, 1, 2] and state["epoch"] == 2
    same(state["model"], model)
    tool("export", tmp_path / "ckpt", "--format", "torch", "--to", tmp_path / "out-{rank}.pt")
    for rank in range(3):
        same(torch.load(tmp_path / f"out-{rank}.pt"), ranks[rank], f"rank {rank}")
    # one file cannot hold three ranks' different values
    one_error_line(tool("export", tmp_path / "ckpt", "--to", tmp_path / "one.pt", expect_rc=1), "{rank}")
    assert not (tmp_path / "one.pt").exists()


def test_a_dcp_directory_of_torch_1_13_round_trips(tmp_path):
    dcp = convert._torch_dcp()
    original = dict(odd_tensors(), epoch=4, nested={"w": torch.randn(2, 3), "n": [1, 2.5]})
    original.pop("empty")  # torch 1.13's DCP writer cannot plan a zero-element chunk
    dcp.save_state_dict(original, dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    tool("import", tmp_path / "dcp", "--to", tmp_path / "ckpt", "--step", 40)
    state, info = ec.read(tmp_path / "ckpt")
    assert info.step == 40 and info.metadata["elastrun_import"]["format"] == "dcp"
    same(state, original)
    tool("export", tmp_path / "ckpt", "--format", "dcp", "--to", tmp_path / "dcp-out")
    loaded = {key: torch.empty_like(value) if isinstance(value, torch.Tensor) else None
              for key, value in original.items()}
    dcp.load_state_dict(loaded, dcp.FileSystemReader(str(tmp_path / "dcp-out")), no_dist=True)
    same(loaded, original)
    one_error_line(tool("export", tmp_path / "ckpt", "--format", "dcp", "--to", tmp_path / "dcp-out", expect_rc=1),
                   "not an empty directory")


def write_torch2_dcp(directory, state_items, planner_data):
    """A DCP directory as torch >= 2.4 writes it, recreated (torch 2 is not installed here): its
    classes in torch.distributed.checkpoint.*, TensorProperties pickled as a tuple with an enum,
    StorageMeta holding a PosixPath, flattened keys with their paths in planner_data. state_items:
    fqn -> a tensor (split into two chunks along dim 0 when it has 2+ rows) or any other value."""
    import dataclasses
    import enum
    import io
    import pathlib
    import pickle
    import sys
    import types

    names = {"metadata": "torch.distributed.checkpoint.metadata",
             "filesystem": "torch.distributed.checkpoint.filesystem"}
    modules = {key: types.ModuleType(name) for key, name in names.items()}

    def place(cls, where):
        cls.__module__ = names[where]
        cls.__qualname__ = cls.__name__
        setattr(modules[where], cls.__name__, cls)
        return cls

    class _MEM_FORMAT_ENCODING(enum.Enum):
        TORCH_CONTIGUOUS_FORMAT = 0
    place(_MEM_FORMAT_ENCODING, "metadata")

    class TensorProperties:
        def __init__(self, dtype):
            self.dtype = dtype

        def __getstate__(self):
            return (self.dtype, torch.strided, False, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False)
    place(TensorProperties, "metadata")
    records = {}
    for name, fields in {"ChunkStorageMetadata": "offsets sizes", "TensorStorageMetadata": "properties size chunks",
                         "BytesStorageMetadata": "", "MetadataIndex": "fqn offset index",
                         "StorageMeta": "checkpoint_id save_id", "Metadata":
                         "state_dict_metadata planner_data storage_data storage_meta"}.items():
        records[name] = place(dataclasses.make_dataclass(name, fields.split(), frozen=name == "MetadataIndex"),
                              "metadata")
    records["_StorageInfo"] = place(dataclasses.make_dataclass("_StorageInfo", ["relative_path", "offset", "length"]),
                                    "filesystem")
    R = types.SimpleNamespace(**records)
    data, state_md, storage = io.BytesIO(), {}, {}

    def item(fqn, offset, index, value):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        storage[R.MetadataIndex(fqn, offset, index)] = R._StorageInfo("__0_0.distcp", data.tell(), len(buffer.getvalue()))
        data.write(buffer.getvalue())

    for fqn, value in state_items.items():
        if isinstance(value, torch.Tensor):
            rows = [0, value.shape[0] // 2, value.shape[0]] if value.dim() and value.shape[0] > 1 else [0, None]
            chunks = []
            for i, (start, end) in enumerate(zip(rows, rows[1:])):
                piece = value[start:end].clone() if end is not None else value.clone()
                offsets = torch.Size([start] + [0] * (value.dim() - 1)) if value.dim() else torch.Size([])
                chunks.append(R.ChunkStorageMetadata(offsets, piece.shape))
                item(fqn, offsets, i, piece)
            state_md[fqn] = R.TensorStorageMetadata(TensorProperties(value.dtype), value.shape, chunks)
        else:
            state_md[fqn] = R.BytesStorageMetadata()
            item(fqn, None, None, value)
    directory.mkdir()
    (directory / "__0_0.distcp").write_bytes(data.getvalue())
    meta = R.Metadata(state_md, planner_data, storage, R.StorageMeta(pathlib.PosixPath(directory), "abc"))
    saved = {name: sys.modules.get(name) for name in names.values()}
    try:
        sys.modules.update({names[key]: module for key, module in modules.items()})
        with open(directory / ".metadata", "wb") as f:
            pickle.dump(meta, f)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def test_a_dcp_directory_of_torch_2_is_nested_again(tmp_path):
    w, b = torch.randn(5, 3), torch.tensor(1.5, dtype=torch.float64)
    items = {"model.w": w, "model.b": b, "optim.param_groups.0.lr": 0.25, "epoch": 3}
    paths = {"model.w": ("model", "w"), "model.b": ("model", "b"),
             "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr"), "epoch": ("epoch",)}
    write_torch2_dcp(tmp_path / "dcp2", items, paths)
    state = convert.read_dcp(str(tmp_path / "dcp2"))
    same(state, {"model": {"w": w, "b": b}, "optim": {"param_groups": [{"lr": 0.25}]}, "epoch": 3})
    tool("import", tmp_path / "dcp2", "--to", tmp_path / "ckpt")
    same(ec.read(tmp_path / "ckpt")[0], state)


class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickles_that_would_run_code_are_refused_and_nothing_is_written(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"model": {"w": torch.ones(2)}, "evil": RunsCode(marker)}, tmp_path / "evil.pt")
    one_error_line(tool("import", tmp_path / "evil.pt", "--to", tmp_path / "ckpt", expect_rc=1), "evil.pt",
                   "refusing the global posix.system")
    assert not marker.exists() and not (tmp_path / "ckpt").exists()
    # the same in a DCP directory's .metadata
    dcp = convert._torch_dcp()
    dcp.save_state_dict({"w": torch.ones(2)}, dcp.FileSystemWriter(str(tmp_path / "dcp")), no_dist=True)
    import pickle
    with open(tmp_path / "dcp" / ".metadata", "wb") as f:
        pickle.dump(RunsCode(marker), f)
    one_error_line(tool("import", tmp_path / "dcp", "--to", tmp_path / "ckpt", expect_rc=1), ".metadata", "refusing")
    assert not marker.exists() and not (tmp_path / "ckpt").exists()


def test_bad_inputs_one_line_and_nothing_lost(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "a.pt")
    tool("import", tmp_path / "a.pt", "--to", tmp_path / "ckpt", "--step", 3)
    before = sorted(os.listdir(tmp_path / "ckpt"))
    # a directory that already holds steps: never mixed with (or hidden behind) a run's steps
    one_error_line(tool("import", tmp_path / "a.pt", "--to", tmp_path / "ckpt", "--step", 9, expect_rc=1),
                   "already holds checkpoint steps [3]")
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    one_error_line(tool("import", tmp_path / "missing.pt", "--to", tmp_path / "c2", expect_rc=1), "missing.pt",
                   "no such file")
    (tmp_path / "junk.pt").write_text("not a checkpoint")
    one_error_line(tool("import", tmp_path / "junk.pt", "--to", tmp_path / "c2", expect_rc=1), "junk.pt",
                   "not a file torch.save wrote")
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    one_error_line(tool("import", tmp_path / "list.pt", "--to", tmp_path / "c2", expect_rc=1), "not a dict")
    (tmp_path / "plain").mkdir()
    one_error_line(tool("import", tmp_path / "plain", "--to", tmp_path / "c2", expect_rc=1), "no .metadata")
    torch.save({"w": torch.ones(3)}, tmp_path / "b.pt")
    one_error_line(tool("import", tmp_path / "a.pt", tmp_path / "b.pt", "--to", tmp_path / "c2", expect_rc=1),
                   "'w'", "per-rank tensors must have one shape")
    assert not (tmp_path / "c2").exists() or not ec.list_steps(tmp_path / "c2")
    # an export never writes into the checkpoint it reads
    one_error_line(tool("export", tmp_path / "ckpt", "--to", tmp_path / "ckpt" / "x.pt", expect_rc=1), "inside")
    assert sorted(os.listdir(tmp_path / "ckpt")) == before
    # usage errors: exit 2
    tool("import", tmp_path / "a.pt", expect_rc=2)
    tool("export", tmp_path / "ckpt", "--to", tmp_path / "x", "--format", "pickle", expect_rc=2)


def test_the_refusal_list_is_what_a_state_needs():
    """The restricted unpickler reads tensors, Parameters, OrderedDicts, numpy values and sets."""
    import io

    import numpy as np

    state = OrderedDict(p=torch.nn.Parameter(torch.ones(2)), n=np.float64(2.5), a=np.arange(3, dtype=np.uint32),
                        s={1, 2}, c=complex(1, 2), d=torch.device("cpu"), dt=torch.float16)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = convert._torch_load(buffer, "buffer")
    assert torch.equal(loaded["p"], state["p"]) and loaded["n"] == 2.5 and loaded["a"].dtype == np.uint32
    assert loaded["s"] == {1, 2} and loaded["c"] == complex(1, 2) and loaded["dt"] is torch.float16
