"""Shared helpers of the Python package tests (pytest, run by ctest as python.*).

run_world(n, scenario, *args) starts n real processes of ranks.py (RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT set as a launcher would), waits for all of them with a bound, and reaps every one by
PID whatever happens. The package comes from $PYTHONPATH (ctest: build/python).
"""

import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = "/usr/bin/python3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world, scenario, *args, timeout=180, env=None, expect_rc=0):
    """Runs ranks.py SCENARIO ARGS... as `world` ranks; returns their outputs (rank order)."""
    port = free_port()
    procs = []
    try:
        for rank in range(world):
            rank_env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                            LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                            OMP_NUM_THREADS="1")
            rank_env.update(env or {})
            procs.append(subprocess.Popen([PYTHON, os.path.join(HERE, "ranks.py"), scenario, *map(str, args)],
                                          env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{scenario}: rank {rank} of {world} still running after {timeout} s")
            outputs.append(out)
        for rank, (proc, out) in enumerate(zip(procs, outputs)):
            if expect_rc is not None and proc.returncode != expect_rc:
                pytest.fail(f"{scenario}: rank {rank} of {world} exited {proc.returncode} (expected {expect_rc}):\n"
                            + "\n".join(f"--- rank {r}:\n{o}" for r, o in enumerate(outputs)))
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


@pytest.fixture
def world():
    return run_world
