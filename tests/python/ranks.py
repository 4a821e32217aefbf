"""The rank side of the multi-process tests: ranks.py SCENARIO ARGS... (see conftest.run_world).

Scenarios build the same deterministic training state on every rank (so replicated tensors are
equal, as under DDP), save or load it with elastrun.checkpoint, and compare bit-exactly against a
reference that rank 0 of the saving world wrote with torch.save.
"""

import os
import random
import struct
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import elastrun.checkpoint as ec
import elastrun.memory
from trees import same

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
EMBED_ROWS, EMBED_DIM = 10, 3


def log(*parts):
    print(f"[rank {RANK}]", *parts, flush=True)


def init_group():
    if WORLD > 1:
        dist.init_process_group("gloo")


def rows_of(rank, world, rows=EMBED_ROWS):
    base, extra = divmod(rows, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def training_state(seed):
    """A model + Adam after 3 steps, an LR scheduler, RNG states; identical on every rank."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    for _ in range(3):
        loss = model(torch.randn(4, 6)).pow(2).sum()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
    np.random.seed(seed)
    random.seed(seed)
    return model, optim, sched


def embedding_rows(start, count):
    return torch.arange(start * EMBED_DIM, (start + count) * EMBED_DIM, dtype=torch.float64).reshape(count, EMBED_DIM)


def state_of(model, optim, sched, with_rng=True):
    start, count = rows_of(RANK, WORLD)
    state = {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
             "embedding": ec.Shard(embedding_rows(start, count), (EMBED_ROWS, EMBED_DIM), (start, 0))}
    if with_rng:
        state["rng"] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    return state


def scenario_save(ckpt_dir, step):
    """Save the reference state at this world size; rank 0 also writes reference.pt."""
    init_group()
    model, optim, sched = training_state(seed=1)
    state = state_of(model, optim, sched)
    info = ec.save(state, ckpt_dir, int(step), metadata={"epoch": 2, "next_sample": 96})
    if RANK == 0:
        ref = {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
               "rng": state["rng"]}
        torch.save(ref, os.path.join(ckpt_dir, "..", "reference.pt"))
    log("saved", info.path, info.bytes_written)


def fresh_state():
    """Another model, a fresh Adam (state {}) and scheduler, no RNG states: what a resume fills."""
    model, optim, sched = training_state(seed=99)  # other values everywhere
    optim = torch.optim.Adam(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.1)
    state = state_of(model, optim, sched, with_rng=False)
    state["embedding"].local_tensor.fill_(-1)
    return model, optim, sched, state


def scenario_load(ckpt_dir, step):
    """Load into a fresh model/Adam/scheduler at this world size; compare with reference.pt; one
    more optimizer step must match the reference's."""
    init_group()
    model, optim, sched, state = fresh_state()
    info = ec.load(state, ckpt_dir)
    assert info is not None and info.step == int(step), info
    assert info.metadata == {"epoch": 2, "next_sample": 96}, info.metadata
    check_restored(model, optim, sched, state, os.path.join(ckpt_dir, "..", "reference.pt"))
    log("loaded step", info.step, "at world", WORLD)


def check_restored(model, optim, sched, state, reference):
    """The restored state equals reference.pt bit for bit, and continues exactly like it."""
    local_embedding = state["embedding"].local_tensor
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])
    sched.load_state_dict(state["sched"])
    ref = torch.load(reference)
    same(model.state_dict(), ref["model"], "model")
    same(optim.state_dict(), ref["optim"], "optim")
    same(sched.state_dict(), ref["sched"], "sched")
    same(state["rng"], ref["rng"], "rng")
    assert isinstance(state["optim"]["param_groups"][0]["betas"], tuple)
    assert sorted(state["optim"]["state"]) == [0, 1, 2, 3]
    start, count = rows_of(RANK, WORLD)
    assert state["embedding"].local_tensor is local_embedding
    assert torch.equal(local_embedding, embedding_rows(start, count)), "embedding shard"
    # The restored RNG state and optimizer state continue exactly like the reference: the same
    # draw from the restored generator as from the reference's, then one more optimizer step.
    ref_model, ref_optim, _ = training_state(seed=1)  # (reseeds: before the RNG states are set)
    torch.set_rng_state(ref["rng"]["torch"])
    expected_x = torch.randn(4, 6)
    torch.set_rng_state(state["rng"]["torch"])
    np.random.set_state(state["rng"]["numpy"])
    random.setstate(state["rng"]["python"])
    x = torch.randn(4, 6)
    assert torch.equal(x, expected_x), "the restored torch RNG state draws differently"
    draw = np.random.randint(1 << 30)
    np.random.set_state(ref["rng"]["numpy"])
    assert draw == np.random.randint(1 << 30), "the restored numpy RNG state draws differently"
    for m, o in ((model, optim), (ref_model, ref_optim)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    same(model.state_dict(), ref_model.state_dict(), "model after one more step")


def scenario_load_imported(ckpt_dir, reference):
    """Resume from a torch.save checkpoint that elastrun-ckpt import turned into a step (the
    ImageNet example's keys): a fresh model and Adam at this world size get the file's values."""
    init_group()
    torch.manual_seed(99)  # other values everywhere; the model of test_convert.imagenet_checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    state = {"state_dict": model.state_dict(), "optimizer": optim.state_dict()}
    info = ec.load(state, ckpt_dir)
    ref = torch.load(reference)
    assert info is not None and info.metadata["epoch"] == ref["epoch"] and info.metadata["arch"] == ref["arch"], info
    model.load_state_dict(state["state_dict"])
    optim.load_state_dict(state["optimizer"])
    same(model.state_dict(), ref["state_dict"], "state_dict")
    same(optim.state_dict(), ref["optimizer"], "optimizer")
    same(state["best_acc1"], ref["best_acc1"], "best_acc1")
    assert state["epoch"] == ref["epoch"] and state["arch"] == ref["arch"]
    log("resumed the imported step", info.step, "at world", WORLD)


def scenario_memory(ckpt_dir):
    """Under `elastrun --memory-checkpoints --max-restarts=1` (RANK etc. from the agent).
    Attempt 0: file step 3, memory step 5 of the reference state (tier="memory"), then rank 1 exits
    3. Attempt 1, in fresh processes: load() takes step 5 from this node's agent (newer than the
    file's 3) bit for bit, Shard box and RNG states included; memory=False takes the file's 3; a
    newer file step (7) wins over memory; a newer memory step (8) wins again."""
    init_group()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    reference = os.path.join(ckpt_dir, "..", "reference.pt")
    assert ec.memory_available(), "the agent keeps no memory checkpoints"
    if attempt == 0:
        model, optim, sched = training_state(seed=1)
        state = state_of(model, optim, sched)
        ec.save(state, ckpt_dir, 3, metadata={"epoch": 2, "next_sample": 96})
        info = ec.save(state, ckpt_dir, 5, metadata={"epoch": 2, "next_sample": 160}, tier="memory")
        assert info.path == "memory" and info.bytes_written > 0, info
        assert [step for step, _ in ec.list_steps(ckpt_dir)] == [3], "tier='memory' wrote to the directory"
        if RANK == 0:
            torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
                        "rng": state["rng"]}, reference)
        dist.barrier()
        if RANK == 1:
            log("exiting 3 after the memory snapshot of step 5")
            sys.exit(3)
        time.sleep(60)  # stopped by the agent when rank 1 fails
        return
    model, optim, sched, state = fresh_state()
    info = ec.load(state, ckpt_dir)
    assert info is not None and (info.step, info.source, info.path) == (5, "memory-local", "memory"), info
    assert info.metadata == {"epoch": 2, "next_sample": 160}, info.metadata
    check_restored(model, optim, sched, state, reference)
    model, optim, sched, state = fresh_state()
    info = ec.load(state, ckpt_dir, memory=False)
    assert (info.step, info.source) == (3, "file"), info
    check_restored(model, optim, sched, state, reference)
    ec.save(state, ckpt_dir, 7, metadata={"next_sample": 224})
    model, optim, sched, state = fresh_state()
    info = ec.load(state, ckpt_dir)
    assert (info.step, info.source) == (7, "file"), info
    ec.save(state, ckpt_dir, 8, metadata={"next_sample": 256}, tier="memory")
    info = ec.load(fresh_state()[3], ckpt_dir)
    assert (info.step, info.source, info.metadata) == (8, "memory-local", {"next_sample": 256}), info
    # a target that is not contiguous (read into a temporary, then copied)
    saved = {"t": torch.arange(12.0).reshape(3, 4).t()}
    ec.save(saved, ckpt_dir, 9, tier="memory")
    into = {"t": torch.zeros(3, 4).t()}
    info = ec.load(into, ckpt_dir)
    assert (info.step, info.source) == (9, "memory-local") and torch.equal(into["t"], saved["t"]), (info, into)
    # a snapshot changed after its commit (here through the writer's cached writable mapping: a
    # writer that broke the protocol) fails its checksum: rank 0 restores this replicated state
    # from rank 1's snapshot (each rank's holds its own values here, so the values say whose was
    # used); once rank 1's is changed too, every rank restores from the file tier
    ec.save(saved, ckpt_dir, 10)
    ec.save({"t": saved["t"] * 2 + RANK}, ckpt_dir, 11, tier="memory")

    def corrupt(rank):
        if RANK == rank:
            mapping = next(reversed(elastrun.memory._WRITABLE_MAPPINGS.values()))
            (length,) = struct.unpack("<Q", mapping[8:16])
            mapping[ec._aligned(16 + length)] ^= 0xFF  # the first byte of the tensor's data
        dist.barrier()

    corrupt(0)
    into = {"t": torch.zeros(3, 4).t()}
    info = ec.load(into, ckpt_dir)
    assert (info.step, info.source) == (11, "memory-local") and torch.equal(into["t"], saved["t"] * 2 + 1), \
        (info, into)
    corrupt(1)
    info = ec.load(into, ckpt_dir)
    assert (info.step, info.source) == (10, "file") and torch.equal(into["t"], saved["t"]), (info, into)
    # AsyncSaver: save() returns after the copy (the tensor changes right after), its thread commits
    with ec.AsyncSaver(ckpt_dir) as saver:
        changing = {"t": (saved["t"] * 3).contiguous()}  # contiguous: copied by save() straight from it
        assert changing["t"].is_contiguous()
        saver.save(changing, 12, tier="memory", metadata={"next_sample": 384})
        changing["t"].zero_()
        done = saver.wait()
        assert (done.step, done.path) == (12, "memory") and done.bytes_written > 0, done
        info = ec.load(into, ckpt_dir)
        assert (info.step, info.source) == (12, "memory-local") and torch.equal(into["t"], saved["t"] * 3), info
        saver.save(changing, 13, tier="file")  # then a file save through the same saver
        assert saver.wait().step == 13
    info = ec.load(into, ckpt_dir)
    assert (info.step, info.source) == (13, "file") and not into["t"].any(), info
    with ec.AsyncSaver(ckpt_dir) as saver:
        saver.save({"t": saved["t"] * 3}, 14, tier="memory", metadata={"next_sample": 448})
    info = ec.load(into, ckpt_dir)  # the saver's close() committed it
    assert (info.step, info.source, info.metadata) == (14, "memory-local", {"next_sample": 448}), info
    assert torch.equal(into["t"], saved["t"] * 3), into
    log("memory tier ok")


