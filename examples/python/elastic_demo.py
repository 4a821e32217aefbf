#!/usr/bin/python3
"""A tiny elastic trainer for the demo: an unmodified-style PyTorch gloo script.

Every step all-reduces a tensor across all workers (the "gradient"), rank 0 checkpoints the
step counter to CKPT_DIR, and a restarted group resumes from the last checkpoint with whatever
WORLD_SIZE the agents re-formed. Run under elastrun, which sets RANK/WORLD_SIZE/MASTER_*.
Usage: elastic_demo.py CKPT_DIR [STEPS] [SECONDS_PER_STEP]"""
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main():
    ckpt_dir = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    dist.init_process_group("gloo")  # env://: everything comes from elastrun
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    state_file = os.path.join(ckpt_dir, "state.json")
    start = 0
    if os.path.exists(state_file):
        with open(state_file) as f:
            start = json.load(f)["step"]
    if rank == 0:
        print(f"[demo] world size {world}, restart {restart}, generation "
              f"{os.environ.get('ELASTRUN_GENERATION')}, resuming at step {start}", flush=True)
    for step in range(start, steps):
        grad = torch.ones(1024) * (rank + 1)
        dist.all_reduce(grad)  # blocks if a peer is gone: elastrun stops and re-forms us
        expected = world * (world + 1) / 2
        assert abs(grad[0].item() - expected) < 1e-3, (grad[0].item(), expected)
        if rank == 0:
            tmp = state_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"step": step + 1, "world_size": world}, f)
            os.replace(tmp, state_file)  # atomic: a crash never leaves a half-written state
            print(f"[demo] step {step + 1}/{steps} done on {world} workers", flush=True)
        time.sleep(pause)
    dist.barrier()
    if rank == 0:
        print(f"[demo] training finished: {steps} steps, final world size {world}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
