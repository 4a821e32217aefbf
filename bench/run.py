#!/usr/bin/python3
"""bench/run.py -- every benchmark figure of elastrun against its anchor, measured in the same run.

`scripts/bench` runs this (after building). Each figure pairs an elastrun measurement with its
anchor (the reference tool, the storage limit, or where no tool exists, the goal), both measured
here, alternated A B A B ... over --runs rounds (default 5); `--quick` does one small round of each.
Outputs, in --out (default bench/results; --quick: build/bench-results):
    latest.json   every run's raw numbers, machine, git commit, time, and the figures
    report.md     method, machine, the table, what each figure means; charts *.png beside it
and a table on the terminal. Never asserts a timing: figures are reported, goals marked met or not.

Groups (--only, comma-separated): storage, ckpt, memory, launcher, testbed, rdzv. The checkpoint and storage figures
are measured on the local disk (--dir, default /tmp) and, where this machine can give one, on a
GlusterFS volume of a private testbed (tests/cluster/testbed up 1 --shared-fs; --no-shared-fs
skips it), each against the same volume's storage limit.
Run with Debian's /usr/bin/python3 (torch 1.13, h5py, matplotlib).
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = "/usr/bin/python3"
SCHEMA = "elastrun-bench/1"
GROUPS = ("storage", "ckpt", "memory", "launcher", "testbed", "rdzv")


def log(msg):
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(argv, timeout, **kw):
    """Runs argv; returns CompletedProcess (never raises on a non-zero exit)."""
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout, **kw)


def stats(values):
    xs = [v for v in values if isinstance(v, (int, float))]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


# ------------------------------------------------------------------------------------------ probes
class Storage:
    """The storage limit of one filesystem: fio (1 and 4 jobs; buffered with an fsync at the end, and
    O_DIRECT; 4 MiB blocks) and dd (4 writers, conv=fdatasync), writes and cached reads; bytes/s."""

    def __init__(self, path, mib_total):
        self.path, self.mib = path, mib_total

    def fio(self, rw, jobs, direct):
        d = tempfile.mkdtemp(prefix="fio-", dir=self.path)
        try:
            size = max(4, self.mib // jobs)
            argv = ["fio", "--name=limit", f"--directory={d}", f"--rw={rw}", "--bs=4m", f"--size={size}m",
                    f"--numjobs={jobs}", f"--direct={1 if direct else 0}", "--ioengine=psync", "--group_reporting",
                    "--output-format=json"]
            if rw == "write":
                argv.append("--end_fsync=1")
            else:  # lay the files out first (not timed), then read them
                r = run(argv[:3] + ["--rw=write"] + argv[4:] + ["--end_fsync=1"], 600)
                if r.returncode != 0:
                    return None
            r = run(argv, 600)
            if r.returncode != 0:
                return None
            job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
            return float(job[rw]["bw_bytes"]) or None
        except (ValueError, KeyError, subprocess.TimeoutExpired):
            return None
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def dd(self, writers=4, read=False, path=None):
        d = tempfile.mkdtemp(prefix="dd-", dir=path or self.path)
        try:
            per = max(1, self.mib // writers)
            files = [os.path.join(d, f"dd{i}") for i in range(writers)]

            def batch(argvs):
                t0 = time.perf_counter()
                procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for a in argvs]
                ok = all(p.wait() == 0 for p in procs)
                return time.perf_counter() - t0 if ok else None

            w = batch([["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={per}", "conv=fdatasync"] for f in files])
            if not read:
                return per * writers * 2**20 / w if w else None
            r = batch([["dd", f"if={f}", "of=/dev/null", "bs=1M"] for f in files])
            return per * writers * 2**20 / r if r else None
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def measure(self):
        out = {
            "dd_write": self.dd(),
            "fio_write_1job": self.fio("write", 1, False),
            "fio_write_4jobs": self.fio("write", 4, False),
            "fio_write_direct_1job": self.fio("write", 1, True),
            "fio_write_direct_4jobs": self.fio("write", 4, True),
            "dd_read_cached": self.dd(read=True),
            "fio_read_cached_4jobs": self.fio("read", 4, False),
            "fio_read_direct_4jobs": self.fio("read", 4, True),
        }
        writes = [v for k, v in out.items() if "write" in k and v]
        reads = [v for k, v in out.items() if "read" in k and v]
        out["write_limit"] = max(writes) if writes else None
        out["read_limit"] = max(reads) if reads else None
        return out


def probe_ckpt(bin_dir, path, mib_per_rank, tensors, work):
    """One run of ckpt_bench (4 MPI ranks, both layouts, sync/async/load/resharded load)."""
    out = os.path.join(work, "ckpt_bench.json")
    argv = ["mpirun", "--oversubscribe", "-np", "4"]
    if os.getuid() == 0:
        argv.append("--allow-run-as-root")
    argv += [os.path.join(bin_dir, "ckpt_bench"), "--dir", path, "--mib-per-rank", str(mib_per_rank),
             "--tensors", str(tensors), "--repeats", "1", "--json", out]
    env = dict(os.environ, OMPI_MCA_btl="self,vader,tcp")
    r = run(argv, 1800, env=env)
    if r.returncode != 0 or not os.path.exists(out):
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]}
    with open(out) as f:
        return json.load(f)


def python_env(bin_dir):
    """The environment with the build's elastrun Python package (build/python) importable."""
    package = os.path.join(os.path.dirname(os.path.abspath(bin_dir)), "python")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p))


def probe_ckpt_anchors(path, mib_per_rank, tensors, bin_dir):
    """torch.save/torch.load per rank, h5py per rank, torch.distributed.checkpoint, and the elastrun
    Python package on the same tensors: seconds (the package's peak extra memory: bytes)."""
    r = run([PY, os.path.join(HERE, "ckpt_torch_compare.py"), path, "--ranks", "4", "--mib-per-rank", str(mib_per_rank),
             "--tensors", str(tensors)], 1800, env=python_env(bin_dir))
    out = {"notes": []}
    for line in r.stdout.splitlines():
        if line.startswith("#"):
            out["notes"].append(line[1:].strip())
            continue
        parts = line.split("\t")
        if len(parts) == 3:
            out[parts[0]] = float(parts[1])
    if r.returncode != 0:
        out["notes"].append(f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] }")
    return out


