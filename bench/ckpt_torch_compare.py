#!/usr/bin/python3
"""Reference figures for the checkpoint benchmark, measured in the same run as ours:
torch.save/torch.load per rank, h5py per rank and torch.distributed.checkpoint (DCP) save/load, N ranks
(processes, gloo), each saving MIB MiB of float32 tensors to DIR, fsynced. Loads read from the
page cache, like ours in ckpt_bench, into a model's existing tensors (allocated and written
before, as a model's are): torch.load is timed with the copy into them (load_state_dict). Prints one line per measure:
    <measure>\t<seconds>\t<GB/s>
Debian's torch 1.13 ships DCP as torch.distributed._shard.checkpoint, and its metadata module
does not import under Python 3.11 (a dataclass field with an instance default, rejected since
3.11). lenient_dataclass_defaults() turns such defaults into default_factory copies, which is
what 3.11 asks for, so the reference can run unchanged.
With the elastrun Python package importable (PYTHONPATH=build/python), the same tensors through
elastrun.checkpoint too (sync save, load, async blocking/durable, memcpy floor, extra memory).
Usage: ckpt_torch_compare.py DIR [--ranks 4] [--mib-per-rank 256] [--tensors 16]
Needs Debian's python3-torch (run with /usr/bin/python3)."""
import argparse
import copy
import dataclasses
import os
import shutil
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def lenient_dataclass_defaults():
    original = dataclasses._get_field

    def get_field(cls, name, annotation, *rest):
        try:
            return original(cls, name, annotation, *rest)
        except ValueError as e:
            declared = cls.__dict__.get(name)
            if "mutable default" not in str(e) or not isinstance(declared, dataclasses.Field):
                raise
            value = declared.default
            declared.default = dataclasses.MISSING
            declared.default_factory = lambda: copy.deepcopy(value)
            return original(cls, name, annotation, *rest)

    dataclasses._get_field = get_field


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def peak_extra_bytes(action):
    """Runs action(); returns how far the process's peak RSS rose above its RSS before (clear_refs
    "5" resets VmHWM; None where it is not writable)."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        action()
        return None
    before = status("VmRSS")
    action()
    return max(0, status("VmHWM") - before)


def settle(rank):
    """Before each timed save: every rank here, the earlier measures' dirty pages written back,
    the disk idle for a moment -- each tool starts from the same state, whatever ran before it."""
    dist.barrier()
    if rank == 0:
        os.sync()
    time.sleep(1.0)
    dist.barrier()


def warm_up(rank, args, state):
    """Untimed: each rank writes its tensors to a scratch file once and deletes it. On
    paravirtualised VMs the kernel's first access to fresh user memory costs a hypervisor fault per
    page; a training job pays it at its first checkpoint only, and without this the first tool
    measured (torch.save) would pay it for all of them."""
    path = os.path.join(args.dir, f"warm-up-{rank}")
    with open(path, "wb") as f:
        for tensor in state.values():
            f.write(tensor.numpy().data)
    os.unlink(path)


def measure_python_package(rank, world, args, state, per_tensor):
    """The elastrun Python package on the same tensors (each rank's slice of tensor i as a Shard
    of a [world * n] tensor, like DCP's and ckpt_bench's layout): sync save, load in place, async
    blocking and durable times, a memcpy of the shard (the async floor), the extra memory of a sync
    save (max over ranks). Seconds (bytes for memory); {} if the package is not importable."""
    try:
        import elastrun.checkpoint as ec
    except ImportError as e:
        if rank == 0:
            print(f"# elastrun Python package unavailable: {e}", flush=True)
        return {}
    out = {}
    shards = {f"t{i}": ec.Shard(state[f"rank{rank}.t{i}"], (world * per_tensor,), (rank * per_tensor,))
              for i in range(args.tensors)}
    root = os.path.join(args.dir, "elastrun-py")
    settle(rank)
    t0 = time.perf_counter()
    extra = peak_extra_bytes(lambda: ec.save(shards, root, 1))
    dist.barrier()
    out["elastrun.checkpoint save (Python)"] = time.perf_counter() - t0
    targets = {name: ec.Shard(torch.zeros(per_tensor), (world * per_tensor,), (rank * per_tensor,)) for name in shards}
    dist.barrier()
    t0 = time.perf_counter()
    ec.load(targets, root)
    dist.barrier()
    out["elastrun.checkpoint load (Python)"] = time.perf_counter() - t0
    for name, shard in shards.items():
        if not torch.equal(targets[name].local_tensor, shard.local_tensor):
            raise RuntimeError(f"elastrun.checkpoint load returned different values for {name}")
    del targets
    # async: warm the staging buffer once (the steady state of a training job), then measure
    with ec.AsyncSaver(os.path.join(args.dir, "elastrun-py-async")) as saver:
        saver.save(shards, 1)
        saver.wait()
        dist.barrier()
        t0 = time.perf_counter()
        saver.save(shards, 2)
        blocked = time.perf_counter() - t0
        saver.wait()
        durable = time.perf_counter() - t0
        dist.barrier()
    warm = [torch.empty_like(s.local_tensor) for s in shards.values()]
    for dst, shard in zip(warm, shards.values()):
        dst.copy_(shard.local_tensor)
    t0 = time.perf_counter()
    for dst, shard in zip(warm, shards.values()):
        dst.copy_(shard.local_tensor)
    memcpy = time.perf_counter() - t0
    del warm
    # this rank's worst: gathered so rank 0 reports the maximum over ranks
    mine = torch.tensor([blocked, durable, memcpy, float(extra if extra is not None else -1)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    worst = torch.stack(every).max(dim=0).values.tolist()
    out["elastrun.checkpoint async blocked (Python)"] = worst[0]
    out["elastrun.checkpoint async durable (Python)"] = worst[1]
    out["memcpy of the shard (Python)"] = worst[2]
    if worst[3] >= 0:
        out["elastrun.checkpoint peak extra bytes (Python)"] = worst[3]
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.path.join(args.dir, "elastrun-py-async"), ignore_errors=True)
    return out


def worker(rank, world, args, init_method, results):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    per_tensor = args.mib_per_rank * (1 << 20) // 4 // args.tensors
    state = {f"rank{rank}.t{i}": torch.rand(per_tensor) for i in range(args.tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values()) * world

    warm_up(rank, args, state)
    out = os.path.join(args.dir, "torch_save")
    os.makedirs(out, exist_ok=True)
    settle(rank)
    t0 = time.perf_counter()
    path = os.path.join(out, f"rank{rank}.pt")
    torch.save(state, path)
    fsync_tree(out) if rank == 0 else None
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dist.barrier()
    t_save = time.perf_counter() - t0

    # torch.load + load_state_dict: the loaded tensors are copied into the model's existing ones
    model = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
    dist.barrier()
    t0 = time.perf_counter()
    loaded = torch.load(path)
    with torch.no_grad():
        for name, tensor in loaded.items():
            model[name].copy_(tensor)
    dist.barrier()
    t_load = time.perf_counter() - t0
    del loaded, model
    os.unlink(path)  # each measure's files go once read: the next tool writes into the same free memory

    # h5py writing the same tensors, one file per rank (a hand-written HDF5 checkpoint), fsynced
    t_h5 = t_h5_load = None
    try:
        import h5py

        h5_dir = os.path.join(args.dir, "h5py")
        os.makedirs(h5_dir, exist_ok=True)
        h5_path = os.path.join(h5_dir, f"rank{rank}.h5")
        settle(rank)
        t0 = time.perf_counter()
        with h5py.File(h5_path, "w") as f:
            for name, tensor in state.items():
                f.create_dataset(name, data=tensor.numpy())
        fd = os.open(h5_path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        if rank == 0:
            fsync_tree(h5_dir)
        dist.barrier()
        t_h5 = time.perf_counter() - t0
        targets = {name: torch.zeros_like(tensor) for name, tensor in state.items()}
        dist.barrier()
        t0 = time.perf_counter()
        with h5py.File(h5_path, "r") as f:
            for name, target in targets.items():
                f[name].read_direct(target.numpy())
        dist.barrier()
        t_h5_load = time.perf_counter() - t0
        os.unlink(h5_path)
    except Exception as e:  # report rather than fail
        if rank == 0:
            print(f"# h5py unavailable: {e}", flush=True)

    python_package = measure_python_package(rank, world, args, state, per_tensor)

    t_dcp = t_dcp_load = None
    try:
        lenient_dataclass_defaults()
        try:
            import torch.distributed.checkpoint as dcp
        except ImportError:  # 1.13 ships it as a prototype under _shard
            import torch.distributed._shard.checkpoint as dcp
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

        # 1.13's default planner writes plain tensors from the coordinator only (it treats them
        # as replicated), so every rank's data goes in as one shard of a ShardedTensor: tensor i
        # is [world * n] elements, rank r holds [r * n, (r + 1) * n), like ckpt_bench's layout.
        def sharded(local):
            n = local.numel()
            return init_from_local_shards([Shard.from_tensor_and_offsets(local, [rank * n], rank)], world * n)

        dcp_state = {f"t{i}": sharded(state[f"rank{rank}.t{i}"]) for i in range(args.tensors)}
        dcp_dir = os.path.join(args.dir, "dcp")
        settle(rank)
        t0 = time.perf_counter()
        dcp.save_state_dict(state_dict=dcp_state, storage_writer=dcp.FileSystemWriter(dcp_dir))
        if rank == 0:
            fsync_tree(dcp_dir)
        dist.barrier()
        t_dcp = time.perf_counter() - t0
        target = {name: sharded(torch.zeros(per_tensor)) for name in dcp_state}
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load_state_dict(state_dict=target, storage_reader=dcp.FileSystemReader(dcp_dir))
        dist.barrier()
        t_dcp_load = time.perf_counter() - t0
        for i in range(args.tensors):
            if not torch.equal(target[f"t{i}"].local_tensor(), state[f"rank{rank}.t{i}"]):
                raise RuntimeError(f"DCP load returned different values for t{i}")
    except Exception as e:  # DCP is a prototype in 1.13; report rather than fail
        if rank == 0:
            print(f"# DCP unavailable: {e}", flush=True)
    if rank == 0:
        for name, secs in python_package.items():
            results.put((name, secs, nbytes / secs / 1e9 if secs else 0.0))
        results.put(("torch.save per rank", t_save, nbytes / t_save / 1e9))
        results.put(("torch.load per rank", t_load, nbytes / t_load / 1e9))
        if t_h5:
            results.put(("h5py save per rank", t_h5, nbytes / t_h5 / 1e9))
            results.put(("h5py load per rank", t_h5_load, nbytes / t_h5_load / 1e9))
        if t_dcp:
            results.put(("torch.distributed.checkpoint save", t_dcp, nbytes / t_dcp / 1e9))
        if t_dcp_load:
            results.put(("torch.distributed.checkpoint load", t_dcp_load, nbytes / t_dcp_load / 1e9))
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib-per-rank", type=int, default=256)
    p.add_argument("--tensors", type=int, default=16)
    args = p.parse_args()
    args.dir = tempfile.mkdtemp(prefix="torchcmp-", dir=args.dir)
    torch.set_num_threads(1)
    # a TCPStore, as jobs have (the elastrun package votes through the group's store; a FileStore
    # rereads its whole file on every operation)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, args, init_method, results)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    while not results.empty():
        name, secs, gbs = results.get()
        print(f"{name}\t{secs:.3f}\t{gbs:.2f}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
