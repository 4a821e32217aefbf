"""elastrun.checkpoint: round trips, resharding across world sizes, async, damage, bad arguments."""

import json
import os
import subprocess

import h5py
import numpy as np
import pytest
import torch

import elastrun.checkpoint as ec
from conftest import HERE, PYTHON, run_world

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8, torch.bool]
SHAPES = [(), (0,), (5,), (3, 4), (2, 3, 4), (1, 1, 7)]


def sample(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float64) * 100).to(dtype)
    info = torch.iinfo(dtype)  # int64's whole range overflows randint's (high - low)
    low, high = max(info.min, -2**62), min(info.max, 2**62)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int64).to(dtype)


def test_every_dtype_and_shape_round_trips_bit_exactly(tmp_path):
    state, seed = {}, 0
    for dtype in DTYPES:
        for shape in SHAPES:
            seed += 1
            state.setdefault(str(dtype).split(".")[1], {})[str(len(shape)) + "d" + "x".join(map(str, shape))] = \
                sample(dtype, shape, seed)
    # non-contiguous (copied once), a numpy array, and a tensor a DLPack export cannot see as is
    state["strided"] = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    state["array"] = np.arange(12, dtype=np.int32).reshape(3, 4)
    ec.save(state, tmp_path, 1)
    # in place: zeroed tensors of the same dtypes and shapes
    into = {k: ({n: torch.zeros_like(t) for n, t in v.items()} if isinstance(v, dict) else None)
            for k, v in state.items()}
    into["strided"] = torch.zeros(4, 6).t()  # non-contiguous target: read, then copied in
    strided_target = into["strided"]
    kept = {k: dict(v) for k, v in into.items() if isinstance(v, dict)}
    info = ec.load(into, tmp_path)
    assert info.step == 1 and info.skipped == []
    for group, tensors in kept.items():
        for name, tensor in tensors.items():
            assert into[group][name] is tensor, f"{group}/{name} was not filled in place"
            original = state[group][name]
            assert tensor.dtype == original.dtype and tensor.shape == original.shape
            assert torch.equal(tensor, original), f"{group}/{name}"
    assert into["strided"] is strided_target and torch.equal(strided_target, state["strided"])
    assert isinstance(into["array"], np.ndarray) and np.array_equal(into["array"], state["array"])
    # created: an empty dict receives every entry
    fresh = {}
    ec.load(fresh, tmp_path)
    for group, tensors in kept.items():
        for name in tensors:
            assert torch.equal(fresh[group][name], state[group][name])


def test_plain_values_keep_their_types(tmp_path):
    state = {"ints": {0: 1, 7: -2, 2**70: "big key"}, "tuple": (1, 2.5, None, True, "x", b"\x00\xff"),
             "floats": [float("inf"), float("-inf"), float("nan"), 0.1], "nested": [{"a": [(), []]}],
             "np": np.float32(1.5), "dtype": torch.bfloat16, "big": 2**80, "t": torch.ones(2)}
    ec.save(state, tmp_path, 3)
    back = {}
    ec.load(back, tmp_path)
    assert back["ints"] == {0: 1, 7: -2, 2**70: "big key"}
    assert back["tuple"] == (1, 2.5, None, True, "x", b"\x00\xff") and isinstance(back["tuple"], tuple)
    assert back["floats"][:2] == [float("inf"), float("-inf")] and back["floats"][2] != back["floats"][2]
    assert back["nested"] == [{"a": [(), []]}] and isinstance(back["nested"][0]["a"][0], tuple)
    assert back["np"] == np.float32(1.5) and type(back["np"]) is np.float32
    assert back["dtype"] is torch.bfloat16 and back["big"] == 2**80


@pytest.fixture(scope="module")
def world4_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("world4")
    run_world(4, "save", root / "ckpt", 3)
    return root / "ckpt"


@pytest.mark.parametrize("world", [3, 2, 1])
def test_model_and_adam_saved_at_world_4_load_bit_exactly_at(world4_checkpoint, world):
    run_world(world, "load", world4_checkpoint, 3)


def test_h5py_reads_the_python_checkpoint(world4_checkpoint):
    ref = torch.load(world4_checkpoint / ".." / "reference.pt")
    with h5py.File(world4_checkpoint / "latest" / "index.h5", "r") as f:
        assert f.attrs["world_size"] == 4 and f.attrs["step"] == 3
        assert np.array_equal(f["model/0.weight"][()], ref["model"]["0.weight"].numpy())
        assert np.array_equal(f["optim/state/1/exp_avg_sq"][()], ref["optim"]["state"][1]["exp_avg_sq"].numpy())
        assert np.array_equal(f["embedding"][()], np.arange(30, dtype=np.float64).reshape(10, 3))
        metadata = json.loads(f["_elastrun/user_metadata"][()])
        assert metadata["epoch"] == 2 and "_elastrun_state" in metadata


