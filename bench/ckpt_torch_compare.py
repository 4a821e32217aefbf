#!/usr/bin/python3
"""Reference figures for the checkpoint benchmark, measured in the same run as ours:
torch.save per rank and torch.distributed.checkpoint (DCP), N ranks (processes, gloo), each
saving MIB MiB of float32 tensors to DIR, fsynced. Prints one line per measure:
    <measure>\t<seconds>\t<GB/s>
Usage: ckpt_torch_compare.py DIR [--ranks 4] [--mib-per-rank 256] [--tensors 16]
Needs Debian's python3-torch (run with /usr/bin/python3)."""
import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def fsync_tree(path):
    for root, _, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def worker(rank, world, args, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    per_tensor = args.mib_per_rank * (1 << 20) // 4 // args.tensors
    state = {f"rank{rank}.t{i}": torch.rand(per_tensor) for i in range(args.tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values()) * world

    out = os.path.join(args.dir, "torch_save")
    os.makedirs(out, exist_ok=True)
    dist.barrier()
    t0 = time.perf_counter()
    path = os.path.join(out, f"rank{rank}.pt")
    torch.save(state, path)
    fsync_tree(out) if rank == 0 else None
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    dist.barrier()
    t_save = time.perf_counter() - t0

    t_dcp = None
    try:
        try:
            import torch.distributed.checkpoint as dcp
        except ImportError:  # 1.13 ships it as a prototype under _shard
            import torch.distributed._shard.checkpoint as dcp
        dcp_dir = os.path.join(args.dir, "dcp")
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save_state_dict(state_dict=state, storage_writer=dcp.FileSystemWriter(dcp_dir))
        if rank == 0:
            fsync_tree(dcp_dir)
        dist.barrier()
        t_dcp = time.perf_counter() - t0
    except Exception as e:  # DCP is a prototype in 1.13; report rather than fail
        if rank == 0:
            print(f"# DCP unavailable: {e}", flush=True)
    if rank == 0:
        results.put(("torch.save per rank", t_save, nbytes / t_save / 1e9))
        if t_dcp:
            results.put(("torch.distributed.checkpoint", t_dcp, nbytes / t_dcp / 1e9))
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
    init_file = os.path.join(args.dir, "init")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args.ranks, args, init_file, results)) for r in range(args.ranks)]
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