def probe_python_import(bin_dir):
    """Seconds to import elastrun.checkpoint, and DCP (1.13's torch.distributed._shard.checkpoint,
    with the benchmark's shim), each in a fresh interpreter that already imported torch."""
    timed = ("import sys, time, torch; sys.path.insert(0, {here!r}); import ckpt_torch_compare as c; "
             "c.lenient_dataclass_defaults(); t = time.perf_counter(); import {module}; "
             "print(time.perf_counter() - t)")
    out = {}
    for key, module in (("elastrun", "elastrun.checkpoint"), ("dcp", "torch.distributed._shard.checkpoint")):
        r = run([PY, "-c", timed.format(here=HERE, module=module)], 300, env=python_env(bin_dir))
        try:
            out[key] = float(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            out[key] = None
            out.setdefault("errors", []).append(f"{module}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return out


# ------------------------------------------------------------------------------------------ figures
class Figures:
    def __init__(self):
        self.items = []

    def add(self, fid, group, title, unit, better, ours, anchor_name, anchor, goal=None, note="", why=None):
        """ours/anchor: lists of per-run values (None = a run that failed). better: 'higher' or 'lower'
        (for ours). goal: (op, value, text) on the ratio, ratio = how many times better ours is
        (anchor/ours for 'lower', ours/anchor for 'higher'): a goal "ours <= 1.2x the anchor" is
        ratio >= 1/1.2."""
        o, a = stats(ours), stats(anchor)
        ratio = None
        if o and a and o["median"] > 0 and a["median"] > 0:
            ratio = o["median"] / a["median"] if better == "higher" else a["median"] / o["median"]
        met = None
        if goal and ratio is not None:
            op, value, _ = goal
            met = ratio >= value if op == ">=" else ratio <= value
        fig = {"id": fid, "group": group, "title": title, "unit": unit, "better": better,
               "elastrun": {"runs": ours, **(o or {})}, "anchor": {"name": anchor_name, "runs": anchor, **(a or {})},
               "ratio": ratio, "goal": goal[2] if goal else None, "met": met, "note": note}
        if why or not o or not a:
            fig["not_measured"] = why or ("elastrun side failed" if not o else f"anchor '{anchor_name}' failed")
        self.items.append(fig)


def gbs(nbytes, seconds):
    return [nbytes / s / 1e9 if s else None for s in seconds]


def ckpt_figures(figs, fs, rounds):
    """rounds: list of {"storage":..., "ours":..., "anchors":...}"""
    ok = [r for r in rounds if "error" not in r["ours"]]
    if not ok:
        why = rounds[0]["ours"].get("error") if rounds else "not run"
        figs.add(f"ckpt.{fs}.save", "ckpt", f"[{fs}] sync save, file-per-rank", "GB/s", "higher", [], "storage limit",
                 [], why=f"ckpt_bench failed: {why}")
        return
    total = ok[0]["ours"]["total_bytes"]
    shard = ok[0]["ours"]["shard_bytes"]
    one = lambda key: [r["ours"][key][0] if r["ours"].get(key) else None for r in ok]
    limit = [r["storage"]["write_limit"] / 1e9 if r["storage"]["write_limit"] else None for r in ok]
    read_limit = [r["storage"]["read_limit"] / 1e9 if r["storage"]["read_limit"] else None for r in ok]
    anchor = lambda name: [r["anchors"].get(name) for r in ok]
    size = f"{total / 2**30:.2f} GiB over 4 ranks, {ok[0]['ours']['tensors']} tensors"
    save = gbs(total, one("save_file_per_rank_s"))
    shared = gbs(total, one("save_shared_file_s"))
    load = gbs(total, one("load_verified_s"))
    figs.add(f"ckpt.{fs}.save_vs_limit", "ckpt", f"[{fs}] sync save, file-per-rank vs storage limit", "GB/s", "higher",
             save, "storage limit (best of fio and dd)", limit, (">=", 0.9, ">= 0.9x"), size)
    figs.add(f"ckpt.{fs}.save_shared_vs_limit", "ckpt", f"[{fs}] sync save, MPI-IO shared file vs storage limit", "GB/s",
             "higher", shared, "storage limit (best of fio and dd)", limit, (">=", 0.9, ">= 0.9x"), size)
    figs.add(f"ckpt.{fs}.save_vs_dcp", "ckpt", f"[{fs}] sync save vs torch.distributed.checkpoint save", "GB/s",
             "higher", save, "DCP save (torch 1.13)", gbs(total, anchor("torch.distributed.checkpoint save")),
             (">=", 2.0, ">= 2x"), size)
    figs.add(f"ckpt.{fs}.save_vs_torch_save", "ckpt", f"[{fs}] sync save vs torch.save per rank", "GB/s", "higher", save,
             "torch.save per rank", gbs(total, anchor("torch.save per rank")), None, size)
    figs.add(f"ckpt.{fs}.save_vs_h5py", "ckpt", f"[{fs}] sync save vs h5py per rank", "GB/s", "higher", save,
             "h5py, one file per rank", gbs(total, anchor("h5py save per rank")), None, size)
    figs.add(f"ckpt.{fs}.load_vs_torch_load", "ckpt", f"[{fs}] load into existing tensors (hashes verified) vs torch.load",
             "GB/s", "higher", load, "torch.load + load_state_dict per rank", gbs(total, anchor("torch.load per rank")),
             (">=", 4.0, ">= 4x"), "the shared-file step; page cache warm for both")
    figs.add(f"ckpt.{fs}.load_vs_dcp", "ckpt", f"[{fs}] load vs DCP load", "GB/s", "higher", load, "DCP load (torch 1.13)",
             gbs(total, anchor("torch.distributed.checkpoint load")), None, "page cache warm for both")
    figs.add(f"ckpt.{fs}.resharded_load_vs_read_limit", "ckpt", f"[{fs}] resharded load 4 -> 3 ranks vs read limit",
             "GB/s", "higher", gbs(total, one("load_resharded_s")), "read limit (best of fio and dd, cached)", read_limit,
             None, "hashes verified")
    blocked = one("async_copy_blocked_s")
    figs.add(f"ckpt.{fs}.async_blocking_vs_memcpy", "ckpt", f"[{fs}] async save: training blocked vs memcpy of the shard",
             "s", "lower", blocked, "memcpy of the shard into warm memory", [min(r["ours"]["memcpy_shard_s"]) for r in ok],
             (">=", 1 / 1.2, "<= 1.2x the memcpy"), "copy snapshot (the default)")
    figs.add(f"ckpt.{fs}.async_durable_vs_sync", "ckpt", f"[{fs}] async save: until durable vs a sync save", "s", "lower",
             one("async_copy_durable_s"), "sync save (file-per-rank)", one("save_file_per_rank_s"), None,
             "training goes on meanwhile")
    python_figures(figs, fs, ok, total, shard, limit, anchor, size)
    extra = [r["ours"].get("peak_extra_sync_bytes") for r in ok]
    figs.add(f"ckpt.{fs}.extra_memory_vs_shard", "ckpt", f"[{fs}] peak extra memory during a sync save vs the shard",
             "MiB", "lower", [e / 2**20 if e is not None else None for e in extra], "one shard", [shard / 2**20] * len(ok),
             (">=", 1 / 1.1, "<= 1.1x the shard"), "VmHWM rise, max over ranks",
             why=None if any(e is not None for e in extra) else "/proc/self/clear_refs not writable")


def python_figures(figs, fs, ok, total, shard, limit, anchor, size):
    """The elastrun Python package (elastrun.checkpoint) on the same tensors as the anchors."""
    py = lambda what: anchor(f"elastrun.checkpoint {what} (Python)")
    why = None if any(py("save")) else "the elastrun Python package is not built (build/python)"
    save, load = gbs(total, py("save")), gbs(total, py("load"))
    figs.add(f"ckpt.{fs}.python_save_vs_dcp", "ckpt", f"[{fs}] Python elastrun.checkpoint.save vs DCP save", "GB/s",
             "higher", save, "DCP save (torch 1.13)", gbs(total, anchor("torch.distributed.checkpoint save")),
             (">=", 2.0, ">= 2x"), size, why=why)
    figs.add(f"ckpt.{fs}.python_save_vs_torch_save", "ckpt", f"[{fs}] Python save vs torch.save per rank", "GB/s",
             "higher", save, "torch.save per rank", gbs(total, anchor("torch.save per rank")), (">=", 1.5, ">= 1.5x"),
             size, why=why)
    figs.add(f"ckpt.{fs}.python_save_vs_limit", "ckpt", f"[{fs}] Python save vs storage limit", "GB/s", "higher", save,
             "storage limit (best of fio and dd)", limit, (">=", 0.9, ">= 0.9x"), size, why=why)
    figs.add(f"ckpt.{fs}.python_load_vs_torch_load", "ckpt", f"[{fs}] Python load in place (verified) vs torch.load",
             "GB/s", "higher", load, "torch.load + load_state_dict per rank", gbs(total, anchor("torch.load per rank")),
             (">=", 4.0, ">= 4x"), "page cache warm for both", why=why)
    figs.add(f"ckpt.{fs}.python_load_vs_dcp", "ckpt", f"[{fs}] Python load vs DCP load", "GB/s", "higher", load,
             "DCP load (torch 1.13)", gbs(total, anchor("torch.distributed.checkpoint load")), None,
             "page cache warm for both", why=why)
    figs.add(f"ckpt.{fs}.python_async_blocking_vs_memcpy", "ckpt",
             f"[{fs}] Python AsyncSaver: training blocked vs memcpy of the shard", "s", "lower", py("async blocked"),
             "memcpy of the shard (torch copy_, warm)", anchor("memcpy of the shard (Python)"),
             (">=", 1 / 1.2, "<= 1.2x the memcpy"), "max over ranks; staging buffer warm", why=why)
    extra = py("peak extra bytes")
    figs.add(f"ckpt.{fs}.python_extra_memory_vs_shard", "ckpt", f"[{fs}] Python sync save: peak extra memory vs the shard",
             "MiB", "lower", [e / 2**20 if e is not None else None for e in extra], "one shard",
             [shard / 2**20] * len(ok), (">=", 1 / 1.1, "<= 1.1x the shard"), "VmHWM rise, max over ranks",
             why=why or (None if any(e is not None for e in extra) else "/proc/self/clear_refs not writable"))


def python_import_figure(figs, samples):
    ours = [s.get("elastrun") for s in samples]
    figs.add("ckpt.python_import", "ckpt", "import elastrun.checkpoint (torch already imported) vs DCP's import", "s",
             "lower", ours, "import torch.distributed._shard.checkpoint", [s.get("dcp") for s in samples], None,
             "a fresh interpreter each", why=None if any(ours) else f"import failed: {samples[0].get('errors') if samples else '?'}")


def storage_figures(figs, fs, samples, shm=None):
    get = lambda k: [s.get(k) / 1e9 if s.get(k) else None for s in samples]
    best_fio = [max([v for k, v in s.items() if k.startswith("fio_write") and v] or [0]) / 1e9 or None for s in samples]
    figs.add(f"storage.{fs}.write_fio_vs_dd", "storage", f"[{fs}] write limit: best fio vs dd conv=fdatasync", "GB/s",
             "higher", best_fio, "dd, 4 writers, conv=fdatasync", get("dd_write"), None,
             "fio: 1 and 4 jobs, buffered + fsync at the end and O_DIRECT, 4 MiB blocks; the ceiling is the best of all")
    best_read = [max([v for k, v in s.items() if k.startswith("fio_read") and v] or [0]) / 1e9 or None for s in samples]
    figs.add(f"storage.{fs}.read_fio_vs_dd", "storage", f"[{fs}] read limit: best fio vs dd (cached)", "GB/s", "higher",
             best_read, "dd, 4 readers, page cache warm", get("dd_read_cached"), None, "fio: buffered (cached) and O_DIRECT")
    if shm is not None:
        figs.add(f"storage.{fs}.write_vs_shm", "storage", f"[{fs}] write limit vs /dev/shm (memory)", "GB/s", "higher",
                 [s["write_limit"] / 1e9 if s.get("write_limit") else None for s in samples], "dd into /dev/shm, 4 writers",
                 [v / 1e9 if v else None for v in shm], None, "how far the disk is from memory speed")


def launcher_figures(figs, raw, nprocs, why=None):
    if why:
        figs.add("launcher.launch_share", "launcher", "launch -> every worker started", "s", "lower", [], "torchrun", [],
                 why=why)
        return
    e, t = raw["launchers"].get("elastrun", {}), raw["launchers"].get("torchrun", {})
    for n in nprocs:
        figs.add(f"launcher.launch_share_{n}procs", "launcher", f"standalone, {n} procs: launch -> every worker started",
                 "s", "lower", e.get(f"a_start{n}", []), "torchrun 1.13", t.get(f"a_start{n}", []),
                 (">=", 10.0, ">= 10x"), "the launcher's own share")
        figs.add(f"launcher.first_allreduce_{n}procs", "launcher",
                 f"standalone, {n} procs: launch -> first all-reduce in every worker", "s", "lower",
                 e.get(f"a{n}", []), "torchrun 1.13", t.get(f"a{n}", []), None, "dominated by `import torch` (~1 s)")
    figs.add("launcher.crash_allreduce", "launcher", "worker exit -> every replacement's first all-reduce done",
             "s", "lower", e.get("b_allreduce", []), "torchrun 1.13", t.get("b_allreduce", []), (">=", 10.0, ">= 10x"),
             "2 torch workers, rank 0 exits 1 after its first all-reduce; includes the replacements' `import torch`")
    preloaded = e.get("b_allreduce_preload", [])
    if preloaded:
        note = ("elastrun --preload=torch: the replacements are forks of a preloader that imported torch once; "
                "the same workers and crash as above")
        figs.add("launcher.crash_allreduce_preload", "launcher",
                 "worker exit -> every replacement's first all-reduce done, elastrun --preload=torch", "s", "lower",
                 preloaded, "torchrun 1.13", t.get("b_allreduce", []), None, note)
        figs.add("launcher.crash_allreduce_preload_vs_plain", "launcher",
                 "the same, --preload=torch vs elastrun without it (same run)", "s", "lower", preloaded,
                 "elastrun without --preload", e.get("b_allreduce", []), None, "what the preloader saves: `import torch`")
        figs.add("launcher.crash_allreduce_preload_vs_goal", "launcher",
                 "(goal) worker exit -> every replacement's first all-reduce done, --preload=torch", "s", "lower",
                 preloaded, "goal: 0.6 s", [0.6] * len(preloaded), (">=", 1.0, "<= 0.6 s"), note)
    figs.add("launcher.crash_restart", "launcher", "worker exit -> replacement process started", "s", "lower",
             e.get("b", []), "torchrun 1.13", t.get("b", []), (">=", 10.0, ">= 10x"), "shell workers: the launcher's share")
    c_e, c_t = e.get("c"), t.get("c")
    bound = raw.get("node_loss_bound_s")
    note = "; ".join(f"{w}: {v}" for w, v in (("elastrun", c_e), ("torchrun", c_t)) if isinstance(v, str))
    if isinstance(c_t, str) and c_t.startswith(">") and bound:
        # torchrun did not recover within the bounded wait: the bound is a lower bound of its time
        note = f"torchrun did not recover within {bound:.0f} s: its figure is that lower bound. " + note
        c_t = float(bound)
    figs.add("launcher.node_loss_standalone", "launcher", "two agents on one machine, one SIGKILLed -> survivor's worker "
             "restarted at world 1", "s", "lower", [c_e if isinstance(c_e, (int, float)) else None], "torchrun 1.13",
             [c_t if isinstance(c_t, (int, float)) else None], None, note)
    secs = e.get("cpu_run_s", 60)
    figs.add("launcher.agent_cpu", "launcher", f"agent CPU seconds over a {secs} s run (2 idle workers)", "s", "lower",
             e.get("cpu_s", []), "torchrun's agent", t.get("cpu_s", []), None, "utime + stime of the agent process")
    figs.add("launcher.agent_peak_rss", "launcher", f"agent peak RSS (VmHWM) over the {secs} s run", "MiB", "lower",
             e.get("cpu_run_rss_mib", []), "torchrun's agent", t.get("cpu_run_rss_mib", []), None,
             f"over all launcher runs: elastrun {e.get('rss_peak_kib', 0) / 1024:.1f} MiB, "
             f"torchrun {t.get('rss_peak_kib', 0) / 1024:.1f} MiB")


def memory_figures(figs, raw, why=None):
    if why or not raw or "error" in raw:
        figs.add("memory.snapshot_blocked", "memory", "training blocked per memory snapshot", "s", "lower", [],
                 "memcpy of the shard", [], why=why or (raw or {}).get("error", "not run"))
        return
    size = f"{raw['nprocs']} ranks x {raw['mib_per_rank']} MiB, all at once; the slowest rank"
    figs.add("memory.snapshot_blocked", "memory",
             "training blocked per memory snapshot (AsyncSaver.save(tier=\"memory\"))", "s", "lower",
             raw.get("snapshot_async_s", []), "memcpy of the shard (touched buffers)", raw["memcpy_warm_s"],
             (">=", 1 / 1.1, "<= 1.1x a memcpy"),
             f"{size}: the copy into the agent's segment (its XXH3 and the commit follow on the saver's thread, "
             "while training runs); steady state (each snapshot reuses the segment retention dropped)")
    figs.add("memory.snapshot_sync", "memory", "the same with save(tier=\"memory\") (committed on return)", "s",
             "lower", raw["snapshot_s"], "memcpy of the shard (touched buffers)", raw["memcpy_warm_s"], None,
             "the copy and its XXH3 in one pass, then the commit: the hash costs about one more memcpy")
    figs.add("memory.snapshot_vs_fresh_memcpy", "memory", "AsyncSaver's snapshot vs a memcpy into fresh memory", "s",
             "lower", raw.get("snapshot_async_s", []), "memcpy into fresh memory", raw["memcpy_fresh_s"], None,
             "what every snapshot would cost if the agent did not reuse segments: fresh pages are faulted in and "
             "zeroed at the first write")
    figs.add("memory.restore_local", "memory", "restore from this node's agent (load(), memory-local)", "s", "lower",
             raw["restore_s"], "memcpy of the shard (touched buffers)", raw["memcpy_warm_s"],
             (">=", 0.5, ">= 0.5x a memcpy's bandwidth"), f"{size}: two votes, the hash check, the copy")
    plain, snap = raw.get("train_step_plain_s", []), raw.get("train_step_snapshot_s", [])
    figs.add("memory.train_slowdown", "memory",
             f"CPU-bound training step with a {raw['train_mib']} MiB AsyncSaver memory snapshot per rank after every "
             "step", "s", "lower",
             snap, "the same steps without snapshots", plain, (">=", 1 / 1.05, "<= 5 % slower"),
             f"{raw['nprocs']} ranks, matrix products (~1 s per step), alternating blocks; one node, so no partner "
             "copies here: what a copy costs the agents is memory.partner_copy_cpu")


def memory_peer_figures(figs, raw, why=None):
    if why or not raw:
        figs.add("memory.restore_partner", "memory", "a lost node's shard fetched from its partner agent", "GB/s",
                 "higher", [], "loopback TCP throughput (one connection, same run)", [], why=why or "not run")
        return
    figs.add("memory.restore_partner", "memory", f"a lost node's shard ({raw['mib']} MiB) fetched from its partner agent",
             "GB/s", "higher", raw["fetch_gbs"], "loopback TCP throughput (one connection, same run)", raw["tcp_gbs"],
             (">=", 0.7, ">= 0.7x loopback TCP"),
             "peer_fetch (bench/memory_peers_bench.cpp): an authenticated request, sendfile from the holder's memfd, "
             "received into memory retention freed before (a node that holds snapshots)")
    figs.add("memory.restore_partner_fresh", "memory", "the same into fresh memory (a spare's first restore)", "GB/s",
             "higher", raw["fetch_fresh_gbs"], "loopback TCP throughput", raw["tcp_gbs"], None,
             "fresh pages are faulted in and zeroed at their first write (see memory.snapshot_vs_fresh_memcpy)")
    figs.add("memory.partner_copy_cpu", "memory", f"CPU seconds per partner copy of {raw['mib']} MiB (sender + receiver)",
             "s", "lower", raw["push_cpu_s"], "loopback TCP of the same bytes (both ends)", raw["tcp_cpu_s"], None,
             "what replication costs the two agents per snapshot sent (both in one process here)")


def testbed_figures(figs, raw, why=None):
    if why:
        figs.add("testbed.launch_share", "testbed", "testbed, 4 nodes x 2 procs: launch -> every worker started", "s",
                 "lower", [], "torchrun 1.13", [], why=why)
        return
    e, t = raw.get("elastrun", {}), raw.get("torchrun", {})

    def values(side, scenario, key):
        return [r.get(key) for r in side.get(scenario, [])]

    def errors(scenario):
        errs = [f"{w}: {r['error']}" for w, side in (("elastrun", e), ("torchrun", t)) for r in side.get(scenario, [])
                if "error" in r]
        return "; ".join(sorted(set(errs)))

    figs.add("testbed.launch_share", "testbed", "testbed, 4 nodes x 2 procs under srun: launch -> every worker started",
             "s", "lower", values(e, "launch", "started_s"), "torchrun 1.13", values(t, "launch", "started_s"),
             (">=", 10.0, ">= 10x"), errors("launch"))
    figs.add("testbed.first_allreduce", "testbed", "testbed, 4 nodes x 2 procs under srun: launch -> first all-reduce "
             "in every worker", "s", "lower", values(e, "launch", "allreduce_s"), "torchrun 1.13",
             values(t, "launch", "allreduce_s"), None, "includes the workers' `import torch`")
    bound = raw.get("bound_s", 90)
    for scenario, title, goal in (
            ("node_loss", "testbed: kill-node n3 -> every survivor's first all-reduce at world 6",
             ("<=", None, "<= heartbeat timeout + 1 s")),
            ("store_loss", "testbed: kill-node of the store's node -> every survivor's first all-reduce at world 6",
             None)):
        ours = values(e, scenario, "recovered_s")
        theirs = []
        notes = []
        for r in t.get(scenario, []):
            if "recovered_s" in r:
                theirs.append(r["recovered_s"])
            elif "not_recovered_within_s" in r:
                theirs.append(float(r["not_recovered_within_s"]))  # a lower bound
                notes.append(f"torchrun did not recover within {r['not_recovered_within_s']:.0f} s"
                             + (f" (its job ended, srun exit {r['srun_exit']}, {r['ended_after_s']:.1f} s after the kill)"
                                if "ended_after_s" in r else f" (srun exit {r.get('srun_exit')})"))
            else:
                theirs.append(None)
        note = "; ".join(sorted(set(notes)))
        if any(isinstance(v, float) for v in theirs) and notes:
            note = "torchrun's figure is a lower bound: " + note
        if errors(scenario):
            note += ("; " if note else "") + errors(scenario)
        figs.add(f"testbed.{scenario}", "testbed", title, "s", "lower", ours, "torchrun 1.13", theirs, None,
                 "includes the replacement workers' `import torch` (6 at once on 2 cores)" + ("; " + note if note else ""))
        restarted_e = values(e, scenario, "restarted_s")
        restarted_t = [r.get("restarted_s", r.get("not_recovered_within_s")) for r in t.get(scenario, [])]
        figs.add(f"testbed.{scenario}_restart", "testbed", title.replace("first all-reduce", "replacement worker started"),
                 "s", "lower", restarted_e, "torchrun 1.13", restarted_t, None,
                 "the launchers' share" + ("; torchrun's figure is the bounded wait where it did not restart workers"
                                          if any("restarted_s" not in r for r in t.get(scenario, [])) else ""))
        if goal:
            hb = 3.0  # the launcher's default heartbeat timeout
            figs.add(f"testbed.{scenario}_vs_goal", "testbed", title.replace("testbed:", "testbed (goal):"), "s", "lower",
                     ours, "goal: heartbeat timeout (3 s) + 1 s", [hb + 1.0] * len(ours), (">=", 1.0, goal[2]),
                     "elastrun detects a dead node by its closed connections, usually well before the heartbeat")
    warm = e.get("node_loss_warm", [])
    if not warm:
        return
    warm_note = ("elastrun --preload=torch --memory-checkpoints: the replacements are forks of each node's preloader "
                 "and resume from the survivors' memory (a 1 MiB model snapshotted every step)")
    if errors("node_loss_warm"):
        warm_note += "; " + errors("node_loss_warm")
    first_step = values(e, "node_loss_warm", "first_step_s")
    figs.add("testbed.node_loss_warm_first_step", "testbed", "testbed: kill-node n3 -> every survivor's first training "
             "step at world 6, --preload=torch + memory tier", "s", "lower", first_step,
             "elastrun without them: first all-reduce", values(e, "node_loss", "recovered_s"), None, warm_note)
    figs.add("testbed.node_loss_warm_vs_goal", "testbed", "testbed (goal): kill-node n3 -> every survivor's first "
             "training step at world 6, --preload=torch + memory tier", "s", "lower", first_step, "goal: 1.5 s",
             [1.5] * len(first_step), (">=", 1.0, "<= 1.5 s"), warm_note)
    figs.add("testbed.node_loss_warm_allreduce", "testbed", "testbed: kill-node n3 -> every survivor's first all-reduce "
             "at world 6, --preload=torch", "s", "lower", values(e, "node_loss_warm", "recovered_s"), "torchrun 1.13",
             [r.get("recovered_s", r.get("not_recovered_within_s")) for r in t.get("node_loss", [])], None,
             warm_note + "; torchrun's figure is its node_loss run's (a lower bound where it did not recover)")
    runs = e.get("node_loss", []) + warm
    shares = [r.get("agent_share_s") for r in runs]
    figs.add("testbed.reform_agent_share", "testbed", "testbed: the agent's share of a re-form (each survivor: "
             "member_lost -> workers_started at world 6, the largest)", "s", "lower", shares, "goal: 0.2 s",
             [0.2] * len(shares), (">=", 1.0, "<= 0.2 s"), "from the agents' event logs of every kill-node n3 run above")
    detected = [r.get("detected_s") for r in runs]
    scans = sorted(r["kill_scan_s"] for r in runs if "kill_scan_s" in r)
    scan_note = f"; kill-node's own scan before its first SIGSTOP (not counted): median {scans[len(scans) // 2]:.2f} s" \
        if scans else ""
    figs.add("testbed.node_loss_detected", "testbed", "testbed: kill-node n3 -> the first survivor's member_lost",
             "s", "lower", detected, "heartbeat timeout (3 s)", [3.0] * len(detected), None,
             "detection: the rest of the time to the first step is the re-form, the workers' start and their work"
             + scan_note)


def rdzv_figures(figs, raw, why=None):
    if why:
        figs.add("rdzv.round", "rdzv", "rendezvous round", "ms", "lower", [], "goal", [], why=why)
        return
    goal_ms = {1024: 300.0}
    for n, runs in sorted(raw["rounds_ms"].items(), key=lambda item: int(item[0])):
        n = int(n)
        if isinstance(runs, dict):
            figs.add(f"rdzv.round_{n}", "rdzv", f"rendezvous round, {n} simulated members", "ms", "lower", [],
                     "goal", [], why=runs.get("not_measured"))
            continue
        goal = goal_ms.get(n)
        figs.add(f"rdzv.round_{n}", "rdzv", f"rendezvous round, {n} simulated members", "ms", "lower", runs,
                 "goal (no other tool forms such rounds here)" if goal else "the 4-member round",
                 [goal] * len(runs) if goal else raw["rounds_ms"].get("4", []),
                 (">=", 1.0, "< 300 ms") if goal else None,
                 "" if goal else "cost of scale: ratio < 1 means slower than 4 members")
    hb = raw.get("heartbeat_s", 1.0) * 1000
    figs.add("rdzv.detect_killed", "rdzv", "detection of a SIGKILLed member", "ms", "lower", raw["detect_killed_ms"],
             "goal", [100.0] * len(raw["detect_killed_ms"]), (">=", 1.0, "< 100 ms"),
             "connection loss; torchrun needs missed heartbeats (~15 s+)")
    figs.add("rdzv.detect_silent", "rdzv", f"detection of a silent (SIGSTOPped) member, heartbeat {hb / 1000:.0f} s",
             "ms", "lower", raw["detect_silent_ms"], "goal: heartbeat + 0.5 s", [hb + 500.0] * len(raw["detect_silent_ms"]),
             (">=", 1.0, "<= heartbeat + 0.5 s"), "")


# ------------------------------------------------------------------------------------------ output
def machine(paths):
    def first_line(argv):
        try:
            return run(argv, 30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return None

    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), None)
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fss = {}
    for name, p in paths.items():
        fss[name] = {"path": p, "fstype": first_line(["findmnt", "-n", "-o", "FSTYPE", "--target", p])}
    torch_v = first_line([PY, "-c", "import torch; print(torch.__version__)"])
    return {"hostname": platform.node(), "cores": os.cpu_count(), "memory_gib": round(mem / 2**30, 1), "cpu": cpu,
            "kernel": platform.release(), "os": first_line(["sh", "-c", ". /etc/os-release; echo $PRETTY_NAME"]),
            "torch": torch_v, "fio": first_line(["fio", "--version"]), "filesystems": fss}


def git_info():
    commit = run(["git", "-C", ROOT, "rev-parse", "HEAD"], 30).stdout.strip() or None
    dirty = bool(run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], 30).stdout.strip())
    return commit, dirty


