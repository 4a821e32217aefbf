"""The Python control-channel helper (worker/python/elastrun_control.py).

  test_control_python.py unit      format, change detection, .seen marker, signal handlers
  test_control_python.py worker    a worker for the agent: polls until checkpoint-and-stop, writes
                                   $TEST_WORKER_OUT_DIR/checkpoint.rank<RANK>.json, exits 85
                                   (gives up after 120 s with exit 0)
  test_control_python.py torch     the same as a gloo training loop: one all-reduce per step, then
                                   poll_all(); the marker records the step (equal on every rank)
Needs elastrun_control on PYTHONPATH.
"""

import json
import os
import signal
import sys
import tempfile
import time

import elastrun_control as ec


def unit():
    assert ec.CHECKPOINTED_EXIT_CODE == 85
    assert ec.parse("3 checkpoint-and-stop\n") == ec.Status(ec.CHECKPOINT_AND_STOP, 3)
    assert ec.parse("0 none") == ec.Status(ec.NONE, 0)
    for bad in ("", "checkpoint", "x none", "1 stop", "1 none extra"):
        assert ec.parse(bad) is None, bad
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "control")
        ch = ec.Channel(path)
        assert ch.enabled and ch.poll() == ec.Status()
        assert os.path.exists(path + ec.SEEN_SUFFIX), "first poll() must leave the .seen marker"
        ec.write_file(path, ec.Status(ec.CHECKPOINT, 1))
        s = ch.poll()
        assert s.checkpoint and not s.stop and s.sequence == 1, s
        assert ch.poll() == s
        with open(path, "w") as f:
            f.write("not a request\n")
        assert ch.poll() == s, "a malformed file keeps the last state"
        os.remove(path)
        assert ch.poll() == s, "a missing file keeps the last state"
        ec.write_file(path, ec.Status(ec.CHECKPOINT_AND_STOP, 2))
        assert ch.poll().stop and ch.poll().sequence == 2
        assert sorted(os.listdir(d)) == ["control", "control.seen"], os.listdir(d)
        # the process-wide poll() reads $ELASTRUN_CONTROL_FILE
        os.environ[ec.CONTROL_FILE_ENV] = path
        os.environ[ec.CHECKPOINT_DIR_ENV] = "/ckpt"
        assert ec.poll().stop and ec.checkpoint_dir() == "/ckpt"
        assert ec.poll_all().stop  # no torch.distributed: same as poll()
    assert not ec.Channel("").enabled
    ec.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
    assert ec.signal_received() == signal.SIGUSR1
    print("ok: elastrun_control unit")


def worker(use_torch=False):
    ec.install_signal_handlers()
    out = os.environ.get("TEST_WORKER_OUT_DIR", "")
    rank = os.environ.get("RANK", "0")
    if use_torch:
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo")
    if out:
        os.makedirs(os.path.join(out, "pids"), exist_ok=True)
        open(os.path.join(out, "pids", str(os.getpid())), "w").close()
        open(os.path.join(out, f"started.rank{rank}"), "w").close()
    deadline = time.monotonic() + 120
    step = 0
    while time.monotonic() < deadline:
        if use_torch:
            t = torch.ones(4)
            dist.all_reduce(t)
        step += 1
        status = ec.poll_all()
        if step == 2 and out:  # polled twice (handlers installed long before): tests may signal now
            open(os.path.join(out, f"polling.rank{rank}"), "w").close()
        if status.stop:
            record = {"rank": rank, "request": status.request, "sequence": status.sequence,
                      "signal": ec.signal_received(), "python": True, "step": step}
            if out:
                with open(os.path.join(out, f"checkpoint.rank{rank}.json"), "w") as f:
                    json.dump(record, f)
            print("checkpointed:", json.dumps(record), flush=True)
            sys.exit(ec.CHECKPOINTED_EXIT_CODE)
        time.sleep(0.02)
    sys.exit(0)


if __name__ == "__main__":
    {"unit": unit, "worker": worker, "torch": lambda: worker(use_torch=True)}[sys.argv[1]]()