def scenario_async_equals_sync(ckpt_dir):
    """AsyncSaver's checkpoint equals a sync save of the same state, though training changed the
    tensors right after save() returned."""
    init_group()
    model, optim, sched = training_state(seed=5)
    state = state_of(model, optim, sched, with_rng=False)
    ec.save(state, os.path.join(ckpt_dir, "sync"), 4)
    saver = ec.AsyncSaver(os.path.join(ckpt_dir, "async"))
    saver.save(state, 4)
    with torch.no_grad():  # training goes on at once
        for p in model.parameters():
            p.add_(1.0)
        state["embedding"].local_tensor.mul_(-3)
    info = saver.wait()
    assert info is not None and info.path.endswith("step-000000004"), info
    saver.close()
    loaded = {}
    for flavour in ("sync", "async"):
        fresh_model, _, fresh_sched = training_state(seed=77)
        into = state_of(fresh_model, torch.optim.Adam(fresh_model.parameters()), fresh_sched, with_rng=False)
        ec.load(into, os.path.join(ckpt_dir, flavour))
        loaded[flavour] = into
    same(loaded["sync"]["model"], loaded["async"]["model"], "model")
    same(loaded["sync"]["optim"], loaded["async"]["optim"], "optim")
    same(loaded["sync"]["embedding"].local_tensor, loaded["async"]["embedding"].local_tensor, "embedding")
    start, count = rows_of(RANK, WORLD)
    assert torch.equal(loaded["async"]["embedding"].local_tensor, embedding_rows(start, count)), \
        "the async checkpoint holds values changed after save() returned"
    log("async equals sync")


