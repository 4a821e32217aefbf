#!/usr/bin/python3
"""testbed_bench: elastrun vs torchrun 1.13 on the local Slurm testbed (4 nodes x 2 workers under
srun, one launcher per node), alternated, on a private testbed of its own. Never asserts.

  launch      srun start -> every worker process started, and -> every worker's first gloo
              all-reduce done (torch workers of bench/launcher_bench.py);
  node_loss   `testbed kill-node n3` while training -> every survivor's replacement worker started,
              and -> every survivor's first all-reduce in the smaller world (elastrun: --nnodes 2:4, re-formed from Slurm's view; torchrun:
              --nnodes 2:4 --max_restarts 3, bounded wait: "did not recover in N s");
  store_loss  `testbed kill-node` of the node hosting the rendezvous store (elastrun: n1, the
              step's first node; torchrun: whichever agent bound the c10d store) -> survivors'
              first all-reduce at world 6; torchrun's job dies: its srun's exit code is reported.
  node_loss_warm  elastrun only (torchrun has neither), run beside node_loss: the same kill of n3
              with `--preload=torch --memory-checkpoints=64M` and workers that train from the agents'
              memory (launcher_bench.py's `train`: a 1 MiB model snapshotted every step) -> every
              survivor's replacement started, first all-reduce, and first training step at world 6
              (resumed from the survivors' memory).
  For every elastrun loss run, from the agents' event logs: kill -> the first survivor's member_lost
  (detection), and the agent's share of the re-form: on each survivor, its member_lost -> its
  workers_started at world 6 (the largest).
Usage: /usr/bin/python3 bench/testbed_bench.py --elastrun build/bin/elastrun --json OUT [--reps N]
       [--bound S] [--only launch,node_loss,node_loss_warm,store_loss]
Environment: TESTBED_ID for the private testbed (default bench-tb).
"""
import argparse
import glob
import json
import os
import re
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = "/usr/bin/python3"
WORKER = os.path.join(HERE, "launcher_bench.py")
TB = os.path.join(ROOT, "tests", "cluster", "testbed")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stamps(out, pattern):
    vals = []
    for p in glob.glob(os.path.join(out, pattern)):
        if p.endswith(".tmp"):
            continue
        try:
            with open(p) as f:
                vals.append((os.path.basename(p), float(f.read())))
        except (OSError, ValueError):
            pass
    return vals


