"""elastrun.events: the event logs of an elastrun job, schema v1 (docs/events.md).

    import elastrun.events as ev
    w = ev.Writer.from_environment(rank)          # a worker's writer ($ELASTRUN_EVENTS_FILE); off without it
    w.write("step", step=10, loss=0.5, world_size=8)
    events = ev.read(["job-dir/"])               # every events*.jsonl under it, sorted by time
    for t, text in ev.timeline(events).lines: ...

The line format and the names are the worker contract's (worker/contract.json, shared with the
agent and C++ training code: <elastrun/worker/events.hpp>). ``python3 -m elastrun.events`` (and
tools/elastrun-timeline) prints a job's timeline and, with --png, plots it. Standard library only
(matplotlib for the plot).
"""
import argparse
import json
import math
import os
import socket
import sys
import time
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Union

from elastrun import _contract as _c

__all__ = ["SCHEMA_VERSION", "EventError", "event_line", "Writer", "read", "Timeline", "timeline", "plot", "main"]

SCHEMA_VERSION = _c.EVENTS_SCHEMA_VERSION
_MAX_LINE = 4096  # one write(2) on an O_APPEND file; our events are far smaller


class EventError(ValueError):
    """A line this reader must not interpret (a newer schema)."""


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def event_line(unix_seconds: float, node: str, run_id: str, event: str, rank: Optional[int] = None,
               fields: Optional[Dict[str, Any]] = None) -> str:
    """One line, without its newline: the same bytes as C++ elastrun::worker::event_line
    (tests/worker/golden/events.json). Fields that repeat a common one are ignored; NaN and
    infinities become null (JSON has none)."""
    line: Dict[str, Any] = {"v": SCHEMA_VERSION, "time": round(unix_seconds * 1000.0) / 1000.0, "node": node,
                            "run_id": run_id, "event": event}
    if rank is not None:
        line["rank"] = rank
    for key, value in (fields or {}).items():
        if key not in line:
            line[key] = _finite(value)
    return json.dumps(line, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=str)