def test_shape_mismatch_names_the_key_on_every_rank(world4_checkpoint):
    out = run_world(2, "mismatch", world4_checkpoint)
    assert all("model/0.weight" in o for o in out)


def test_async_equals_sync_while_training_modifies_the_tensors(tmp_path):
    run_world(2, "async_equals_sync", tmp_path)


def test_a_save_failing_on_one_rank_fails_every_rank_without_a_timeout(tmp_path):
    out = run_world(3, "sync_one_bad_rank", tmp_path / "sync")
    assert all("sync bad rank ok" in o for o in out)
    out = run_world(2, "async_one_bad_rank", tmp_path / "async")
    assert all("async bad rank ok" in o for o in out)


def test_without_a_process_group_the_ranks_open_their_own_store(tmp_path):
    # No init_process_group: the package's own store (never MASTER_PORT, which stays free).
    run_world(3, "own_store", tmp_path)


def test_under_torchrun(tmp_path):
    # torchrun's workers: with a process group (the group's store), and without (the package's own)
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env["OMP_NUM_THREADS"] = "1"
    for args in (["save", tmp_path / "ckpt", 3], ["own_store", tmp_path / "own"]):
        out = subprocess.run(["/usr/bin/python3", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                              "--redirects", "9:0", "--tee", "9:0",  # 1.13 on Python 3.11 needs a map here
                              os.path.join(here, "ranks.py"), *map(str, args)], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, f"torchrun {args[0]}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    run_world(1, "load", tmp_path / "ckpt", 3)


def test_corrupt_shard_falls_back_to_the_previous_step(tmp_path):
    w = torch.arange(4096, dtype=torch.float32)
    ec.save({"w": w}, tmp_path, 1)
    ec.save({"w": w * 2}, tmp_path, 2)
    shard = tmp_path / "step-000000002" / "shard-00000-of-00001.h5"
    with h5py.File(shard, "r") as f:
        offset = f["w"].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xde\xad\xbe\xef")
    into = {"w": torch.zeros(4096)}
    info = ec.load(into, tmp_path)
    assert info.step == 1 and torch.equal(into["w"], w)
    assert len(info.skipped) == 1 and "step-000000002" in info.skipped[0], info.skipped
    assert ec.verify(str(tmp_path / "step-000000002")) != [] and ec.verify(str(tmp_path / "step-000000001")) == []


def damage(step_dir):
    shard = step_dir / "shard-00000-of-00001.h5"
    with h5py.File(shard, "r") as f:
        offset = f["w"].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(offset + 100)
        f.write(b"\xde\xad\xbe\xef")


def test_every_step_damaged_is_an_error_not_a_fresh_start(tmp_path, capfd):
    ec.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path, 1)
    ec.save({"w": torch.ones(4096)}, tmp_path, 2)
    for step in ("step-000000001", "step-000000002"):
        damage(tmp_path / step)
    into = {"w": torch.zeros(4096)}
    with pytest.raises(ec.CorruptCheckpointError) as e:
        ec.load(into, tmp_path)
    assert "step-000000001: rank 0" in str(e.value) and "step-000000002: rank 0" in str(e.value), str(e.value)
    assert torch.equal(into["w"], torch.zeros(4096))
    # asked for: a fresh start, with a warning naming the steps
    assert ec.load(into, tmp_path, allow_fresh_start=True) is None
    assert "starting afresh" in capfd.readouterr().err
    # the damaged history is kept by retention (marked by the restore that rejected it)
    ec.save({"w": torch.zeros(4096)}, tmp_path, 3, keep_last=1)
    assert [s for s, _ in ec.list_steps(tmp_path)] == [1, 2, 3]


def test_a_node_local_checkpoint_directory_is_an_error_naming_the_node(tmp_path):
    ec.save({"w": torch.ones(4)}, tmp_path / "shared", 7)
    (tmp_path / "local").mkdir()
    # rank 1's "ckpt_dir" is another directory: empty (node-local storage), then missing
    run_world(2, "local_dir", tmp_path / "shared", tmp_path / "local")
    run_world(2, "local_dir", tmp_path / "shared", tmp_path / "nowhere")


def test_one_mebibyte_of_metadata(tmp_path):
    blob = "".join(chr(ord("a") + i % 26) for i in range(1 << 20))
    ec.save({"w": torch.ones(3)}, tmp_path, 5, metadata={"blob": blob, "position": 123})
    info = ec.load({"w": torch.zeros(3)}, tmp_path)
    assert info.metadata == {"blob": blob, "position": 123}