def fmt_value(v, unit):
    if v is None:
        return "n/a"
    return f"{v:.3g} {unit}" if abs(v) < 1000 else f"{v:.0f} {unit}"


def cell(side, unit):
    if "median" not in side:
        return "n/a"
    if side["n"] == 1:
        return fmt_value(side["median"], unit)
    return f"{fmt_value(side['median'], unit)} [{side['min']:.3g}–{side['max']:.3g}]"


def table_rows(figs):
    rows = []
    for f in figs:
        ratio = f"{f['ratio']:.2f}x" if f["ratio"] is not None else "n/a"
        met = {True: "met", False: "NOT met", None: "-"}[f["met"]]
        rows.append((f["title"], cell(f["elastrun"], f["unit"]), f["anchor"]["name"], cell(f["anchor"], f["unit"]),
                     ratio, f["goal"] or "-", met if "not_measured" not in f else "not measured"))
    return rows


def print_table(figs):
    head = ("figure", "elastrun median [min-max]", "anchor", "anchor median [min-max]", "ratio", "goal", "")
    rows = [head] + table_rows(figs)
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(head))]
    for r in rows:
        print("  ".join(c[:widths[i]].ljust(widths[i]) for i, c in enumerate(r)).rstrip())
    for f in figs:
        if "not_measured" in f:
            print(f"  not measured: {f['title']}: {f['not_measured']}")


