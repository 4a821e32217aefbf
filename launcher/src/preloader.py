# The preloader (elastrun --preload=MODULES; docs/launcher.md, "Preloaded workers"): one per node,
# started by the agent with the interpreter and flags its Python workers get, it imports MODULES
# once and then forks every worker of the job on the agent's request, so that a restart or a
# re-form does not pay `import torch` again. Embedded in the agent (preloader_source.hpp) and run
# with `python -u -c`, so it needs nothing installed beside the agent.
#
# Protocol on fd 3, a SOCK_SEQPACKET socket to the agent (one JSON object per message):
#   preloader -> agent  {"ready": true, "seconds": S}          after the imports
#                       {"fatal": "one line"}                  it cannot serve (then exits 2)
#                       {"started": PID} / {"error": "..."}    the answer to a start
#                       {"exit": PID, "status": WAIT_STATUS}   a worker ended (raw wait status)
#   agent -> preloader  {"start": {"argv": [...], "env": ["K=V", ...], "cpus": [...]}} with the
#                       worker's stdout and stderr as two descriptors (SCM_RIGHTS)
# The preloader ends when the agent closes the socket, or with the agent (PDEATHSIG).
#
# Spares: a fork of a process that imported torch costs 15-20 ms here (its page tables), and a
# re-form forks every worker of every node at once on few cores. Once the job's workers run and no
# order came for a while, the preloader forks as many spare children as it last started workers;
# each waits on a socket of its own for a worker's order. A start hands the order (and the two
# descriptors) to a spare, and forks only when none is left. A spare is not a worker: its exit is
# never reported; it dies with the preloader (PDEATHSIG).
import ctypes
import importlib
import json
import os
import signal
import socket
import sys
import time

PR_SET_PDEATHSIG = 1
_TORCH_FIXED_SEED = 67280421310721  # c10's default_rng_seed_val
_libc = ctypes.CDLL(None, use_errno=True)
_control = socket.socket(fileno=3)
_SPARE_AFTER_IDLE_S = 2.0  # no fork for spares while a start or re-form may still be going on
_spares = []  # (pid, socket to it): forked, waiting for a worker's order
_spare_pids = set()  # spares not yet handed an order (their exits are not the agent's business)
_workers = set()  # workers started and not yet reaped
_wanted_spares = 0  # the most workers that ran at once
# Slurm signals every process of the step (--signal, scancel, preemption): the preloader is not a
# worker and must not die of them (its workers would follow it, PDEATHSIG); it ignores them and a
# worker gets back what the interpreter started with (a fresh interpreter's handlers)
_STEP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_worker_handlers = {}


def _send(message):
    _control.send(json.dumps(message).encode())


def _exit_code(code):
    # what the interpreter does with SystemExit's code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _await_listener(host, port, seconds):
    """Until something listens on host:port (a connect every 10 ms), at most `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic())).close()
            return
        except ConnectionRefusedError:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.01)
        except OSError:
            return  # unresolvable, unreachable, timed out: torch's own connect reports it


def _patch_store_connect():
    """torch 1.13's TCPStore client retries a refused connection only after a whole second. A forked
    worker starts in milliseconds, so a rank that gets to init_process_group before rank 0 has
    created its store (on another node, rank 0 is as fast) lost 1 s in every start and re-form.
    Non-zero ranks now wait for rank 0's store to listen, checking every 10 ms, before torch creates
    their client; what the store does and what the script sees are unchanged."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    create = getattr(rendezvous, "_create_c10d_store", None)
    if create is None or getattr(create, "_elastrun_awaits_listener", False):
        return

    def _create_c10d_store(hostname, port, rank, world_size, timeout, *args, **kwargs):
        if rank != 0:
            _await_listener(hostname, port, timeout.total_seconds() if hasattr(timeout, "total_seconds") else 60)
        return create(hostname, port, rank, world_size, timeout, *args, **kwargs)

    _create_c10d_store._elastrun_awaits_listener = True
    rendezvous._create_c10d_store = _create_c10d_store


def _become_child(parent):
    """In a forked child, first: its own process group, dead with the preloader (`parent`, its pid
    taken before the fork: a death in between is seen), none of its wiring."""
    os.setpgid(0, 0)
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != parent:
        os._exit(126)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _control.close()
    for _, sock in _spares:  # the other spares' sockets: each must see EOF when the preloader goes
        sock.close()


def _fork_spare():
    """One more spare; False when the system refuses (no process or descriptor to spare: the
    workers forked on their orders instead, as without spares)."""
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    try:
        pid = os.fork()
    except OSError:
        ours.close()
        theirs.close()
        return False
    if pid == 0:
        try:
            ours.close()
            _become_child(parent)
            try:
                data, fds, _, _ = socket.recv_fds(theirs, 1 << 20, 2)
            except OSError:
                os._exit(0)
            if not data or len(fds) != 2:
                os._exit(0)  # the preloader closed it: not needed
            theirs.close()
            _run_worker(json.loads(data), fds[0], fds[1])
        finally:
            os._exit(1)  # never back into the preloader's loop
    theirs.close()
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass
    _spares.append((pid, ours))
    _spare_pids.add(pid)
    return True


