"""Which ranks vote on a checkpoint, and through which store.

The votes of a save or restore (a few small messages per call) go through the job's c10d store --
``torch.distributed.distributed_c10d._get_default_store()`` once a process group exists, as the C++
``C10dStoreCommunicator`` does -- never through collectives on the default group, which from the
AsyncSaver's writer thread would interleave with DDP's.

Without a process group the package opens a store of its own: rank 0 listens on a port the
kernel picks (never MASTER_PORT, which the workers' own process group will take) and publishes
"host port" in a small file in the checkpoint directory, which every rank can reach (each writes
its shard there); the other ranks read it and connect. Works under elastrun, torchrun and
``srun --torch-env``.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import socket
import time
import uuid
from typing import Any, Dict, Iterator, Optional, Tuple

from . import _core

# Bounds each wait for a peer's vote, which includes the time that peer takes to write and
# fsync its shard: as generous as torch.distributed's default process-group timeout.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_async_counter = itertools.count()
_cache: Dict[Tuple[Any, ...], Tuple[Any, Any]] = {}  # (store id, rank, world, purpose) -> (store, comm)
_failures: Dict[Tuple[Any, ...], int] = {}  # the same key -> failed calls so far (part of the key prefix)
_own_stores: Dict[str, Any] = {}  # checkpoint directory -> the store this process opened for it


def _attempt() -> str:
    """Changes whenever the group is re-formed or restarted: keys never outlive an attempt."""
    return f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{os.environ.get('ELASTRUN_GENERATION', '0')}"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"${name}={value!r} is not an integer") from None


def rank_and_world(rank: Optional[int] = None, world_size: Optional[int] = None) -> Tuple[int, int]:
    dist = _dist()
    if dist is not None and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    else:
        r, w = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    r = r if rank is None else rank
    w = w if world_size is None else world_size
    if w < 1 or not 0 <= r < w:
        raise ValueError(f"rank {r} of world size {w} is not a valid rank")
    return r, w


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def group_initialized() -> bool:
    """Whether a default process group exists (its store carries the votes)."""
    dist = _dist()
    return dist is not None and dist.is_initialized()


def communicator(ckpt_dir: str, purpose: str, *, store: Any = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Any:
    """The communicator for `purpose` ("sync", or one per AsyncSaver), cached per store: every rank
    makes the same calls in the same order, so the numbered keys stay in step."""
    r, w = rank_and_world(rank, world_size)
    if w == 1:
        return _core.Comm.single()
    if store is None:
        dist = _dist()
        if dist is not None and dist.is_initialized():
            store = dist.distributed_c10d._get_default_store()
            # a destroyed group's store must not stay alive here (its server holds MASTER_PORT)
            for old_key, (old_store, _) in list(_cache.items()):
                if old_key[4] == "default" and old_store is not store:
                    del _cache[old_key]
            source = "default"
        else:
            store = _own_store(ckpt_dir, r, w, timeout)
            source = "own"
    else:
        source = "explicit"
    key = (id(store), r, w, purpose, source)
    cached = _cache.get(key)
    if cached is not None and cached[0] is store:
        return cached[1]
    epoch = _failures.get(key[:4], 0)
    comm = _core.Comm.over_store(store, r, w, f"elastrun/ckpt/{_attempt()}/{purpose}.{epoch}", timeout)
    _cache[key] = (store, comm)
    return comm


@contextlib.contextmanager
def collective(ckpt_dir: str, purpose: str, *, store: Any = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT
               ) -> Iterator[Any]:
    """The communicator for one collective call. If the call fails on this rank -- in the vote, or
    before it on bad input -- the next call uses fresh keys: a save that failed early on one rank
    still voted no there (its peers fail at once), a load that did failed its peers on their
    timeout, and every rank moves on to the same new prefix."""
    comm = communicator(ckpt_dir, purpose, store=store, timeout=timeout)
    try:
        yield comm
    except BaseException:
        for key, (_, cached) in list(_cache.items()):
            if cached is comm:
                del _cache[key]
                _failures[key[:4]] = _failures.get(key[:4], 0) + 1
        raise


def async_purpose() -> str:
    return f"async{next(_async_counter)}"


def _job_tag() -> str:
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        if os.environ.get(name):
            tag = os.environ[name]
            break
    else:
        tag = f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    step = os.environ.get("SLURM_STEP_ID", "")
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{tag}.{step}.{restarts}.{_attempt()}")


def _own_store(ckpt_dir: str, rank: int, world: int, timeout: datetime.timedelta) -> Any:
    ckpt_dir = os.path.abspath(ckpt_dir)
    if ckpt_dir in _own_stores:
        return _own_stores[ckpt_dir]
    import torch.distributed as dist

    if not os.path.isdir(ckpt_dir):
        # save creates the directory first; a load from a missing one is the caller's mistake
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir!r} does not exist "
                                "(create it, or pass missing_ok=True to load)")
    address_file = os.path.join(ckpt_dir, f".elastrun-store-{_job_tag()}")
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        store = dist.TCPStore(host, 0, world, True, timeout, wait_for_workers=False)
        # A nonce tells this attempt's file from a stale one a crashed attempt left behind.
        nonce = uuid.uuid4().hex
        store.set("elastrun/nonce", nonce)
        temporary = f"{address_file}.tmp-{os.getpid()}"
        with open(temporary, "w") as f:
            f.write(f"{host} {store.port} {nonce}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, address_file)
        atexit.register(_remove_quietly, address_file)
    else:
        store = _connect(address_file, world, timeout)
    _own_stores[ckpt_dir] = store
    return store


def _connect(address_file: str, world: int, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    deadline = time.monotonic() + timeout.total_seconds()
    last_error = "rank 0 has not published its store yet"
    while time.monotonic() < deadline:
        try:
            with open(address_file) as f:
                host, port, nonce = f.read().split()
            store = dist.TCPStore(host, int(port), world, False, datetime.timedelta(seconds=10))
            if store.get("elastrun/nonce").decode() == nonce:
                store.set_timeout(timeout)
                return store
            last_error = f"{address_file} names another attempt's store"
        except (OSError, ValueError, RuntimeError) as e:
            last_error = str(e)
        time.sleep(0.2)
    raise TimeoutError(f"no checkpoint store from rank 0 within {timeout.total_seconds():.0f} s "
                       f"({address_file}: {last_error}); is rank 0 running with the same checkpoint directory?")


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