def charts(figs, raw, out):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return [f"charts not drawn: {e}"]
    made = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=110)
        plt.close(fig)
        return name

    # launch and recovery: elastrun vs torchrun, seconds (log scale)
    lf = [f for f in figs if f["group"] in ("launcher", "testbed") and f["unit"] == "s" and "median" in f["elastrun"]
          and "median" in f["anchor"]]
    if lf:
        fig, ax = plt.subplots(figsize=(9, 0.5 + 0.55 * len(lf)))
        ys = range(len(lf))
        ax.barh([y + 0.2 for y in ys], [f["elastrun"]["median"] for f in lf], 0.4, label="elastrun")
        ax.barh([y - 0.2 for y in ys], [f["anchor"]["median"] for f in lf], 0.4, label="anchor (torchrun 1.13 or goal)")
        ax.set_yticks(list(ys), [f["title"][:60] for f in lf], fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("seconds (median, log scale)")
        ax.legend(fontsize=8)
        made.append(save(fig, "launch.png"))
    # checkpoint GB/s per tool, per filesystem, with the storage limit
    for fs in sorted({f["id"].split(".")[1] for f in figs if f["group"] == "ckpt"}):
        bars = {}
        for f in figs:
            if not f["id"].startswith(f"ckpt.{fs}.") or f["unit"] != "GB/s":
                continue
            if "median" in f["elastrun"]:
                bars.setdefault("elastrun " + f["title"].split("] ")[1].split(" vs ")[0], f["elastrun"]["median"])
            if "median" in f["anchor"]:
                bars.setdefault(f["anchor"]["name"], f["anchor"]["median"])
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(9, 0.5 + 0.45 * len(bars)))
        names = list(bars)
        colors = ["tab:blue" if n.startswith("elastrun") else ("tab:gray" if "limit" in n else "tab:orange")
                  for n in names]
        ax.barh(range(len(names)), [bars[n] for n in names], color=colors)
        ax.set_yticks(range(len(names)), [n[:60] for n in names], fontsize=7)
        ax.set_xlabel(f"GB/s on {fs} (median; blue: elastrun, gray: storage limit, orange: other tools)")
        made.append(save(fig, f"ckpt-{fs}.png"))
    # rendezvous time vs members, log-log
    rounds = (raw.get("rdzv") or {}).get("rounds_ms", {})
    pts = sorted((int(n), statistics.median(v)) for n, v in rounds.items() if isinstance(v, list) and v)
    if pts:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label="elastrun round (median)")
        ax.axhline(300, color="tab:red", ls="--", label="goal for 1024 members: 300 ms")
        ax.set_xlabel("members per round")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
        made.append(save(fig, "rdzv.png"))
    return made


