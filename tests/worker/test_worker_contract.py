"""The worker contract, Python side: the golden vectors (tests/worker/golden/, also read by
test_golden.cpp), the event reader's schema check, and the timeline built from a real file."""
import json
import os
import subprocess
import sys

import pytest

import elastrun.control as control
import elastrun.events as ev
from elastrun import _contract

GOLDEN = os.environ.get("ELASTRUN_GOLDEN_DIR") or os.path.join(os.path.dirname(__file__), "golden")


def cases(name):
    with open(os.path.join(GOLDEN, name), encoding="utf-8") as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("case", cases("events.json"), ids=lambda c: c["event"])
def test_event_line_is_the_golden_one(case):
    assert ev.event_line(case["time"], case["node"], case["run_id"], case["event"], case["rank"],
                         case["fields"]) == case["line"]


@pytest.mark.parametrize("case", cases("control.json"), ids=lambda c: repr(c["text"]))
def test_control_line_parses_as_golden(case):
    status = control.parse(case["text"])
    if case["request"] is None:
        assert status is None
    else:
        assert status == control.Status(case["request"], case["sequence"])


@pytest.mark.parametrize("case", cases("progress.json"), ids=lambda c: str(c["step"]))
def test_progress_record_is_the_golden_one(case, tmp_path, monkeypatch):
    path = tmp_path / "progress"
    monkeypatch.setenv(_contract.ENV_PROGRESS_FILE, str(path))
    monkeypatch.delenv(_contract.ENV_STACKS_FILE, raising=False)
    monkeypatch.setattr(control, "_progress_fd", None)
    control.progress(case["step"])
    assert path.read_text() == case["record"]
    assert len(case["record"]) == _contract.PROGRESS_RECORD_SIZE
    control.progress()  # without a step: the record stays
    assert path.read_text() == case["record"]


def test_progress_with_compute_time_is_the_golden_file(tmp_path, monkeypatch):
    with open(os.path.join(GOLDEN, "progress_compute.json"), encoding="utf-8") as f:
        golden = json.load(f)
    path = tmp_path / "progress"
    monkeypatch.setenv(_contract.ENV_PROGRESS_FILE, str(path))
    monkeypatch.delenv(_contract.ENV_STACKS_FILE, raising=False)
    monkeypatch.setattr(control, "_progress_fd", None)
    monkeypatch.setattr(control, "_compute_us", 0)
    for step, compute_s in golden["calls"][:-1]:
        control.progress(step, compute_s)
    # the last one through the context manager's pending time, as a training loop reports it
    step, compute_s = golden["calls"][-1]
    monkeypatch.setattr(control, "_pending_compute_s", compute_s)
    control.progress(step)
    assert path.read_text() == golden["file"]
    assert len(golden["file"]) == _contract.COMPUTE_RECORD_OFFSET + _contract.COMPUTE_RECORD_SIZE
    with control.compute(synchronize=False):
        pass
    assert control._pending_compute_s is not None and control._pending_compute_s >= 0
    control.progress(step + 1)
    assert control._pending_compute_s is None, "reported with the step"


def test_writer_and_reader_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "events-n1.jsonl"
    monkeypatch.setenv(_contract.ENV_EVENTS_FILE, str(path))
    monkeypatch.setenv(_contract.ENV_NODE, "n1")
    monkeypatch.setenv(_contract.ENV_RUN_ID, "9.r0")
    w = ev.Writer.from_environment(rank=0)
    w.write(_contract.EVENT_STEP, step=1, loss=float("nan"), world_size=2)
    w.write(_contract.EVENT_TRAIN_DONE, step=1, loss=0.5, world_size=2)
    w.close()
    events = ev.read([str(tmp_path)])  # a directory: every events*.jsonl under it
    assert [e["event"] for e in events] == ["step", "train_done"]
    assert all(e["v"] == ev.SCHEMA_VERSION and e["rank"] == 0 and e["node"] == "n1" for e in events)
    assert events[0]["loss"] is None  # NaN is not JSON


def test_reader_refuses_a_newer_schema_and_skips_torn_lines(tmp_path):
    path = tmp_path / "events-n2.jsonl"
    path.write_text('{"v":1,"time":1.0,"node":"n2","run_id":"r","event":"state","state":"MONITOR"}\n'
                    '{"v":1,"time":2.0,"node":"n2","run_id":"r","ev\n')
    warnings = []
    assert len(ev.read([str(path)], warn=warnings.append)) == 1
    assert "not a JSON line" in warnings[0] and ":2:" in warnings[0]
    path.write_text('{"v":2,"time":1.0,"node":"n2","run_id":"r","event":"state"}\n')
    with pytest.raises(ev.EventError, match=r"events-n2.jsonl:1: event schema v2"):
        ev.read([str(path)])


def test_timeline_command_prints_rounds_losses_and_the_end(tmp_path):
    lines = [ev.event_line(10.0, "n1", "5.r0", "round", None, {"generation": 1, "world_size": 8, "members": ["n1", "n2"],
                                                                 "formation_ms": 3}),
             ev.event_line(12.0, "n1", "5.r0", "member_lost", None, {"member": "n2", "how": "holder disconnected"}),
             ev.event_line(12.5, "n1", "5.r0", "round", None, {"generation": 2, "world_size": 4, "members": ["n1"],
                                                                 "formation_ms": 1}),
             ev.event_line(20.0, "n1", "5.r0", "exit", None, {"code": 0})]
    (tmp_path / "events-n1.jsonl").write_text("\n".join(lines) + "\n")
    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "elastrun-timeline")
    out = subprocess.run([sys.executable, tool, str(tmp_path)], capture_output=True, text=True, check=True).stdout
    assert "round 1 of run 5.r0: world size 8" in out
    assert "node n2 lost (holder disconnected)" in out
    assert "re-formed 500 ms after the loss was seen" in out
    assert "1 of 1 agent runs exited 0" in out
    bad = subprocess.run([sys.executable, tool, str(tmp_path / "none.jsonl")], capture_output=True, text=True)
    assert bad.returncode == 1 and "cannot read" in bad.stderr


def test_control_names_are_the_contract():
    assert control.CHECKPOINTED_EXIT_CODE == _contract.CHECKPOINTED_EXIT_CODE == 85
    assert (control.NONE, control.CHECKPOINT, control.CHECKPOINT_AND_STOP) == _contract.CONTROL_REQUESTS
    assert control.CONTROL_FILE_ENV == "ELASTRUN_CONTROL_FILE"
