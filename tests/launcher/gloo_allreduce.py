# A plain torch.distributed program, as users write it for torchrun: env:// rendezvous (or the
# tcp:// init method named by GLOO_TEST_INIT_METHOD), gloo, one all-reduce. Run unmodified by tests/launcher/test_torch_gloo.sh under elastrun.
import os
import time

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
# test knob (elastrun --hang-timeout): rank 1 stops progressing on the first attempt, so rank 0
# waits in the all-reduce; both reported progress once (elastrun_control on PYTHONPATH)
hang = os.environ.get("GLOO_TEST_HANG_ONCE")
if hang:
    import elastrun_control
    elastrun_control.progress()
    if rank == 1 and not os.path.exists(hang):
        open(hang, "w").close()
        print("rank 1 hanging on purpose", flush=True)
        time.sleep(600)
# test knob (torch's FileTimer, TORCHELASTIC_ENABLE_FILE_TIMER=1): rank 1 overruns a 2 s timer
timer_hang = os.environ.get("GLOO_TEST_TIMER_HANG_ONCE")
if timer_hang:
    from torch.distributed.elastic import timer
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    if rank == 1 and not os.path.exists(timer_hang):
        open(timer_hang, "w").close()
        with timer.expires(after=2, scope="stuck_step"):
            time.sleep(600)
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
assert t.item() == expected, (t.item(), expected)
print(f"allreduce ok rank {rank} of {world}: {t.item()} restart {os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
dist.barrier()
dist.destroy_process_group()