MEANING = {
    "storage": "The storage limit. `dd conv=fdatasync` alone is not the ceiling (buffered writes through one "
               "process each): fio with 1 and 4 jobs, buffered with an fsync at the end and O_DIRECT, 4 MiB blocks, "
               "measures what the device gives; every checkpoint figure is divided by the best of all of them.",
    "ckpt": "Checkpoints of float32 tensors over 4 MPI ranks (`bench/ckpt/ckpt_bench.cpp`, the C++ library), each "
            "run paired with the same data saved by the reference tools (`bench/ckpt_torch_compare.py`: torch.save "
            "per rank, h5py per rank, torch.distributed.checkpoint of torch 1.13) and with the storage limit, in the "
            "same round, on the same filesystem. Saves are durable (fsync) for every tool and are timed after an "
            "untimed first write of the same memory (on this paravirtualised VM the kernel's first access to each "
            "fresh page costs a hypervisor fault: a job pays it at its first checkpoint only), each tool starting "
            "with the earlier outputs deleted and written back; loads read warm page cache into a model's existing "
            "tensors for every tool (torch.load: with the copy into them, load_state_dict). `shared` is a "
            "GlusterFS volume of a private testbed, mounted through FUSE.",
    "memory": "The memory checkpoint tier (`bench/memory_bench.py`): one standalone agent with "
              "`--memory-checkpoints`, 4 gloo workers snapshotting with `elastrun.checkpoint.save(..., "
              "tier=\"memory\")` and restoring with `load()`, against a memcpy of the same tensors measured in the "
              "same run by the same processes; the training-loop figure alternates blocks of steps with and without "
              "a snapshot per step.",
    "launcher": "The elastrun agent vs torchrun 1.13 (`/usr/bin/python3 -m torch.distributed.run --redirects 9:0 "
                "--tee 9:0`) with the same workers (`bench/launcher_bench.py`), alternated. The launcher's own share "
                "is launch -> every worker process started; the first all-reduce adds `import torch` in the worker, "
                "the same for both.",
    "testbed": "The same comparison on the local Slurm testbed (`bench/testbed_bench.py`, a private 4-node testbed): "
               "`srun -N4 --ntasks-per-node=1` of elastrun (zero rendezvous flags: Slurm's view) or torchrun (c10d "
               "rendezvous at 127.0.0.1, `--nnodes 2:4 --max_restarts 3`), 2 torch workers per node; node loss is "
               "`testbed kill-node` (SIGSTOP then SIGKILL of the node's daemons, launcher and workers); times of a loss "
               "run from kill-node's first SIGSTOP, when the node stops working (the testbed's scan of /proc for the "
               "node's processes before it is not counted; its median is in the detection figure's note). Where torchrun "
               "does not recover within the bounded wait, that bound is its figure (a lower bound) and the note says so.",
    "rdzv": "Rendezvous rounds of N simulated members (threads with real sockets, one process) against the embedded "
            "store, and failure detection of real member processes (`bench/rdzv_bench.cpp`). torchrun has no "
            "comparable figure (its rendezvous needs heartbeats and a last call of tens of seconds), so the goal is "
            "the anchor.",
}


