# For test_torchrun_lines.sh: prints the torch launcher variables as one JSON line (no torch
# import: the launch lines are compared, not torch); rank 1 exits $TR_EXIT_RANK1 (default 0).
# With TR_SYNC_DIR set, rank 1 exits only once rank 0 has printed its line: a launcher stops the
# other workers as soon as one fails, and rank 0's line must not depend on who starts faster.
import json
import os
import sys
import time

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "NCCL_ASYNC_ERROR_HANDLING"]
print("TRLINE " + json.dumps({k: os.environ.get(k) for k in KEYS}, sort_keys=True), flush=True)
sync_dir = os.environ.get("TR_SYNC_DIR")
if sync_dir:
    printed = os.path.join(sync_dir, "%s.rank0" % os.environ.get("TORCHELASTIC_RUN_ID"))
    if os.environ.get("RANK") == "0":
        open(printed, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(printed) and time.monotonic() < deadline:
            time.sleep(0.05)
sys.exit(int(os.environ.get("TR_EXIT_RANK1", "0")) if os.environ.get("RANK") == "1" else 0)