def _hand_to_spare(order, fds):
    """The order to a waiting spare: its pid, or None when there is none (or none took it)."""
    while _spares:
        pid, sock = _spares.pop(0)
        try:
            socket.send_fds(sock, [json.dumps(order).encode()], fds)
        except OSError:  # it died: its exit stays unreported
            sock.close()
            continue
        sock.close()
        _spare_pids.discard(pid)
        return pid
    return None


def _run_worker(order, stdout_fd, stderr_fd):
    """In the forked child: become the worker `python -u ARGV...` would have been, run it, exit."""
    for sig, handler in _worker_handlers.items():
        signal.signal(sig, handler)
    os.dup2(stdout_fd, 1)
    os.dup2(stderr_fd, 2)
    os.close(stdout_fd)
    os.close(stderr_fd)
    os.environ.clear()
    for entry in order["env"]:
        key, _, value = entry.partition("=")
        os.environ[key] = value
    if order.get("cpus"):
        try:
            os.sched_setaffinity(0, order["cpus"])
        except OSError:
            pass  # a cpuset that excludes them: the affinity stays as it was (as the exec backend)
    # What a fresh interpreter would have read at start-up, and a fork copies instead:
    torch = sys.modules.get("torch")
    if torch is not None:
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        # torch's default generator: upstream builds start every interpreter from one fixed seed,
        # others (Debian's) from a random one; a fork would give every worker the same stream
        if torch.initial_seed() == _TORCH_FIXED_SEED:
            torch.manual_seed(_TORCH_FIXED_SEED)
        else:
            torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # numpy's global RNG from fresh entropy, as in a fresh interpreter
    args = order["argv"]  # after "python -u": SCRIPT ARGS... or -m MODULE ARGS...
    code = 0
    try:
        import runpy

        if args[0] == "-m":
            sys.argv = [args[1]] + args[2:]  # runpy sets argv[0] to the module's file
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        import threading

        threading._shutdown()  # non-daemon threads are waited for, as at interpreter exit
    except Exception:
        pass
    try:
        import atexit

        atexit._run_exitfuncs()
    except Exception:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in _spare_pids:  # a spare that died waiting (killed): not a worker
            _spare_pids.discard(pid)
            for i, (spare, sock) in enumerate(_spares):
                if spare == pid:
                    sock.close()
                    del _spares[i]
                    break
            continue
        _workers.discard(pid)
        _send({"exit": pid, "status": status})


def main():
    global _wanted_spares
    if _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        _send({"fatal": "prctl(PR_SET_PDEATHSIG) failed"})
        sys.exit(2)
    for sig in _STEP_SIGNALS:
        _worker_handlers[sig] = signal.getsignal(sig)
        signal.signal(sig, signal.SIG_IGN)
    started = time.monotonic()
    modules = [m for m in sys.argv[1].split(",") if m]
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:
            _send({"fatal": f"--preload: importing {name} failed: {type(e).__name__}: {e}"})
            sys.exit(2)
    # fork() with threads is undefined behaviour (only the forking thread survives in the child)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        _send({"fatal": f"--preload={sys.argv[1]}: the imports started {threads - 1} thread(s); a process with "
                        "threads cannot fork workers safely (an OpenBLAS built with pthreads: set "
                        "OPENBLAS_NUM_THREADS=1)"})
        sys.exit(2)
    _patch_store_connect()
    _send({"ready": True, "seconds": round(time.monotonic() - started, 3)})
    wakeup_read, wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    import selectors

    selector = selectors.DefaultSelector()
    selector.register(_control, selectors.EVENT_READ)
    selector.register(wakeup_read, selectors.EVENT_READ)
    last_order = time.monotonic()
    while True:
        timeout = None
        if len(_spares) < _wanted_spares:
            timeout = max(0.0, last_order + _SPARE_AFTER_IDLE_S - time.monotonic())
        events = selector.select(timeout)
        if not events:  # idle: one more spare for the next start or re-form, then look again
            if not _fork_spare():
                _wanted_spares = len(_spares)  # refused: no more spares for this job
            continue
        for key, _ in events:
            if key.fileobj == wakeup_read:
                try:
                    os.read(wakeup_read, 4096)
                except BlockingIOError:
                    pass
                _reap()
                continue
            try:
                data, fds, _, _ = socket.recv_fds(_control, 1 << 20, 2)
            except InterruptedError:
                continue
            if not data:
                return  # the agent closed the socket: done (its workers were stopped first)
            order = json.loads(data)["start"]
            last_order = time.monotonic()
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                _send({"error": "a start order needs the worker's stdout and stderr descriptors"})
                continue
            pid = _hand_to_spare(order, fds)
            if pid is None:
                sys.stdout.flush()
                sys.stderr.flush()
                parent = os.getpid()
                pid = os.fork()
                if pid == 0:
                    try:
                        _become_child(parent)
                        _run_worker(order, fds[0], fds[1])
                    finally:
                        os._exit(1)
                try:
                    os.setpgid(pid, pid)  # also here: the agent may signal the group before the child runs
                except OSError:
                    pass
            for fd in fds:
                os.close(fd)
            _workers.add(pid)
            _wanted_spares = max(_wanted_spares, len(_workers))
            _send({"started": pid})
            _reap()


main()
