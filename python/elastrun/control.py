"""elastrun.control: the elastrun agent -> worker control channel, for Python training scripts
(also importable under its historical name, ``import elastrun_control``).

Same semantics as the C++ header <elastrun/control.hpp> (docs/launcher.md, "Control channel"):
the agent writes one line "<sequence> <request>" to the file named by $ELASTRUN_CONTROL_FILE,
atomically (temporary file + rename); request is "none", "checkpoint" or "checkpoint-and-stop".
poll() costs one os.stat() while nothing changed, so it can run every step.

    import elastrun.control as ec
    ec.install_signal_handlers()   # SIGUSR1/SIGUSR2/SIGTERM -> stop request instead of death
    for step in ...:
        train_step()
        if ec.poll_all().stop:      # all ranks agree (all-reduce) when torch.distributed is up
            save_checkpoint(ec.checkpoint_dir())
            sys.exit(ec.CHECKPOINTED_EXIT_CODE)   # 85: "checkpointed, please requeue"

Standard library only (torch is used by poll_all() only if it is already initialised).
"""

import contextlib
import math
import os
import signal
import sys
import time
from typing import Any, Optional

from elastrun import _contract as _c

__all__ = ["CHECKPOINTED_EXIT_CODE", "NONE", "CHECKPOINT", "CHECKPOINT_AND_STOP", "Status", "Channel",
           "parse", "write_file", "poll", "poll_all", "install_signal_handlers", "signal_received",
           "checkpoint_dir", "progress"]

# 85: not 0-2, not sysexits.h (64-78), not 126/127 (shell), not 128+N (signals).
CHECKPOINTED_EXIT_CODE = _c.CHECKPOINTED_EXIT_CODE
CONTROL_FILE_ENV = _c.ENV_CONTROL_FILE
CHECKPOINT_DIR_ENV = _c.ENV_CHECKPOINT_DIR
SEEN_SUFFIX = _c.CONTROL_SEEN_SUFFIX

NONE, CHECKPOINT, CHECKPOINT_AND_STOP = _c.CONTROL_REQUESTS
_LEVEL = {name: level for level, name in enumerate(_c.CONTROL_REQUESTS)}


class Status:
    """A request and its sequence number (grows with every request; 0: none yet)."""

    __slots__ = ("request", "sequence")

    def __init__(self, request: str = NONE, sequence: int = 0) -> None:
        self.request = request
        self.sequence = sequence

    @property
    def checkpoint(self) -> bool:
        return self.request != NONE

    @property
    def stop(self) -> bool:
        return self.request == CHECKPOINT_AND_STOP

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Status) and (self.request, self.sequence) == (other.request, other.sequence)

    def __repr__(self) -> str:
        return f"Status({self.request!r}, {self.sequence})"


def parse(text: str) -> Optional[Status]:
    """'<sequence> <request>' -> Status, or None if malformed."""
    parts = text.strip().split(" ")
    if len(parts) != 2 or not parts[0].isdigit() or parts[1] not in _LEVEL:
        return None
    return Status(parts[1], int(parts[0]))


def write_file(path: str, status: Status) -> None:
    """Replaces path atomically with status (the agent's side; used by tests)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{status.sequence} {status.request}\n")
    os.rename(tmp, path)


class Channel:
    """A reader of one control file (default: $ELASTRUN_CONTROL_FILE; disabled when unset)."""

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path if path is not None else os.environ.get(CONTROL_FILE_ENV, "")
        self._last = Status()
        self._stat = None
        self._announced = False

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def poll(self) -> Status:
        if not self.path:
            return self._last
        if not self._announced:
            # tells the agent this attempt's workers read the channel
            self._announced = True
            try:
                os.close(os.open(self.path + SEEN_SUFFIX, os.O_WRONLY | os.O_CREAT, 0o644))
            except OSError:
                pass
        try:
            st = os.stat(self.path)
        except OSError:
            return self._last
        key = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns)
        if key == self._stat:
            return self._last
        try:
            with open(self.path) as f:
                status = parse(f.read(128))
        except OSError:
            return self._last
        if status is not None:
            self._last, self._stat = status, key
        return self._last


_signal_received = 0
_channel = None


def _on_stop_signal(signum: int, _frame: Any) -> None:
    global _signal_received
    _signal_received = signum


def install_signal_handlers() -> None:
    """SIGUSR1, SIGUSR2 and SIGTERM set a local checkpoint-and-stop request (seen by poll()).

    Slurm delivers its --signal warning and preemption's SIGTERM to every process of the step,
    workers included; with these handlers they survive to checkpoint. Main thread only.
    """
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, _on_stop_signal)


def signal_received() -> int:
    """The signal caught by install_signal_handlers' handlers, 0 if none."""
    return _signal_received


