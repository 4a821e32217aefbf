#!/usr/bin/python3
"""One task of `srun --torch-env`: prints its torch variables (and Slurm's view) as one JSON line;
with --allreduce also runs a gloo all_reduce over env:// (torch from Debian's python3-torch)."""
import json
import os
import sys

NAMES = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
         "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
         "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT", "PMIX_RANK"]
out = {n: os.environ.get(n) for n in NAMES}
if "--allreduce" in sys.argv:
    import datetime
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=60))
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    out["allreduce"] = t.item()
    out["dist_rank"] = dist.get_rank()
    out["dist_world"] = dist.get_world_size()
    dist.destroy_process_group()
print(json.dumps(out), flush=True)
