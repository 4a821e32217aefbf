# A plain torch.distributed program, as users write it for torchrun: env:// rendezvous (or the
# tcp:// init method named by GLOO_TEST_INIT_METHOD), gloo, one all-reduce. Run unmodified by tests/launcher/test_torch_gloo.sh under elastrun.
import os

import torch
import torch.distributed as dist

init_method = os.environ.get("GLOO_TEST_INIT_METHOD")  # test knob: e.g. tcp://localhost:PORT
if init_method:
    dist.init_process_group("gloo", init_method=init_method, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
else:
    dist.init_process_group("gloo")  # env:// : MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
rank, world = dist.get_rank(), dist.get_world_size()
# test knob: rank 1 dies on the first attempt while rank 0 waits in the all-reduce
marker = os.environ.get("GLOO_TEST_CRASH_ONCE")
if marker and rank == 1 and not os.path.exists(marker):
    open(marker, "w").close()
    print("rank 1 crashing on purpose", flush=True)
    os._exit(9)
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
assert t.item() == expected, (t.item(), expected)
print(f"allreduce ok rank {rank} of {world}: {t.item()} restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
dist.barrier()
dist.destroy_process_group()
