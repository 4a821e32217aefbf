#!/usr/bin/python3
"""memory_bench: the memory checkpoint tier (elastrun --memory-checkpoints, elastrun.checkpoint
tier="memory") against the anchors issue #27 names, measured in the same run. Never asserts.

    /usr/bin/python3 bench/memory_bench.py --elastrun build/bin/elastrun --json out.json
        [--nprocs 4] [--mib-per-rank 256] [--reps 5] [--train-mib 64] [--train-steps 8]

One standalone agent with --memory-checkpoints and NPROCS workers (gloo); every rank holds
MIB_PER_RANK of float32 tensors (16 of them). Per repetition, all ranks at once (a barrier before
each measurement; the figure is the slowest rank's, since a step waits for it):
  (a) training blocked by AsyncSaver.save(state, step, tier="memory") -- the copy into the agent's
      segment; its thread hashes and commits it after -- and by save(..., tier="memory") (copy and
      hash in one pass, committed on return), in the steady state of a snapshot per step (each
      into the pages of the segment retention dropped), vs a memcpy of the same tensors into
      buffers allocated and touched before (the issue's anchor), and vs a memcpy into fresh memory
      (what every snapshot would cost if the agent did not reuse segments: a fault and zeroing
      per page);
  (b) load() from the agent's memory (two votes, the hash check, the copy into the state_dict)
      vs the same memcpy;
  (c) a CPU-bound loop (matrix products, ~1 s per step, a barrier per step) with an AsyncSaver
      memory snapshot of TRAIN_MIB per rank after every step vs the same loop without snapshots,
      in alternating blocks: the slowdown.
Replication to a partner node is not built yet: nothing of it is measured here.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PY = "/usr/bin/python3"
TENSORS = 16


def worker(args):
    import torch
    import torch.distributed as dist

    import elastrun.checkpoint as ec

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(args.out, "ckpt")
    os.makedirs(ckpt, exist_ok=True)

    def state_of(mib):
        n = (mib << 20) // 4 // TENSORS
        g = torch.Generator().manual_seed(rank)
        return {"model": {f"w{i}": torch.rand(n, generator=g) for i in range(TENSORS)}}

    def timed(fn):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        mine = time.perf_counter() - t0
        out = [None] * world
        dist.all_gather_object(out, mine)
        return max(out)

    result = {"nprocs": world, "mib_per_rank": args.mib_per_rank, "train_mib": args.train_mib}
    if not ec.memory_available():
        result["error"] = "the agent keeps no memory checkpoints"
    else:
        state = state_of(args.mib_per_rank)
        tensors = list(state["model"].values())
        warm = [torch.empty_like(t) for t in tensors]
        for d, t in zip(warm, tensors):
            d.copy_(t)  # touched: its pages exist

        def memcpy_warm():
            for d, t in zip(warm, tensors):
                d.copy_(t)

        def memcpy_fresh():
            fresh = [torch.empty_like(t) for t in tensors]
            for d, t in zip(fresh, tensors):
                d.copy_(t)

        step = [0]
        saver = ec.AsyncSaver(ckpt)

        def snapshot():
            step[0] += 1
            ec.save(state, ckpt, step[0], tier="memory")

        def snapshot_async():
            step[0] += 1
            saver.save(state, step[0], tier="memory")

        rows = {"memcpy_warm_s": [], "memcpy_fresh_s": [], "snapshot_s": [], "snapshot_async_s": [],
                "commit_after_s": [], "restore_s": []}
        for _ in range(3):  # not timed: the job's first snapshots write fresh pages; from the third on,
            snapshot()      # each reuses the segment retention dropped (the steady state of a snapshot per step)
        for _ in range(args.reps):
            rows["memcpy_warm_s"].append(timed(memcpy_warm))
            rows["memcpy_fresh_s"].append(timed(memcpy_fresh))
            rows["snapshot_s"].append(timed(snapshot))
            rows["snapshot_async_s"].append(timed(snapshot_async))
            rows["commit_after_s"].append(timed(saver.wait))
        into = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
        for _ in range(args.reps):
            info = [None]

            def restore():
                info[0] = ec.load(into, ckpt)

            rows["restore_s"].append(timed(restore))
            if info[0] is None or info[0].source != "memory-local":
                result["error"] = f"load() did not restore from memory: {info[0]}"
        if not all(torch.equal(into["model"][k], state["model"][k]) for k in state["model"]):
            result["error"] = "the restored tensors differ from the saved ones"
        result.update(rows)
        del state, tensors, warm, into

        # (c) the training loop's slowdown
        train = state_of(args.train_mib)
        a = torch.rand(args.matrix, args.matrix)
        b = torch.rand(args.matrix, args.matrix)
        products = [1]

        def compute():
            for _ in range(products[0]):
                torch.mm(a, b)

        # calibrate: products per step so that a step (on this machine, all ranks running) is ~1 s
        t = timed(compute)
        products[0] = max(1, int(args.step_s / max(t, 1e-6)))
        steps = {"plain": [], "snapshot": []}
        for block in range(4):
            kind = "plain" if block % 2 == 0 else "snapshot"
            for _ in range(args.train_steps // 2):
                def one_step():
                    compute()
                    if kind == "snapshot":  # AsyncSaver: the commit overlaps the next step's compute
                        step[0] += 1
                        saver.save(train, step[0], tier="memory")
                steps[kind].append(timed(one_step))
        result["train_step_plain_s"] = steps["plain"]
        result["train_step_snapshot_s"] = steps["snapshot"]
        result["train_products_per_step"] = products[0]
        saver.close()
    if rank == 0:
        with open(os.path.join(args.out, "result.json.tmp"), "w") as f:
            json.dump(result, f)
        os.replace(os.path.join(args.out, "result.json.tmp"), os.path.join(args.out, "result.json"))
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elastrun", default=os.path.join(HERE, "..", "build", "bin", "elastrun"))
    p.add_argument("--json", help="write the raw numbers here")
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--mib-per-rank", type=int, default=256)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--train-mib", type=int, default=64)
    p.add_argument("--train-steps", type=int, default=16, help="steps per kind (two blocks each)")
    p.add_argument("--step-s", type=float, default=1.0, help="compute per training step")
    p.add_argument("--matrix", type=int, default=256)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    build_python = os.path.join(os.path.dirname(os.path.abspath(args.elastrun)), "..", "python")
    segments = args.nprocs * (3 * args.mib_per_rank + 16) << 20  # two kept + one being written, per rank
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as out:
        env = dict(os.environ, ELASTRUN_PYTHON=TORCH_PY, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.path.abspath(build_python))
        argv = [args.elastrun, "--standalone", f"--nproc-per-node={args.nprocs}", f"--memory-checkpoints={segments}",
                os.path.abspath(__file__), "--worker", "--out", out, "--mib-per-rank", str(args.mib_per_rank),
                "--reps", str(args.reps), "--train-mib", str(args.train_mib), "--train-steps", str(args.train_steps),
                "--step-s", str(args.step_s), "--matrix", str(args.matrix)]
        print(f"[memory_bench] {args.nprocs} ranks x {args.mib_per_rank} MiB, {args.reps} reps", file=sys.stderr,
              flush=True)
        r = subprocess.run(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
        path = os.path.join(out, "result.json")
        if r.returncode != 0 or not os.path.exists(path):
            print(r.stdout[-3000:], file=sys.stderr)
            print(f"[memory_bench] the agent exited {r.returncode}", file=sys.stderr)
            return 1
        with open(path) as f:
            result = json.load(f)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")
    if "error" in result:
        print(f"[memory_bench] error: {result['error']}", file=sys.stderr)
    else:
        print(f"snapshot blocked {med(result['snapshot_async_s']):.4f} s (AsyncSaver; commit after "
              f"{med(result['commit_after_s']):.4f} s), {med(result['snapshot_s']):.4f} s (save); memcpy warm {med(result['memcpy_warm_s']):.4f} s, "
              f"fresh {med(result['memcpy_fresh_s']):.4f} s; restore {med(result['restore_s']):.4f} s; "
              f"train step {med(result['train_step_plain_s']):.3f} s plain, "
              f"{med(result['train_step_snapshot_s']):.3f} s with a snapshot")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
