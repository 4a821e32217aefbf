"""A worker for tests/launcher/test_agent_memory.sh: snapshots into the memory tier of its agent
(elastrun.memory) and reads them back after a restart. Records its pid in $TEST_WORKER_OUT_DIR/pids.

    MEMORY_WORKER_MODE=crash   attempt 0: steps 1..3 put, then rank 1 exits 3; attempt 1: each rank
                               gets its newest snapshot back and writes out/restored.<rank>.json
    MEMORY_WORKER_MODE=hold    puts one 32 MiB snapshot of step 424242, writes out/held.<rank>, sleeps
"""
import json
import os
import sys
import time
import zlib

from elastrun import memory

out = os.environ["TEST_WORKER_OUT_DIR"]
os.makedirs(f"{out}/pids", exist_ok=True)
open(f"{out}/pids/{os.getpid()}", "w").close()
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
tier = memory.MemoryTier()
if not tier.enabled:
    sys.exit(f"[rank {rank}] the memory tier is off: ELASTRUN_MEMORY_CHECKPOINTS missing")


def payload(step):
    return bytes([(rank * 10 + step) % 256]) * 100_000 + f"rank {rank} step {step}".encode()


mode = os.environ.get("MEMORY_WORKER_MODE", "crash")
if mode == "hold":
    tier.put(424242, rank, bytes(32 << 20), checksum=1)
    open(f"{out}/held.{rank}", "w").close()
    time.sleep(120)
    sys.exit(0)
if attempt == 0:
    for step in (1, 2, 3):
        data = payload(step)
        tier.put(step, rank, data, checksum=zlib.crc32(data))
    open(f"{out}/put.{rank}", "w").close()
    if rank == 1:
        # a crash after step 3's snapshot -- of both ranks: rank 0, stopped by the agent when this
        # one fails, may not have put its snapshots yet on a loaded machine
        while not os.path.exists(f"{out}/put.0"):
            time.sleep(0.02)
        sys.exit(3)
    time.sleep(60)  # stopped by the agent when rank 1 fails
    sys.exit(0)
got = tier.get(rank)
if got is None:
    sys.exit(f"[rank {rank}] no snapshot in the agent's memory after the restart")
step, data, checksum = got
result = {"step": step, "intact": data == payload(step) and checksum == zlib.crc32(data),
          "older": tier.get(rank, step=2) is not None, "list": tier.list()}
with open(f"{out}/restored.{rank}.json.tmp", "w") as f:
    json.dump(result, f)
if rank == 0:
    # once both ranks have read theirs: "training resumes at step 2" drops step 3 of both ranks
    while not os.path.exists(f"{out}/restored.1.json"):
        time.sleep(0.05)
    result["forgot_after_2"] = tier.forget_after(2)
    result["steps_left"] = sorted({s["step"] for s in tier.list()["segments"]})
    with open(f"{out}/restored.0.json.tmp", "w") as f:
        json.dump(result, f)
os.rename(f"{out}/restored.{rank}.json.tmp", f"{out}/restored.{rank}.json")