def scenario_local_dir(shared, elsewhere):
    """Rank 1 loads from another directory than its peers (what a node-local path gives): every
    rank fails at once with one error naming rank 1's node, none starts afresh."""
    init_group()
    try:
        ec.load({"w": torch.zeros(4)}, shared if RANK == 0 else elsewhere, missing_ok=True, timeout=_short())
    except ec.CheckpointError as e:
        assert "rank 1 (node " in str(e) and "shared filesystem" in str(e), str(e)
        log("refused:", e)
        return
    raise AssertionError("a rank without the checkpoint directory loaded (or started afresh)")


def _short():
    import datetime

    return datetime.timedelta(seconds=60)


def scenario_mismatch(ckpt_dir):
    """A state_dict whose tensor has another shape: every rank raises one CheckpointMismatchError
    naming the key; nothing is written into the tensors."""
    init_group()
    w = torch.full((4, 4), 7.0)
    try:
        ec.load({"model": {"0.weight": w}}, ckpt_dir)
    except ec.CheckpointMismatchError as e:
        assert "model/0.weight" in str(e) and "shape [8, 6]" in str(e), str(e)
        assert torch.equal(w, torch.full((4, 4), 7.0))
        log("mismatch:", e)
        return
    raise AssertionError("a shape mismatch loaded")


