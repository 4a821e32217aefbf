#!/usr/bin/python3
"""launcher_bench: the elastrun agent side by side with torchrun, on this machine, in one run.

Prints figures and ratios against issue #5's goals; never asserts. Run with Debian's python3
(it has torch 1.13 and /usr/bin/torchrun):
    /usr/bin/python3 bench/launcher_bench.py [--elastrun build/bin/elastrun] [--torchrun /usr/bin/torchrun]

  (a) launch -> first all-reduce done: `--standalone --nproc-per-node 2` with a minimal gloo worker
      (goal: elastrun <= 1/5 of torchrun); plus the agent alone: the whole run of two `/bin/true`
      workers (`--no-python`), and agent start -> worker process start;
  (b) worker crash -> replacement worker started (rank 0 exits 1 once; goal <= 1/10);
  (c) node loss -> re-formed: two agents on this machine share an endpoint (--nnodes=1:2), one
      agent and its workers are killed with SIGKILL (a node crash); time until the survivor's
      worker restarts with WORLD_SIZE 1 (torchrun: bounded wait);
  (d) agent peak RSS (VmHWM of the agent process, polled while it runs; goal <= 10 MB);
  (e) the agent's own CPU seconds (utime + stime) and peak RSS over a run of --cpu-seconds with two
      idle workers (`--only e`).
With --json FILE every run's raw numbers go there (bench/run.py); (b) also measures, with torch
workers, worker exit -> every replacement's first all-reduce done, and that again for elastrun
with --preload=torch (the replacements forked by a preloader that imported torch once).
Both launchers run with their default settings (torchrun: --monitor_interval 5 s, c10d
rendezvous; Debian's torchrun 1.13 under Python 3.11 needs `--redirects 9:0 --tee 9:0`, and takes
only the underscore spellings of its flags, which elastrun also accepts).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TORCH_PY = "/usr/bin/python3"


# ---------------------------------------------------------------------------------- workers
def put(path, value):
    """Atomically: the bench polls for these files."""
    with open(path + ".tmp", "w") as f:
        f.write(f"{value}\n")
    os.replace(path + ".tmp", path)


def worker(mode, out):
    """Runs under the launcher (rank etc. from the environment)."""
    start = time.time()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    tag = os.environ.get("BENCH_TAG", "x")
    put(os.path.join(out, f"start.{tag}.{rank}.{world}.{restart}.{os.getpid()}"), start)
    if mode == "loop" and world == 1:
        return  # the re-formed, smaller world: its start is what we measure
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    done = time.time()
    put(os.path.join(out, f"allreduce.{tag}.{rank}.{world}.{restart}"), done)
    if mode == "train":
        train(out, tag, rank, world, restart)
        return
    if mode == "steps":  # all-reduce every 50 ms until OUT/stop appears (or a peer is lost: exit 1)
        deadline = time.time() + 600
        while time.time() < deadline and not os.path.exists(os.path.join(out, "stop")):
            dist.all_reduce(t)
            time.sleep(0.05)
        dist.destroy_process_group()
        return
    if mode == "crashonce":  # rank 0 exits 1 after the first all-reduce of the first attempt
        if restart == "0":
            if rank == 0:
                put(os.path.join(out, "crash"), time.time())
                os._exit(1)
            deadline = time.time() + 120
            while time.time() < deadline:  # the peer blocks in an all-reduce until the restart
                dist.all_reduce(t)
        dist.destroy_process_group()
        return
    if mode == "loop":  # keep all-reducing until the peer dies (the launcher restarts us)
        deadline = time.time() + 120
        while time.time() < deadline:
            dist.all_reduce(t)
            time.sleep(0.05)
    dist.destroy_process_group()


def train(out, tag, rank, world, restart):
    """A training loop whose state lives in the agents' memory tier (elastrun --memory-checkpoints):
    a step is an all-reduce of a 1 MiB model (every rank holds the same, as under DDP) and a snapshot
    of it into the node's agent; a (re)started worker first resumes from the newest step every node
    holds (ranks renumber in a re-form: any local rank's snapshot will do) and stamps its first step
    done: step.TAG.RANK.WORLD.RESTART. Until OUT/stop appears."""
    import torch
    import torch.distributed as dist
    from elastrun.memory import MemoryTier

    tier = MemoryTier()
    model = torch.zeros(1 << 18)  # 1 MiB of float32
    held = {}
    if tier.enabled:
        for s in tier.list().get("segments", []):
            if s["committed"]:
                held.setdefault(s["step"], s["rank"])
    step = torch.tensor([max(held, default=-1)], dtype=torch.int64)
    dist.all_reduce(step, op=dist.ReduceOp.MIN)  # the newest step every rank's node holds
    step = int(step.item())
    if step >= 0:
        got = tier.get(held[step], step) if step in held else None
        if got is None:
            raise SystemExit(f"[rank {rank}] step {step} is not in this node's memory tier")
        model = torch.frombuffer(bytearray(got[1]), dtype=torch.float32)
    else:
        step = 0
    first = True
    deadline = time.time() + 600
    while time.time() < deadline and not os.path.exists(os.path.join(out, "stop")):
        dist.all_reduce(model)
        model /= world
        step += 1
        if tier.enabled:
            tier.put(step, rank, model.numpy().tobytes())
        if first:
            put(os.path.join(out, f"step.{tag}.{rank}.{world}.{restart}"), time.time())
            first = False
        time.sleep(0.05)
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- helpers
def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PET_", "TORCHELASTIC_", "ELASTRUN_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["ELASTRUN_PYTHON"] = TORCH_PY
    env.update(extra)
    return env


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of():
    kids = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p))
    return kids


def tree(pid):
    kids, out, todo = children_of(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def kill_tree(pid, sig=signal.SIGKILL):
    for p in tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def memory_kb(pid):
    """(VmHWM, RssAnon) of pid in kB: peak resident set, and its private anonymous part now."""
    hwm = anon = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
    except OSError:
        pass
    return hwm, anon


class Agent:
    """A launcher process; its peak RSS is polled while we wait for it."""

    def __init__(self, argv, env, log):
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        self.hwm = self.anon = 0

    def poll_rss(self):
        hwm, anon = memory_kb(self.proc.pid)
        self.hwm, self.anon = max(self.hwm, hwm), max(self.anon, anon)

    def wait(self, timeout):
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self.poll_rss()
            time.sleep(0.02)
        return self.proc.poll()

    def stop(self):
        if self.proc.poll() is None:
            kill_tree(self.proc.pid, signal.SIGTERM)
            if self.wait(10) is None:
                kill_tree(self.proc.pid)
        # whatever the launcher left behind (torchrun's workers outlive a killed agent)
        self.proc.wait()
        self.log.close()


def files(out, prefix):
    return [os.path.join(out, f) for f in os.listdir(out) if f.startswith(prefix) and not f.endswith(".tmp")]


def read_ts(path):
    with open(path) as f:
        return float(f.read())


class Bench:
    def __init__(self, args):
        self.args = args
        self.tmp = tempfile.mkdtemp(prefix="elastrun-launcher-bench-")
        self.rss = {"elastrun": 0, "torchrun": 0}
        self.anon = {"elastrun": 0, "torchrun": 0}
        self.me = os.path.abspath(__file__)

    def cmd(self, which, *rest):
        if which == "elastrun":
            return [self.args.elastrun, *rest]
        return [TORCH_PY, self.args.torchrun, "--redirects", "9:0", "--tee", "9:0", *rest]

    def fresh(self, name):
        d = os.path.join(self.tmp, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def run(self, which, argv, timeout, out, tag="x"):
        a = Agent(self.cmd(which, *argv), clean_env(BENCH_TAG=tag), os.path.join(out, f"{which}.log"))
        t0 = time.time()
        rc = a.wait(timeout)
        t1 = time.time()
        a.stop()
        self.rss[which] = max(self.rss[which], a.hwm)
        self.anon[which] = max(self.anon[which], a.anon)
        return rc, t0, t1

    # (a)
    def first_allreduce(self, which, nproc=2):
        """(launch -> every worker's first all-reduce done, launch -> every worker process started)"""
        out = self.fresh(f"a-{which}")
        rc, t0, _ = self.run(which, ["--standalone", "--nproc_per_node", str(nproc), self.me, "--worker", "once", out],
                             120, out)
        done = [read_ts(p) for p in files(out, "allreduce.")]
        starts = [read_ts(p) for p in files(out, "start.")]
        if rc != 0 or len(done) != nproc:
            return None, None
        return max(done) - t0, max(starts) - t0

    def agent_only(self, which):
        out = self.fresh(f"a0-{which}")
        rc, t0, t1 = self.run(which, ["--standalone", "--nproc_per_node", "2", "--no_python", "/bin/true"], 60, out)
        return t1 - t0 if rc == 0 else None

    # (b)
    def crash_restart(self, which):
        out = self.fresh(f"b-{which}")
        script = os.path.join(out, "crash.sh")
        with open(script, "w") as f:
            f.write(f"""#!/bin/sh
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  if [ "$RANK" = 0 ]; then date +%s.%N > {out}/crash; exit 1; fi
  exec sleep 60
fi
[ "$RANK" = 0 ] && date +%s.%N > {out}/restarted
exit 0
""")
        os.chmod(script, 0o755)
        rc, _, _ = self.run(which, ["--standalone", "--nproc_per_node", "2", "--max_restarts", "1",
                                    "--no_python", script], 90, out)
        try:
            return read_ts(os.path.join(out, "restarted")) - read_ts(os.path.join(out, "crash")) if rc == 0 else None
        except OSError:
            return None

    # (b') with torch workers: worker exit -> every replacement's first all-reduce done
    def crash_allreduce(self, which, preload=False):
        out = self.fresh(f"b2-{which}{'-preload' if preload else ''}")
        rc, _, _ = self.run(which, ["--standalone", "--nproc_per_node", "2", "--max_restarts", "1",
                                    *(["--preload=torch"] if preload else []), self.me,
                                    "--worker", "crashonce", out], 180, out)
        again = [read_ts(p) for p in files(out, "allreduce.") if p.endswith(".1")]
        try:
            crash = read_ts(os.path.join(out, "crash"))
        except OSError:
            return None
        return max(again) - crash if rc == 0 and len(again) == 2 else None

    # (e) the agent's own CPU time and peak RSS over a run of `seconds` with 2 idle workers
    def agent_cpu(self, which, seconds):
        out = self.fresh(f"e-{which}")
        a = Agent(self.cmd(which, "--standalone", "--nproc_per_node", "2", "--no_python", "sleep", str(seconds)),
                  clean_env(), os.path.join(out, f"{which}.log"))
        tick = os.sysconf("SC_CLK_TCK")
        cpu = None
        deadline = time.time() + seconds + 60
        while a.proc.poll() is None and time.time() < deadline:
            a.poll_rss()
            try:
                with open(f"/proc/{a.proc.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime, all threads
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.25)
        rc = a.proc.poll()
        a.stop()
        return (cpu, a.hwm / 1024.0) if rc == 0 else None

    # (c)
    def node_loss(self, which, bound):
        out = self.fresh(f"c-{which}")
        port = free_port()
        common = ["--nnodes", "1:2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                  f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id", f"bench{port}", "--max_restarts", "3"]
        host_extra = ["--rdzv_conf", "is_host=1", "--node_rank", "0"] if which == "elastrun" else []
        peer_extra = ["--rdzv_conf", "is_host=0", "--node_rank", "1"] if which == "elastrun" else []
        worker_args = [self.me, "--worker", "loop", out]
        a = Agent(self.cmd(which, *common, *host_extra, *worker_args), clean_env(BENCH_TAG="a"),
                  os.path.join(out, "a.log"))
        if which == "torchrun":
            time.sleep(2.0)  # the first agent binds the store port (torchrun's store host)
        b = Agent(self.cmd(which, *common, *peer_extra, *worker_args), clean_env(BENCH_TAG="b"),
                  os.path.join(out, "b.log"))
        result = None
        try:
            deadline = time.time() + 90
            while len(files(out, "allreduce.")) < 2 and time.time() < deadline:
                a.poll_rss()
                b.poll_rss()
                if a.proc.poll() is not None or b.proc.poll() is not None:
                    break
                time.sleep(0.05)
            if len(files(out, "allreduce.")) < 2:
                return "no 2-node round"
            time.sleep(0.5)
            kill_tree(b.proc.pid)  # node crash: the agent and its workers at once
            killed = time.time()
            deadline = killed + bound
            while time.time() < deadline:
                a.poll_rss()
                small = files(out, "start.a.0.1.")
                if small:
                    result = read_ts(small[0]) - killed
                    break
                time.sleep(0.02)
        finally:
            b.stop()
            a.wait(5)
            a.stop()
            self.rss[which] = max(self.rss[which], a.hwm, b.hwm)
            self.anon[which] = max(self.anon[which], a.anon, b.anon)
        if result is None:
            return f"> {bound:.0f} s: the survivor did not restart its worker with WORLD_SIZE 1"
        return result


def fmt_s(v):
    return f"{v:8.3f} s" if isinstance(v, (int, float)) else f"{'n/a':>10}"


def median(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return statistics.median(xs) if xs else None


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elastrun", default=os.path.join(HERE, "..", "build", "bin", "elastrun"))
    p.add_argument("--torchrun", default="/usr/bin/torchrun")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--node-loss-bound", type=float, default=60.0)
    p.add_argument("--only", default="abc", help="which of the measurements a, b, c, e to run (d always)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (launcher logs)")
    p.add_argument("--cpu-seconds", type=int, default=60, help="length of the agent CPU run (e)")
    p.add_argument("--nprocs", default="2", help="worker counts for (a), comma-separated (e.g. 1,2,4)")
    p.add_argument("--json", help="write every run's raw figures here (for bench/run.py)")
    args = p.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]
    if not os.access(args.elastrun, os.X_OK):
        sys.exit(f"launcher_bench: {args.elastrun} is not executable; build it (ninja elastrun) or pass --elastrun")
    have_torchrun = os.path.exists(args.torchrun)
    b = Bench(args)
    both = ["elastrun", "torchrun"] if have_torchrun else ["elastrun"]
    try:
        res = {w: {} for w in both}

        def safe(fn, *a):
            try:
                return fn(*a)
            except Exception as e:  # a benchmark reports, it does not stop
                return f"error: {e}"

        # Each pair alternated: elastrun, torchrun, elastrun, torchrun ... (the machine's load drifts).
        raw = {w: {} for w in both}

        def record(w, key, value):
            raw[w].setdefault(key, []).append(value if isinstance(value, (int, float)) else None)

        if "a" in args.only:
            for _ in range(args.reps):
                for w in both:
                    for n in nprocs:
                        first = safe(b.first_allreduce, w, n)
                        first = first if isinstance(first, tuple) else (None, None)
                        record(w, f"a{n}", first[0])
                        record(w, f"a_start{n}", first[1])
            for w in both:
                res[w]["a"] = median(raw[w].get(f"a{nprocs[0]}", []))
                res[w]["a_start"] = median(raw[w].get(f"a_start{nprocs[0]}", []))
            # torchrun's agent alone takes ~10 s a run here: once is enough to compare
            for w in both:
                res[w]["a0"] = median([safe(b.agent_only, w) for _ in range(args.reps + 1 if w == "elastrun" else 1)])
        if "b" in args.only:
            for _ in range(args.reps):
                for w in both:
                    record(w, "b", safe(b.crash_restart, w))
                    record(w, "b_allreduce", safe(b.crash_allreduce, w))
                    if w == "elastrun":  # torchrun has no preloader
                        record(w, "b_allreduce_preload", safe(b.crash_allreduce, w, True))
            for w in both:
                for key in ("b", "b_allreduce", "b_allreduce_preload"):
                    if key in raw[w]:
                        res[w][key] = median(raw[w][key])
            if "b_allreduce_preload" in res["elastrun"] and "torchrun" in res:
                res["torchrun"]["b_allreduce_preload"] = res["torchrun"].get("b_allreduce")
        if "e" in args.only:
            for _ in range(args.reps if args.cpu_seconds >= 60 else 1):
                for w in both:
                    e = safe(b.agent_cpu, w, args.cpu_seconds)
                    record(w, "cpu_s", e[0] if isinstance(e, tuple) else None)
                    record(w, "cpu_run_rss_mib", e[1] if isinstance(e, tuple) else None)
            for w in both:
                raw[w]["cpu_run_s"] = args.cpu_seconds
        if "c" in args.only:
            for w in both:
                res[w]["c"] = safe(b.node_loss, w, args.node_loss_bound)
                raw[w]["c"] = res[w]["c"]
        for w in both:
            # sampled while the other measures ran: nothing to report if none did
            if b.rss[w]:
                res[w]["d"] = b.rss[w] / 1024.0
                res[w]["d_anon"] = b.anon[w] / 1024.0
        if args.json:
            for w in both:
                raw[w]["rss_peak_kib"] = b.rss[w]
                raw[w]["rss_anon_kib"] = b.anon[w]
            with open(args.json, "w") as f:
                json.dump({"nprocs": nprocs, "reps": args.reps, "node_loss_bound_s": args.node_loss_bound,
                           "launchers": raw}, f, indent=1)
    finally:
        if args.keep:
            print(f"# work directory kept: {b.tmp}")
        else:
            shutil.rmtree(b.tmp, ignore_errors=True)

    def ratio(metric, goal):
        e, t = res["elastrun"].get(metric), res.get("torchrun", {}).get(metric)
        if not isinstance(e, (int, float)) or not isinstance(t, (int, float)) or e <= 0:
            return f"{'':>9}  goal {goal}"
        return f"{t / e:8.1f}x  goal {goal}"

    t = res.get("torchrun", {})
    e = res["elastrun"]
    print(f"# elastrun {args.elastrun} vs torchrun {args.torchrun if have_torchrun else '(absent)'}; "
          f"medians of {args.reps} runs ((a) agent only, (b): elastrun {args.reps + 1}, torchrun 1); 2 workers, --standalone unless noted")
    print(f"{'metric':<52}{'elastrun':>12}{'torchrun':>12}   torchrun/elastrun")
    rows = [
        ("(a) launch -> first all-reduce done (torch gloo)", "a", ">= 5x"),
        ("    launch -> worker process started", "a_start", ">= 5x"),
        ("    agent only: whole run of 2 x /bin/true", "a0", ">= 5x"),
        ("(b) worker crash -> replacement started", "b", ">= 10x"),
        ("    crash -> replacements' first all-reduce", "b_allreduce", ">= 10x"),
        ("    the same, elastrun --preload=torch", "b_allreduce_preload", "<= 0.6 s"),
        ("(c) node loss (kill -9 agent+workers) -> re-formed", "c", "report"),
    ]
    for label, key, goal in rows:
        ev, tv = e.get(key), t.get(key)
        tv_s = fmt_s(tv) if not isinstance(tv, str) else ""
        print(f"{label:<52}{fmt_s(ev):>12}{tv_s:>12}   {ratio(key, goal) if goal else ''}")
        if isinstance(tv, str):
            print(f"{'':<52}{'':>12}  torchrun: {tv}")
        if isinstance(ev, str):
            print(f"{'':<52}  elastrun: {ev}")
    if "d" not in e:
        print("(d) agent peak RSS: not sampled (measured while (a), (b) or (c) run; add one to --only)")
        return
    d_e, d_t = e["d"], t.get("d")
    print(f"{'(d) agent peak RSS (VmHWM)':<52}{d_e:9.1f} MB{(f'{d_t:9.1f} MB' if d_t else ''):>12}   "
          f"{(f'{d_t / d_e:8.1f}x' if d_t and d_e else ''):>9}  goal elastrun <= 10 MB")
    a_e, a_t = e["d_anon"], t.get("d_anon")
    print(f"{'    of which private (RssAnon; the rest: shared libs)':<52}{a_e:9.1f} MB{(f'{a_t:9.1f} MB' if a_t else ''):>12}   "
          f"{(f'{a_t / a_e:8.1f}x' if a_t and a_e else ''):>9}")
    ok = lambda c: "met" if c else "NOT met"
    if t:
        checks = []
        if isinstance(e.get("a"), float) and isinstance(t.get("a"), float):
            checks.append(f"(a) {ok(e['a'] * 5 <= t['a'])}")
        if isinstance(e.get("b"), float) and isinstance(t.get("b"), float):
            checks.append(f"(b) {ok(e['b'] * 10 <= t['b'])}")
        checks.append(f"(d) {ok(d_e <= 10)}")
        print("# goals: " + ", ".join(checks))


if __name__ == "__main__":
    main()