class Writer:
    """Appends events to one file (opened O_APPEND; each line in one write, so lines of several
    processes never interleave on a local filesystem)."""

    def __init__(self, path: Optional[str], node: str = "", run_id: str = "", rank: Optional[int] = None) -> None:
        self.path, self.node, self.run_id, self.rank = path, node, run_id, rank
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644) if path else None

    @classmethod
    def from_environment(cls, rank: Optional[int] = None) -> "Writer":
        """A worker's writer: $ELASTRUN_EVENTS_FILE, $ELASTRUN_NODE and $TORCHELASTIC_RUN_ID from the
        agent; off (write() does nothing) when the agent keeps no event log."""
        return cls(os.environ.get(_c.ENV_EVENTS_FILE) or None,
                   os.environ.get(_c.ENV_NODE) or socket.gethostname(), os.environ.get(_c.ENV_RUN_ID, ""), rank)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def write(self, event: str, **fields: Any) -> None:
        if self._fd is None:
            return
        text = event_line(time.time(), self.node, self.run_id, event, self.rank, fields) + "\n"
        data = text.encode()
        if len(data) < _MAX_LINE:
            os.write(self._fd, data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _files(paths: Iterable[str]) -> List[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names
                           if f.startswith("events") and f.endswith(".jsonl"))
            if not found:
                raise FileNotFoundError(f"no events*.jsonl under {path}")
            files += found
        else:
            files.append(path)
    return files


def read(paths: Union[str, Iterable[str]], warn=None) -> List[Dict[str, Any]]:
    """The events of the given files (or of every events*.jsonl under a directory), sorted by
    time. Lines that are not JSON objects with a time and an event (a line cut short by a crash)
    are skipped with a warning; a line of a newer schema raises EventError naming it."""
    if isinstance(paths, str):
        paths = [paths]
    warn = warn or (lambda text: print(text, file=sys.stderr))
    events = []
    for path in _files(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    e = json.loads(line)
                except json.JSONDecodeError:
                    warn(f"elastrun.events: {path}:{n}: not a JSON line; skipped")
                    continue
                if not isinstance(e, dict) or "time" not in e or "event" not in e:
                    warn(f"elastrun.events: {path}:{n}: not an event; skipped")
                    continue
                version = e.get("v", SCHEMA_VERSION)
                if not isinstance(version, int) or version > SCHEMA_VERSION:
                    raise EventError(f"{path}:{n}: event schema v{version}, this reader knows v{SCHEMA_VERSION}: "
                                     "read it with a newer elastrun")
                events.append(e)
    events.sort(key=lambda e: e["time"])
    return events


class Timeline(NamedTuple):
    """What happened: (time, text) lines, and the series plot() draws."""
    t0: float
    lines: list
    rounds: dict
    losses: list
    marks: list
    resumes: list


def timeline(events: List[Dict[str, Any]]) -> Timeline:
    """The job's timeline from read()'s events (rounds, members lost and how fast that was
    detected, re-forming, checkpoints, resumes, requeues, the end)."""
    return Timeline(*_summarize(events))


# where a resume came from ("source" of a resumed event), in a timeline's words
_RESUME_SOURCES = {"file": "checkpoint", "memory-local": "the agents' memory at", "memory-partner": "a partner agent's memory at"}


def _summarize(events):
    """One list of (time, text) lines, and the series the plot needs."""
    t0 = events[0]["time"]
    lines, rounds, losses, marks = [], {}, [], []
    seen_rounds, seen_lost, seen_ckpt = set(), {}, set()
    last_loss_time, last_cause = None, ""
    resumes = []
    memory_snapshots = 0
    for e in events:
        t, kind = e["time"], e["event"]
        if kind == "round" and (e.get("run_id"), e.get("generation")) not in seen_rounds:
            seen_rounds.add((e.get("run_id"), e.get("generation")))
            rounds[(e.get("run_id"), e["generation"])] = e
            extra = ""
            if last_loss_time is not None:
                extra = f", re-formed {1000 * (t - last_loss_time):.0f} ms after the {last_cause} was seen"
                marks.append(("re-formed", t))
                last_loss_time = None
            lines.append((t, f"round {e['generation']} of run {e.get('run_id')}: world size {e['world_size']} on "
                             f"{','.join(e.get('members', []))} (formed in {e.get('formation_ms', '?')} ms{extra})"))
        elif kind == "store_lost":
            key = (e.get("run_id"), "store", e.get("store_node"))
            if key in seen_lost:
                continue
            seen_lost[key] = t
            lines.append((t, f"node {e.get('store_node')} lost with the rendezvous store it ran; the survivors fail "
                             "over to a standby store"))
            marks.append(("node lost", t))
            last_loss_time, last_cause = t, "loss"
        elif kind == "job_completed":
            lines.append((t, f"job ended by group rank 0 with exit code {e.get('exit_code')}: its batch script died "
                             f"with node {e.get('batch_host')}"))
        elif kind == "member_lost":
            key = (e.get("run_id"), e.get("member"))
            if key in seen_lost:
                continue
            seen_lost[key] = t
            since = e.get("since_heartbeat_ms")
            how = e.get("how") or "lost"
            detected = f", detected {since} ms after its last heartbeat" if since is not None else ""
            lines.append((t, f"node {e.get('member')} lost ({how}{detected}); workers stopped on the survivors"))
            marks.append(("node lost", t))
            last_loss_time, last_cause = t, "loss"
        elif kind == "failure_decision":
            lines.append((t, f"node {e['node']}: worker failure -> {e.get('action')} "
                             f"(restarts {e.get('restarts')} of {e.get('max_restarts')})"))
            marks.append(("worker failed", t))
            if e.get("action") == "restart":
                last_loss_time, last_cause = t, "failure"
        elif kind == "checkpoint_saved" and e.get("tier") == "memory":
            memory_snapshots += 1  # one per step or so: counted, not listed
        elif kind == "checkpoint_saved" and (e.get("run_id"), e.get("step")) not in seen_ckpt:
            seen_ckpt.add((e.get("run_id"), e.get("step")))
            size = e.get("bytes", 0)
            size = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size / 1024:.1f} KiB"
            lines.append((t, f"checkpoint step {e.get('step')}: {size} per rank, training blocked "
                             f"{1000 * e.get('blocked_s', 0):.0f} ms, durable after {1000 * e.get('durable_s', 0):.0f} ms"))
            marks.append(("checkpoint", t))
        elif kind == "resumed":
            resumes.append(e.get("step"))
            source = _RESUME_SOURCES.get(e.get("source"), "checkpoint")
            done = max((s for s, _, _, when in losses if when <= t and s is not None), default=None)
            lost = f"; {done - e['step']} step(s) of work lost" if done is not None and e.get("step") is not None \
                and done >= e["step"] else ""
            lines.append((t, f"resumed from {source} step {e.get('step')} at world size {e.get('world_size')}{lost}"))
        elif kind == "checkpoint_request":
            lines.append((t, f"node {e['node']}: checkpoint requested ({e.get('kind')}: {e.get('reason')})"))
        elif kind == "requeue":
            what = "requeued" if e.get("requeued") else "not requeued"
            lines.append((t, f"node {e['node']}: job {what} (class {e.get('class')})"))
            marks.append(("requeue", t))
        elif kind == "step":
            losses.append((e.get("step"), e.get("loss"), e.get("world_size"), t))
        elif kind == "train_done":
            lines.append((t, f"training done at step {e.get('step')}: final loss {e.get('loss')}"))
        elif kind == "exit":
            pass
    if memory_snapshots:
        lines.append((events[-1]["time"], f"{memory_snapshots} memory snapshot(s) taken (rank 0)"))
    codes = {}
    for e in events:
        if e["event"] == "exit":
            codes[(e.get("run_id"), e["node"])] = e.get("code")
    if codes:
        ok = sum(1 for c in codes.values() if c == 0)
        lines.append((events[-1]["time"], f"{ok} of {len(codes)} agent runs exited 0"
                                          + ("" if ok == len(codes) else f"; exit codes {sorted(set(codes.values()))}")))
    return t0, lines, rounds, losses, marks, resumes


def plot(path: str, tl: Timeline) -> None:
    """Loss vs step and world size vs time, with failures, re-forms and checkpoints marked."""
    t0, rounds, losses, marks, resumes = tl.t0, tl.rounds, tl.losses, tl.marks, tl.resumes
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_world) = plt.subplots(2, 1, figsize=(9, 6.5))
    losses = [x for x in losses if x[1] is not None]
    if losses:
        losses.sort(key=lambda x: x[3])
        for world in sorted({w for _, _, w, _ in losses}):
            pts = [(s, l) for s, l, w, _ in losses if w == world]
            ax_loss.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=5, label=f"world size {world}")
        if min(l for _, l, _, _ in losses) > 0:
            ax_loss.set_yscale("log")
        for i, step in enumerate(resumes):
            ax_loss.axvline(step, color="green", ls="--", lw=1, label="resumed from checkpoint" if i == 0 else None)
        ax_loss.legend(loc="best", fontsize=8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss (rank 0)")
    ax_loss.grid(alpha=0.3)
    pts = sorted(((r["time"] - t0, r["world_size"]) for r in rounds.values()))
    if pts:
        end = max(t for _, t in marks) - t0 if marks else pts[-1][0]
        xs, ys = [p[0] for p in pts] + [max(end, pts[-1][0])], [p[1] for p in pts] + [pts[-1][1]]
        ax_world.step(xs, ys, where="post", lw=2, label="world size")
    colours = {"node lost": "red", "worker failed": "orange", "re-formed": "green", "checkpoint": "grey",
               "requeue": "purple"}
    shown = set()
    for label, t in marks:
        ax_world.axvline(t - t0, color=colours.get(label, "black"), lw=1 if label == "checkpoint" else 1.5,
                         ls=":" if label == "checkpoint" else "--", label=None if label in shown else label)
        shown.add(label)
    ax_world.set_xlabel("seconds since the first event")
    ax_world.set_ylabel("workers")
    if pts:
        ax_world.set_ylim(0, max(y for _, y in pts) + 1)
        ax_world.yaxis.get_major_locator().set_params(integer=True)
    ax_world.set_title("world size over time")
    ax_world.grid(alpha=0.3)
    ax_world.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[List[str]] = None, prog: str = "python3 -m elastrun.events") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="timeline of an elastrun job from its event logs")
    ap.add_argument("--png", help="also write a plot (loss vs step, world size vs time) to this file")
    ap.add_argument("events", nargs="+", help="events-<node>.jsonl files, or the job directory")
    args = ap.parse_args(argv)
    try:
        events = read(args.events)
    except OSError as err:
        print(f"{prog}: cannot read {err.filename or err}: {err.strerror or err}; give the events-<node>.jsonl files "
              "or the job directory", file=sys.stderr)
        return 1
    except EventError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    if not events:
        print(f"{prog}: no events in " + ", ".join(args.events), file=sys.stderr)
        return 1
    tl = timeline(events)
    for t, text in tl.lines:
        print(f"  {t - tl.t0:7.2f} s  {text}")
    if args.png:
        plot(args.png, tl)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