def poll() -> Status:
    """The process-wide channel's status, merged with a caught stop signal."""
    global _channel
    if _channel is None:
        _channel = Channel()
    status = _channel.poll()
    if _signal_received and not status.stop:
        return Status(CHECKPOINT_AND_STOP, status.sequence)
    return status


def poll_all(group: Any = None) -> Status:
    """poll(), agreed by all ranks: the strongest request of any rank (an all-reduce MAX).

    Ranks poll at different moments; without agreement one rank may stop while another enters
    the next collective and hangs. Needs torch.distributed initialised; otherwise == poll().
    Costs one small all-reduce: call it every N steps if that matters.
    """
    status = poll()
    dist = sys.modules.get("torch.distributed")  # never imports torch itself (seconds to load)
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return status
    import torch
    t = torch.tensor([_LEVEL[status.request], status.sequence], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    level, sequence = int(t[0]), int(t[1])
    request = next(name for name, value in _LEVEL.items() if value == level)
    return Status(request, sequence)


def checkpoint_dir() -> str:
    """$ELASTRUN_CHECKPOINT_DIR (elastrun --checkpoint-dir), '' if not given."""
    return os.environ.get(CHECKPOINT_DIR_ENV, "")


_progress_fd = None
_stacks_file = None
_compute_us = 0          # the compute record: this worker's compute time so far, in microseconds
_pending_compute_s = None  # timed by compute() since the last progress(step)


@contextlib.contextmanager
def compute(synchronize: bool = True):
    """Times this step's compute, reported with the next progress(step): the one line a training
    loop needs for the agent's straggler detection (elastrun --straggler-action)::

        with elastrun.control.compute():
            loss = model(batch)          # what runs before the step's collectives
        loss.backward()                  # DDP's gradient all-reduce: not compute, it waits for the others
        optimizer.step()
        elastrun.control.progress(step)

    In synchronous training every rank's step lasts as long as the slowest's; compute times are
    what differ between a slow node and the others. Time what precedes the step's first
    collective (forward and loss; without DDP, also the backward before the all-reduce). With
    CUDA, the end of the block waits for this device's queued kernels (synchronize=True), else only
    their launch would be timed. Several blocks in one step add up.
    """
    t0 = time.perf_counter()
    try:
        yield
    finally:
        if synchronize:
            cuda = getattr(sys.modules.get("torch"), "cuda", None)  # never imports torch itself
            if cuda is not None and cuda.is_available() and cuda.is_initialized():
                cuda.synchronize()
        global _pending_compute_s
        _pending_compute_s = (_pending_compute_s or 0.0) + time.perf_counter() - t0


def progress(step: Optional[int] = None, compute_s: Optional[float] = None) -> None:
    """Tells the agent this worker made progress (elastrun --hang-timeout): call it once per step,
    with the step number.

    Writes the worker contract's fixed-size record (the same as C++ elastrun::control::progress)
    at the start of $ELASTRUN_PROGRESS_FILE: the agent reads the step from it, and the file's
    modification time is the time of the last progress. Without a step only the time changes.
    With the step's compute time (`compute_s`, or what compute() timed since the last call) the
    compute record follows in the same write: the sum so far in microseconds, which the agent
    compares across nodes to find stragglers. Nothing when the agent does not watch. The first call
    also lets the agent dump this process's Python stacks should it hang: faulthandler writes them
    to $ELASTRUN_STACKS_FILE on the signal $ELASTRUN_STACKS_SIGNAL (the C++ side has no Python
    stacks to dump).
    """
    global _progress_fd, _stacks_file, _compute_us, _pending_compute_s
    if step is not None and compute_s is None and _pending_compute_s is not None:
        compute_s = _pending_compute_s
    if step is not None:
        _pending_compute_s = None
    if _progress_fd is None:
        path = os.environ.get(_c.ENV_PROGRESS_FILE)
        if not path:
            return
        _progress_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if _stacks_file is None and os.environ.get(_c.ENV_STACKS_FILE):
            import faulthandler
            _stacks_file = open(os.environ[_c.ENV_STACKS_FILE], "w")
            faulthandler.register(int(os.environ.get(_c.ENV_STACKS_SIGNAL, "0")) or signal.SIGRTMIN + 4,
                                  file=_stacks_file, all_threads=True)
    if step is None:
        os.utime(_progress_fd)
    elif compute_s is None:
        os.pwrite(_progress_fd, (_c.PROGRESS_RECORD_FORMAT % int(step)).encode(), 0)
    else:
        _compute_us += math.floor(float(compute_s) * 1e6 + 0.5)
        record = (_c.PROGRESS_RECORD_FORMAT % int(step)).ljust(_c.COMPUTE_RECORD_OFFSET)
        os.pwrite(_progress_fd, (record + _c.COMPUTE_RECORD_FORMAT % _compute_us).encode(), 0)
