# A Python worker for tests/launcher/test_agent_preload.sh, run with and without --preload=torch:
# writes what a preloaded worker must share with a freshly started one to
# $TEST_WORKER_OUT_DIR/preload.<run>.rank<RANK>.gen<GENERATION>.json, then all-reduces over gloo.
# PRELOAD_TEST_MODE: exit7 -> rank 0 exits 7; raise -> rank 0 raises ValueError("boom on purpose");
# crash_once -> rank 1 exits 3 on the first attempt; crash_late -> the same after 3.5 s (the
# preloader has forked its spares by then); sleep -> sleeps 120 s after writing; sleep_twice ->
# the same in the first two attempts only.
import json
import os
import random
import signal
import sys

import preload_helper  # from the script's own directory
import torch
import torch.distributed as dist

if __name__ != "__main__":
    raise SystemExit("not run as __main__")

out = os.environ["TEST_WORKER_OUT_DIR"]
mode = os.environ.get("PRELOAD_TEST_MODE", "")
rank = int(os.environ["RANK"])
os.makedirs(f"{out}/pids", exist_ok=True)
open(f"{out}/pids/{os.getpid()}", "w").close()
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
try:
    import numpy
    numpy_draw = float(numpy.random.random())
except ImportError:
    numpy_draw = None
record = {
    "env": {k: os.environ.get(k) for k in keys},
    "env_keys": sorted(k for k in os.environ if not k.startswith("ELASTRUN_PRELOAD")),
    "argv": sys.argv,
    "path0": sys.path[0],
    "helper": preload_helper.ANSWER,
    "torch_threads": torch.get_num_threads(),
    # the preloader's faster wait for rank 0's c10d store (docs/launcher.md, "Preloaded workers")
    "store_waits": bool(getattr(sys.modules["torch.distributed.rendezvous"]._create_c10d_store, "_elastrun_awaits_listener", False)),
    "torch_seed": torch.initial_seed(),
    "torch_draw": float(torch.rand(1)),
    "random_draw": random.random(),
    "numpy_draw": numpy_draw,
    "pid": os.getpid(),
    "pgid": os.getpgid(0),
    "ppid": os.getppid(),
    # signals blocked at start (a fresh interpreter has none: an inherited mask keeps SIGTERM away)
    "sig_blocked": [l.split()[1] for l in open("/proc/self/status") if l.startswith("SigBlk:")][0],
    "sig_handlers": {s.name: str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1,
                                                               signal.SIGUSR2, signal.SIGHUP, signal.SIGPIPE)},
    # how long this process has existed: a worker the preloader forked on the order is ~0 s old,
    # one it handed to a spare forked earlier is older
    "age_s": float(open("/proc/uptime").read().split()[0])
    - int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK"),
}
run = os.environ.get("PRELOAD_TEST_RUN", "run")
gen = os.environ.get("ELASTRUN_GENERATION", "0")
with open(f"{out}/preload.{run}.rank{rank}.gen{gen}.json", "w") as f:
    json.dump(record, f)
if mode == "exit7" and rank == 0:
    sys.exit(7)
if mode == "raise" and rank == 0:
    raise ValueError("boom on purpose")
if mode in ("crash_once", "crash_late") and rank == 1 and not os.path.exists(f"{out}/crashed"):
    if mode == "crash_late":
        import time
        time.sleep(3.5)
    open(f"{out}/crashed", "w").close()
    sys.exit(3)
if mode == "sleep" or (mode == "sleep_twice" and os.environ["TORCHELASTIC_RESTART_COUNT"] in ("0", "1")):
    import time
    time.sleep(120)
dist.init_process_group("gloo")
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
assert int(t.item()) == sum(range(1, dist.get_world_size() + 1)), t
dist.destroy_process_group()
print(f"rank {rank}: all-reduce ok", flush=True)