def test_retention_and_listing(tmp_path):
    for step in range(1, 6):
        ec.save({"w": torch.full((2,), float(step))}, tmp_path, step, keep_last=2)
    assert [s for s, _ in ec.list_steps(tmp_path)] == [4, 5]


# ---- bad arguments: one clear Python exception naming the key, never a crash --------------------

def test_unsupported_values_name_their_key(tmp_path):
    with pytest.raises(ec.TreeError, match=r"'optim/state/0/fn'.*function"):
        ec.save({"optim": {"state": {0: {"fn": lambda: 0}}}}, tmp_path, 1)
    with pytest.raises(TypeError, match=r"'c'.*complex64"):
        ec.save({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path, 1)
    with pytest.raises(ec.TreeError, match=r"dict key"):
        ec.save({"k": {(1, 2): torch.ones(1)}}, tmp_path, 1)
    with pytest.raises(TypeError, match="metadata is not JSON"):
        ec.save({"w": torch.ones(1)}, tmp_path, 1, metadata={"x": object()})
    with pytest.raises(ValueError, match="step must be"):
        ec.save({"w": torch.ones(1)}, tmp_path, -1)
    with pytest.raises(TypeError, match="state_dict must be a dict"):
        ec.save([torch.ones(1)], tmp_path, 1)
    assert ec.list_steps(tmp_path) == []  # nothing was written


def test_load_errors_name_the_key_and_leave_tensors_untouched(tmp_path):
    ec.save({"model": {"w": torch.ones(3, 2)}}, tmp_path, 1)
    target = torch.full((2, 3), 5.0)
    with pytest.raises(ec.CheckpointMismatchError, match=r"'model/w': shape \[3, 2\] in the checkpoint, \[2, 3\]"):
        ec.load({"model": {"w": target}}, tmp_path)
    assert torch.equal(target, torch.full((2, 3), 5.0))
    with pytest.raises(ec.CheckpointMismatchError, match=r"'model/w': dtype float32 in the checkpoint"):
        ec.load({"model": {"w": torch.zeros(3, 2, dtype=torch.float64)}}, tmp_path)
    with pytest.raises(ec.CheckpointMismatchError, match=r"'model/extra': in the state_dict but not"):
        ec.load({"model": {"w": torch.zeros(3, 2), "extra": torch.zeros(1)}}, tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ec.load({}, tmp_path / "typo")
    assert ec.load({}, tmp_path / "typo", missing_ok=True) is None
    (tmp_path / "empty").mkdir()
    assert ec.load({}, tmp_path / "empty") is None


def test_replicas_that_differ_fail_the_save_on_every_rank(tmp_path):
    run_world(2, "diverged_replicas", tmp_path)


def test_a_failed_async_save_raises_on_the_next_call(tmp_path):
    root = tmp_path / "ckpt"
    saver = ec.AsyncSaver(root)
    root.rmdir()
    root.write_text("not a directory any more")
    saver.save({"w": torch.ones(2)}, 1)  # the write fails in the background
    with pytest.raises(ec.CheckpointError):
        saver.save({"w": torch.ones(2)}, 2)
    saver.close()


def test_interpreter_exit_waits_for_the_async_save(tmp_path):
    script = f"""
import torch, elastrun.checkpoint as ec
saver = ec.AsyncSaver({str(tmp_path)!r})
saver.save({{"w": torch.arange(1 << 20, dtype=torch.float32)}}, 9)
"""  # no wait(): the atexit hook must finish the save before the interpreter goes
    subprocess.run(["/usr/bin/python3", "-c", script], check=True, timeout=120)
    assert [s for s, _ in ec.list_steps(tmp_path)] == [9]


def test_memory_tier_restores_the_newest_step_of_the_agents_memory(tmp_path):
    """save(tier="memory") and load() against a real agent (elastrun --memory-checkpoints): after a
    worker crash the new processes restore the memory step bit for bit (ranks.py memory)."""
    agent = os.environ.get("ELASTRUN_AGENT")
    if not agent:
        pytest.skip("ELASTRUN_AGENT (the elastrun binary) not set: run through ctest")
    (tmp_path / "ckpt").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTRUN_", "TORCHELASTIC_", "PET_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(ELASTRUN_PYTHON=PYTHON, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([agent, "--standalone", "--nproc-per-node=2", "--max-restarts=1",
                             "--memory-checkpoints=16M", os.path.join(HERE, "ranks.py"), "memory",
                             str(tmp_path / "ckpt")], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert out.count("memory tier ok") == 2, out
