# For test_torchrun_lines.sh: prints the torch launcher variables as one JSON line (no torch
# import: the launch lines are compared, not torch); rank 1 exits $TR_EXIT_RANK1 (default 0).
import json
import os
import sys

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"]
print("TRLINE " + json.dumps({k: os.environ.get(k) for k in KEYS}, sort_keys=True), flush=True)
sys.exit(int(os.environ.get("TR_EXIT_RANK1", "0")) if os.environ.get("RANK") == "1" else 0)