def write_report(result, out, made):
    figs = result["figures"]
    lines = ["# elastrun benchmark report", "",
             f"Generated by `scripts/bench{' --quick' if result['mode'] == 'quick' else ''}` at {result['time']} on "
             f"commit `{(result['git_commit'] or 'unknown')[:12]}`{' (uncommitted changes)' if result['git_dirty'] else ''}. "
             "Raw numbers of every run: `latest.json` (schema `bench/results/schema.json`).", "",
             "## Method", "",
             f"Each figure pairs an elastrun measurement with its anchor measured in the same run on the same machine, "
             f"alternated A B A B over {result['runs']} round(s); the table shows medians with [min–max]. The ratio is "
             "how many times better elastrun is (anchor/elastrun for times, elastrun/anchor for bandwidths); goals "
             "are on the ratio. Nothing here is asserted by the tests: timings on a 2-core VM are noisy.", ""]
    for g in GROUPS:
        if any(f["group"] == g for f in figs):
            lines += [f"- **{g}**: {MEANING[g]}"]
    m = result["machine"]
    lines += ["", "## Machine", "",
              f"{m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, {m['os']}, kernel {m['kernel']}, "
              f"torch {m['torch']}, {m['fio']}.", ""]
    for name, f in m["filesystems"].items():
        lines.append(f"- `{name}`: {f['path']} ({f['fstype']})")
    lines += ["", "## Figures", "", "| figure | elastrun median [min–max] | anchor | anchor median [min–max] | ratio | goal | |",
              "|---|---|---|---|---|---|---|"]
    for r in table_rows(figs):
        lines.append("| " + " | ".join(c.replace("|", "/") for c in r) + " |")
    notes = [f for f in figs if f.get("note") or "not_measured" in f]
    if notes:
        lines += ["", "### Notes", ""]
        for f in notes:
            text = f"not measured: {f['not_measured']}" if "not_measured" in f else f["note"]
            if "not_measured" in f and f.get("note"):
                text += f" ({f['note']})"
            lines.append(f"- {f['title']}: {text}")
    if made:
        lines += ["", "## Charts", ""] + [f"![{p}]({p})" for p in made]
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------ shared fs
class SharedVolume:
    """A private 1-node testbed with --shared-fs, for its GlusterFS mount (None where impossible)."""

    def __init__(self, tb_id):
        self.tb = os.path.join(ROOT, "tests", "cluster", "testbed")
        self.env = dict(os.environ, TESTBED_ID=tb_id)
        self.path = None
        self.why = None

    def __enter__(self):
        r = run([self.tb, "check-shared-fs"], 60, env=self.env)
        if r.returncode != 0:
            self.why = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "check-shared-fs failed"
            return self
        run([self.tb, "down"], 300, env=self.env)
        r = run([self.tb, "up", "1", "--shared-fs"], 300, env=self.env)
        if r.returncode != 0:
            self.why = f"testbed up --shared-fs failed: {r.stderr.strip().splitlines()[-1:]}"
            return self
        for line in run([self.tb, "env"], 60, env=self.env).stdout.splitlines():
            if line.startswith("export TESTBED_SHARED_FS="):
                self.path = line.split("=", 1)[1].strip("'\"")
        return self

    def __exit__(self, *exc):
        if self.path or self.why is None:
            run([self.tb, "down"], 300, env=self.env)


