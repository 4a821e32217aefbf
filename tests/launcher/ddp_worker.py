# A plain PyTorch DDP training script, as users write it for torchrun: env:// rendezvous, gloo,
# DistributedDataParallel, @record for the error file. Run unmodified by
# tests/launcher/test_ddp_slurm.sh under `srun elastrun --nproc-per-node=2`.
# Usage: ddp_worker.py OUT_DIR [STEPS]
#   writes OUT_DIR/ddp.rank<RANK>.json: world size, first/last global loss, parameter digest
# Test knobs: DDP_TEST_FAIL_ONCE=FILE -> rank 3 raises once (creates FILE) after the first step;
# DDP_TEST_STEP_SLEEP=SECONDS -> each step lasts that much longer (time to kill a node mid-run);
# rank 0 writes OUT_DIR/trained.w<WORLD_SIZE> after the first step of each attempt.
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP


@record
def main():
    out_dir = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(100 + rank)  # different initial weights per rank: DDP broadcasts rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)  # each rank its own shard of the data
    w_true = torch.linspace(-1.0, 1.0, 8)
    losses = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=data)
        y = (x @ w_true).unsqueeze(1)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # gradients all-reduced across every rank
        opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        if step == 0 and rank == 0:
            open(os.path.join(out_dir, f"trained.w{world}"), "w").close()
        time.sleep(float(os.environ.get("DDP_TEST_STEP_SLEEP", "0")))
        marker = os.environ.get("DDP_TEST_FAIL_ONCE")
        if marker and rank == 3 and step == 0 and not os.path.exists(marker):
            open(marker, "w").close()
            raise RuntimeError("ddp test failure on purpose")
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, flat) for g in gathered)
    with open(os.path.join(out_dir, f"ddp.rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world_size": world, "first_loss": losses[0], "last_loss": losses[-1],
                   "digest": digest, "all_equal": same, "node": os.environ.get("ELASTRUN_NODE"),
                   "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}, f)
    print(f"rank {rank}/{world}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, params {digest[:12]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