class Testbed:
    def __init__(self, tb_id):
        self.env = dict(os.environ, TESTBED_ID=tb_id)
        for k in list(self.env):
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_")):
                del self.env[k]

    def call(self, *args, timeout=300):
        return subprocess.run([TB, *args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)

    def up(self):
        self.call("down")
        r = self.call("up", "4")
        if r.returncode != 0:
            raise RuntimeError(f"testbed up 4 failed: {r.stderr.strip().splitlines()[-1:]}")
        for line in self.call("env").stdout.splitlines():
            if line.startswith("export SLURM_CONF="):
                self.env["SLURM_CONF"] = line.split("=", 1)[1].strip("'\"")

    def down(self):
        self.call("down")


def reform_share(out, killed, victim):
    """From the agents' event logs (the job directory): kill -> the first survivor's member_lost, and
    the largest of each survivor's member_lost -> its workers_started after the kill."""
    first_lost, shares = None, []
    for path in glob.glob(os.path.join(out, "job-*", "events-*.jsonl")):
        lost = started = None
        with open(path, errors="replace") as f:
            for line in f:
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("node") == victim or e.get("time", 0) < killed:
                    continue
                if e.get("event") == "member_lost" and lost is None:
                    lost = e["time"]
                elif e.get("event") == "workers_started" and lost is not None and started is None:
                    started = e["time"]
        if lost is not None:
            first_lost = lost if first_lost is None else min(first_lost, lost)
            if started is not None:
                shares.append(started - lost)
    result = {}
    if first_lost is not None:
        result["detected_s"] = first_lost - killed
    if shares:
        result["agent_share_s"] = max(shares)
    return result


class Bench:
    def __init__(self, args, tb):
        self.args, self.tb = args, tb
        self.work = args.work

    def argv(self, which, mode, out, nnodes, port, warm=False):
        srun = ["srun", "--no-kill", "-N4", "--ntasks-per-node=1", "--job-name", f"bench-{which}"]
        if which == "elastrun":
            extra = ["--preload=torch", "--memory-checkpoints=64M"] if warm else []
            return srun + [self.args.elastrun, f"--nnodes={nnodes}", "--nproc-per-node=2", *extra, WORKER, "--worker",
                           mode, out]
        return srun + [PY, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc_per_node", "2",
                       "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"bench{port}",
                       "--max_restarts", "3", "--redirects", "9:0", "--tee", "9:0", WORKER, "--worker", mode, out]

    def start(self, which, mode, name, nnodes, warm=False):
        out = os.path.join(self.work, f"{name}-{which}-{time.time_ns()}")
        os.makedirs(out)
        # the agents' job directory (on by default under Slurm) goes with this run's files, not the cwd
        env = dict(self.tb.env, BENCH_TAG="x", ELASTRUN_PYTHON=PY, ELASTRUN_JOB_DIR=os.path.join(out, "job-%j"),
                   ELASTRUN_INDEX_DIR=os.path.join(self.work, "index"))
        if warm:  # the workers' elastrun.memory: the build's package
            package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(self.args.elastrun))), "python")
            env["PYTHONPATH"] = os.pathsep.join(p for p in (package, env.get("PYTHONPATH")) if p)
        log = open(os.path.join(out, "srun.log"), "wb")
        t0 = time.time()
        proc = subprocess.Popen(self.argv(which, mode, out, nnodes, free_port(), warm), env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return out, proc, t0, log

    def finish(self, out, proc, log, timeout=60):
        with open(os.path.join(out, "stop"), "w"):
            pass
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", "--name", "bench-elastrun", "--name", "bench-torchrun"], env=self.tb.env)
            proc.kill()
            rc = proc.wait()
        log.close()
        return rc

    def wait_for(self, out, pattern, count, proc, bound):
        deadline = time.time() + bound
        while time.time() < deadline:
            got = stamps(out, pattern)
            if len(got) >= count:
                return got
            if proc.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def launch(self, which):
        out, proc, t0, log = self.start(which, "once", "launch", "4")
        started = self.wait_for(out, "start.*", 8, proc, 180)
        done = self.wait_for(out, "allreduce.*", 8, proc, 180)
        rc = self.finish(out, proc, log, 120)
        if not started or not done or rc != 0:
            return {"error": f"srun exit {rc}, {len(stamps(out, 'start.*'))} of 8 workers started"}
        return {"started_s": max(v for _, v in started) - t0, "allreduce_s": max(v for _, v in done) - t0}

    def store_node(self, which, out):
        if which == "elastrun":
            return "n1"  # the store runs beside group rank 0's agent, on the step's first node
        # torchrun: the agent that bound the c10d store (every node is 127.0.0.1 here, so the first
        # agent to bind it wins): the torchrun process of this run that listens on a TCP port
        listening = subprocess.run(["ss", "-Htlnp"], stdout=subprocess.PIPE, text=True).stdout
        for p in glob.glob("/proc/[0-9]*/cmdline"):
            pid = p.split("/")[2]
            try:
                with open(p, "rb") as f:
                    cmd = f.read().split(b"\0")
                if b"torch.distributed.run" not in cmd or out.encode() not in cmd or f"pid={pid}," not in listening:
                    continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    for entry in f.read().split(b"\0"):
                        if entry.startswith(b"SLURMD_NODENAME="):
                            return entry.split(b"=", 1)[1].decode()
            except OSError:
                continue
        return None

    def loss(self, which, scenario):
        warm = scenario == "node_loss_warm"
        out, proc, t0, log = self.start(which, "train" if warm else "steps", scenario, "2:4", warm)
        result = {}
        try:
            if not self.wait_for(out, "allreduce.x.*.8.*", 8, proc, 180):
                return {"error": f"no round of 8 workers (srun {'running' if proc.poll() is None else 'exited'})"}
            time.sleep(1.0)
            victim = "n3" if scenario.startswith("node_loss") else self.store_node(which, out)
            if not victim:
                return {"error": "could not tell which node hosts the store"}
            result["victim"] = victim
            called = time.time()
            r = self.tb.call("kill-node", victim)
            if r.returncode != 0:
                return {"error": f"kill-node {victim} failed: {r.stderr.strip()}"}
            # the node fails at the testbed's first SIGSTOP of its processes: what kill-node does
            # before (scanning /proc for the node's processes, in bash) is the testbed's time
            stopped = re.search(r"stopped at ([0-9]+(?:\.[0-9]+)?)", r.stderr)
            killed = float(stopped.group(1)) if stopped else called
            result["kill_scan_s"] = killed - called
            restarted = self.wait_for(out, "start.x.*.6.*", 6, proc, self.args.bound)
            if restarted:  # the launcher's share: every survivor's replacement worker started
                result["restarted_s"] = max(v for _, v in restarted) - killed
            got = self.wait_for(out, "allreduce.x.*.6.*", 6, proc, max(1.0, killed + self.args.bound - time.time()))
            if got:
                result["recovered_s"] = max(v for _, v in got) - killed
                if warm:
                    stepped = self.wait_for(out, "step.x.*.6.*", 6, proc, 30)
                    if stepped:
                        result["first_step_s"] = max(v for _, v in stepped) - killed
                if which == "elastrun":
                    result.update(reform_share(out, killed, victim))
            else:
                result["not_recovered_within_s"] = self.args.bound
                if proc.poll() is not None:
                    result["srun_exit"] = proc.returncode
                    result["ended_after_s"] = time.time() - killed
            return result
        finally:
            rc = self.finish(out, proc, log, 60)
            result.setdefault("srun_exit", rc)
            if result.get("victim"):  # back in service for the next run (restarts its slurmd)
                r = self.tb.call("revive-node", result["victim"])
                if r.returncode != 0:
                    raise RuntimeError(f"revive-node {result['victim']} failed: {r.stderr.strip()}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elastrun", default=os.path.join(ROOT, "build", "bin", "elastrun"))
    p.add_argument("--json", required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bound", type=float, default=90.0, help="how long to wait for a recovery (s)")
    p.add_argument("--only", default="launch,node_loss,node_loss_warm,store_loss")
    p.add_argument("--work", default=None)
    p.add_argument("--keep-work", action="store_true", help="keep the job directories (event logs) for a look")
    args = p.parse_args()
    only = args.only.split(",")
    args.work = args.work or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"elastrun-testbed-bench-{os.getpid()}")
    os.makedirs(args.work, exist_ok=True)
    tb = Testbed(os.environ.get("TESTBED_ID", "bench-tb"))
    raw = {"reps": args.reps, "bound_s": args.bound, "elastrun": {}, "torchrun": {}}
    try:
        tb.up()
        b = Bench(args, tb)
        for scenario in ("launch", "node_loss", "node_loss_warm", "store_loss"):
            if scenario not in only:
                continue
            for rep in range(args.reps):
                for which in ("elastrun",) if scenario == "node_loss_warm" else ("elastrun", "torchrun"):
                    print(f"[testbed_bench] {scenario} {rep + 1}/{args.reps}: {which}", file=sys.stderr, flush=True)
                    try:
                        res = b.launch(which) if scenario == "launch" else b.loss(which, scenario)
                    except Exception as e:  # a benchmark reports, it does not stop
                        res = {"error": str(e)}
                    raw[which].setdefault(scenario, []).append(res)
    finally:
        tb.down()
        if not args.keep_work:
            subprocess.run(["rm", "-rf", args.work])
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


if __name__ == "__main__":
    main()
