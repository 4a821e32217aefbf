#!/usr/bin/python3
"""The job CLI tests' worker: says hello with its rank, then waits (0.2 s ticks, argv[1] of them,
default 600) and exits 0 -- or, asked to checkpoint and stop (elastrun_control), says so and exits
with the checkpointed code. No torch: it starts in milliseconds."""
import os
import sys
import time

import elastrun_control as ec

ec.install_signal_handlers()
rank = int(os.environ["RANK"])
print(f"hello from rank {rank} of {os.environ['WORLD_SIZE']}", flush=True)
print(f"a line on stderr from rank {rank}", file=sys.stderr, flush=True)
for tick in range(int(sys.argv[1]) if len(sys.argv) > 1 else 600):
    if ec.poll().stop:
        print(f"rank {rank} checkpointed at tick {tick}", flush=True)
        sys.exit(ec.CHECKPOINTED_EXIT_CODE)
    time.sleep(0.2)
print(f"rank {rank} done", flush=True)