# ------------------------------------------------------------------------------------------ main
def main():
    # SIGTERM (ctest's timeout, kill) ends us through the finally blocks: the private testbed of
    # the shared volume goes down, the work directory is removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one small round of each (a few minutes)")
    p.add_argument("--runs", type=int, help="rounds per pair (default 5; --quick: 1)")
    p.add_argument("--out", help="output directory (default bench/results; --quick: build/bench-results)")
    p.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"), help="the build's bin directory")
    p.add_argument("--dir", default=os.environ.get("ELASTRUN_BENCH_DIR", "/tmp"),
                   help="local checkpoint directory's parent (default /tmp, or ELASTRUN_BENCH_DIR)")
    p.add_argument("--mib-per-rank", type=int, help="checkpoint MiB per rank (default 256: 1 GiB; --quick 16)")
    p.add_argument("--tensors", type=int, default=48, help="tensors per checkpoint (default 48)")
    p.add_argument("--only", default=",".join(GROUPS), help=f"groups, comma-separated: {','.join(GROUPS)}")
    p.add_argument("--no-shared-fs", action="store_true", help="skip the GlusterFS volume")
    p.add_argument("--merge", action="store_true",
                   help="keep the other groups' figures and raw numbers of OUT/latest.json (re-measure only --only)")
    args = p.parse_args()
    runs = args.runs or (1 if args.quick else 5)
    mib = args.mib_per_rank or (16 if args.quick else int(os.environ.get("ELASTRUN_BENCH_MIB", "256")))
    out = args.out or os.path.join(ROOT, "build" if args.quick else "bench", "bench-results" if args.quick else "results")
    only = [g.strip() for g in args.only.split(",") if g.strip()]
    bad = [g for g in only if g not in GROUPS]
    if bad:
        sys.exit(f"bench/run.py: unknown group(s) {', '.join(bad)}; choose from {', '.join(GROUPS)}")
    for exe in ("ckpt_bench", "rdzv_bench", "rdzv_member", "memory_peers_bench", "elastrun"):
        if not os.access(os.path.join(args.bin, exe), os.X_OK):
            sys.exit(f"bench/run.py: {os.path.join(args.bin, exe)} missing; build first (scripts/setup) or pass --bin")
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="elastrun-bench-", dir=args.dir)
    figs = Figures()
    raw = {"storage": {}, "ckpt": {}}
    t_start = time.time()
    try:
        tb_id = os.environ.get("ELASTRUN_BENCH_TESTBED_ID", "bench-sfs")
        volume = SharedVolume(tb_id) if not args.no_shared_fs and ({"ckpt", "storage"} & set(only)) else None
        with (volume or _Null()) as vol:
            paths = {"local": work}
            if vol is not None and vol.path:
                shared_work = tempfile.mkdtemp(prefix="bench-", dir=vol.path)
                paths["shared"] = shared_work
            elif vol is not None:
                log(f"no shared filesystem: {vol.why}")
            result_machine = machine(paths)
            for fs, path in paths.items() if {"ckpt", "storage"} & set(only) else ():
                rounds = []
                shm = []
                for i in range(runs):
                    log(f"{fs}: round {i + 1}/{runs}: storage limit")
                    st = Storage(path, 4 * mib).measure()
                    if fs == "local" and "storage" in only:
                        shm.append(Storage("/dev/shm", 4 * mib).dd())
                    rnd = {"storage": st}
                    if "ckpt" in only:
                        log(f"{fs}: round {i + 1}/{runs}: elastrun checkpoints ({mib} MiB x 4 ranks)")
                        rnd["ours"] = probe_ckpt(args.bin, path, mib, args.tensors, work)
                        log(f"{fs}: round {i + 1}/{runs}: torch.save, h5py, DCP")
                        rnd["anchors"] = probe_ckpt_anchors(path, mib, args.tensors, args.bin)
                        if fs == "local":
                            rnd["python_import"] = probe_python_import(args.bin)
                    rounds.append(rnd)
                raw["storage"][fs] = [r["storage"] for r in rounds]
                if shm:
                    raw["storage"]["shm_dd_write"] = shm
                if "storage" in only:
                    storage_figures(figs, fs, raw["storage"][fs], shm if fs == "local" else None)
                if "ckpt" in only:
                    raw["ckpt"][fs] = rounds
                    ckpt_figures(figs, fs, rounds)
                    if fs == "local":
                        python_import_figure(figs, [r["python_import"] for r in rounds if "python_import" in r])
            if vol is not None and not vol.path and "ckpt" in only:
                figs.add("ckpt.shared.save_vs_limit", "ckpt", "[shared] sync save vs storage limit", "GB/s", "higher",
                         [], "storage limit (best of fio and dd)", [], why=f"no shared filesystem here: {vol.why}")
        if "memory" in only:
            log("memory: the memory checkpoint tier vs memcpy")
            mj = os.path.join(work, "memory.json")
            argv = [PY, os.path.join(HERE, "memory_bench.py"), "--elastrun", os.path.join(args.bin, "elastrun"),
                    "--json", mj, "--reps", str(runs), "--mib-per-rank", str(mib)]
            if args.quick:
                argv += ["--train-mib", "8", "--train-steps", "4", "--step-s", "0.2"]
            r = run(argv, 3600)
            raw["memory"] = json.load(open(mj)) if os.path.exists(mj) else None
            memory_figures(figs, raw["memory"],
                           why=None if raw["memory"] else f"memory_bench failed: {r.stderr.strip().splitlines()[-1:]}")
            log("memory: partner copies between agents vs loopback TCP")
            pj = os.path.join(work, "memory_peers.json")
            r = run([os.path.join(args.bin, "memory_peers_bench"), "--mib", str(mib), "--reps", str(runs), "--json", pj],
                    1800)
            raw["memory_peers"] = json.load(open(pj)) if os.path.exists(pj) else None
            memory_peer_figures(figs, raw["memory_peers"], why=None if raw["memory_peers"] else
                                f"memory_peers_bench failed: {r.stderr.strip().splitlines()[-1:]}")
        if "launcher" in only:
            log("launcher: elastrun vs torchrun (alternated)")
            nprocs = [2] if args.quick else [1, 2, 4]
            lj = os.path.join(work, "launcher.json")
            argv = [PY, os.path.join(HERE, "launcher_bench.py"), "--elastrun", os.path.join(args.bin, "elastrun"),
                    "--reps", str(runs), "--nprocs", ",".join(map(str, nprocs)), "--json", lj]
            argv += ["--only", "abce", "--cpu-seconds", "10" if args.quick else "60"]
            if args.quick:
                argv += ["--node-loss-bound", "15"]
            r = run(argv, 7200)
            if os.path.exists(lj):
                with open(lj) as f:
                    raw["launcher"] = json.load(f)
                launcher_figures(figs, raw["launcher"], nprocs)
            else:
                launcher_figures(figs, None, nprocs, why=f"launcher_bench failed: {r.stderr.strip().splitlines()[-1:]}")
        if "testbed" in only:
            log("testbed: elastrun vs torchrun under srun on a private 4-node testbed (alternated)")
            tj = os.path.join(work, "testbed.json")
            argv = [PY, os.path.join(HERE, "testbed_bench.py"), "--elastrun", os.path.join(args.bin, "elastrun"),
                    "--json", tj, "--reps", str(runs), "--bound", "30" if args.quick else "90",
                    "--work", os.path.join(work, "testbed")]
            env = dict(os.environ, TESTBED_ID=os.environ.get("ELASTRUN_BENCH_TESTBED_ID", "bench-sfs") + "-tb")
            r = run(argv, 7200, env=env)
            raw["testbed"] = json.load(open(tj)) if os.path.exists(tj) else None
            testbed_figures(figs, raw["testbed"],
                            why=None if raw["testbed"] else f"testbed_bench failed: {r.stderr.strip().splitlines()[-1:]}")
        if "rdzv" in only:
            log("rendezvous rounds and failure detection")
            rj = os.path.join(work, "rdzv.json")
            argv = [os.path.join(args.bin, "rdzv_bench"), os.path.join(args.bin, "rdzv_member"), "--json", rj]
            argv += ["--members", "4,64", "--runs", "1"] if args.quick else ["--members", "4,64,1024,4096",
                                                                           "--runs", str(runs)]
            r = run(argv, 3600)
            if os.path.exists(rj):
                with open(rj) as f:
                    raw["rdzv"] = json.load(f)
                rdzv_figures(figs, raw["rdzv"])
            else:
                rdzv_figures(figs, None, why=f"rdzv_bench failed: {r.stderr.strip().splitlines()[-1:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    old = None
    if args.merge and os.path.exists(os.path.join(out, "latest.json")):
        with open(os.path.join(out, "latest.json")) as f:
            old = json.load(f)
        kept = [f for f in old.get("figures", []) if f["group"] not in only]
        figs.items = kept + figs.items
        figs.items.sort(key=lambda f: GROUPS.index(f["group"]) if f["group"] in GROUPS else len(GROUPS))
        raw = {**old.get("raw", {}), **{k: v for k, v in raw.items() if v or k in only}}
        for key in ("storage", "ckpt"):
            if key not in only and old.get("raw", {}).get(key):
                raw[key] = old["raw"][key]
        measured_at = old.get("measured_at", {g: old.get("time") for g in GROUPS if any(f["group"] == g for f in kept)})
    else:
        measured_at = {}
    commit, dirty = git_info()
    result = {"schema": SCHEMA, "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "git_commit": commit, "git_dirty": dirty, "mode": "quick" if args.quick else "full", "runs": runs,
              "mib_per_rank": mib, "tensors": args.tensors, "duration_s": round(time.time() - t_start, 1),
              "machine": result_machine if ("ckpt" in only or "storage" in only) else machine({}),
              "raw": raw, "figures": figs.items}
    now = result["time"]
    result["measured_at"] = {**measured_at, **{g: now for g in only}}
    if old and not ({"ckpt", "storage"} & set(only)):
        result["machine"] = old["machine"]  # keeps the filesystems the kept figures were measured on
    made = charts(figs.items, raw, out)
    with open(os.path.join(out, "latest.json"), "w") as f:
        json.dump(result, f, indent=1)
    write_report(result, out, [m for m in made if m.endswith(".png")])
    print_table(figs.items)
    print(f"\nwrote {out}/latest.json, report.md and {len([m for m in made if m.endswith('.png')])} chart(s) "
          f"in {result['duration_s']:.0f} s")


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