def scenario_own_store(ckpt_dir):
    """No process group: save, async save and load through the package's own store; MASTER_PORT
    stays free for the workers' process group."""
    import socket

    state = {"w": torch.arange(12, dtype=torch.float32), "rank_slice": ec.Shard(torch.full((2,), float(RANK)),
                                                                                  (2 * WORLD,), (2 * RANK,))}
    ec.save(state, ckpt_dir, 1)
    with ec.AsyncSaver(ckpt_dir) as saver:
        saver.save(state, 2)
    into = {"w": torch.zeros(12), "rank_slice": torch.zeros(2 * WORLD)}
    info = ec.load(into, ckpt_dir)
    assert info.step == 2 and torch.equal(into["w"], state["w"])
    assert torch.equal(into["rank_slice"], torch.arange(WORLD, dtype=torch.float32).repeat_interleave(2))
    if RANK == 0:
        with socket.socket() as s:
            # SO_REUSEADDR: an earlier job's connections to this port may linger in TIME_WAIT; a
            # listener (the package having taken the port) still makes the bind fail
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
    log("own store ok")


def scenario_diverged_replicas(ckpt_dir):
    """A 'replicated' tensor that differs across ranks fails the save on every rank, naming it."""
    init_group()
    try:
        ec.save({"model": {"w": torch.full((64,), float(RANK))}}, ckpt_dir, 1)
    except ec.CheckpointError as e:
        assert "model/w" in str(e), str(e)
        assert ec.list_steps(ckpt_dir) == []
        log("refused:", e)
        return
    raise AssertionError("diverged replicas were saved")


def scenario_sync_one_bad_rank(ckpt_dir):
    """A sync save whose state_dict one rank cannot convert: that rank raises the cause, the others
    a CheckpointError naming it (not a timeout); the next save works."""
    import datetime

    init_group()
    good = {"w": torch.arange(8, dtype=torch.float32)}
    try:
        ec.save({**good, "bad": object()} if RANK == 1 else good, ckpt_dir, 1,
                timeout=datetime.timedelta(seconds=120))
        raise AssertionError("step 1 was saved although rank 1 failed")
    except ec.TreeError as e:
        assert RANK == 1, e
        log("raised the cause:", e)
    except ec.CheckpointError as e:
        assert RANK != 1 and "rank 1" in str(e) and "bad" in str(e), str(e)
        log("failed with rank 1:", e)
    ec.save(good, ckpt_dir, 2)
    assert [step for step, _ in ec.list_steps(ckpt_dir)] == [2]
    log("sync bad rank ok")


def scenario_async_one_bad_rank(ckpt_dir):
    """One rank's state_dict cannot be converted: that rank raises at once, and every rank's next
    wait() raises the failure naming it (not a timeout); the saver then works again."""
    import datetime

    init_group()
    good = {"w": torch.arange(8, dtype=torch.float32)}
    with ec.AsyncSaver(ckpt_dir, timeout=datetime.timedelta(seconds=120)) as saver:
        if RANK == 1:
            try:
                saver.save({**good, "bad": object()}, 1)
                raise AssertionError("an object() leaf was accepted")
            except ec.TreeError as e:
                log("raised at once:", e)
        else:
            saver.save(good, 1)
        try:
            saver.wait()
            raise AssertionError("step 1 was saved although rank 1 failed")
        except ec.CheckpointError as e:
            assert "rank 1" in str(e) and "bad" in str(e), str(e)
            log("wait raised:", e)
        saver.save(good, 2)
        saver.wait()
    assert [step for step, _ in ec.list_steps(ckpt_dir)] == [2]
    log("async bad rank ok")


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    SCENARIOS[sys.argv[1]](*sys.argv[2:])
    if dist.is_initialized():
        dist.destroy_process_group()
