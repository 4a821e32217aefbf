#!/usr/bin/python3
"""Integration tests on the testbed: `elastrun env --json` inside real srun steps.

Usage: test_env_detection.py CASE   (CASE: step | pmix | hetjob)
Needs ELASTRUN_TESTBED (the testbed script), TESTBED_ID and ELASTRUN_BIN (build/bin) from ctest.
"""
import json
import os
import subprocess
import sys


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def slurm_env():
    out = subprocess.run([os.environ["ELASTRUN_TESTBED"], "env"], check=True,
                         capture_output=True, text=True).stdout
    env = dict(os.environ)
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            env[key] = value.strip("'\"")
    if "SLURM_CONF" not in env:
        fail(f"testbed env printed no SLURM_CONF: {out!r}")
    return env


def run_step(srun_args):
    elastrun = os.path.join(os.environ["ELASTRUN_BIN"], "elastrun")
    cmd = ["srun", "--time=5"] + srun_args + [elastrun, "env", "--json"]
    if ":" in srun_args:  # het step: every component runs the command
        cmd = ["srun", "--time=5"]
        for i, part in enumerate(" ".join(srun_args).split(" : ")):
            if i:
                cmd.append(":")
            cmd += part.split() + [elastrun, "env", "--json"]
    proc = subprocess.run(cmd, env=slurm_env(), capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        fail(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    records = []
    for line in proc.stdout.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            fail(f"not JSON: {line!r}")
    return sorted(records, key=lambda r: r["rank"])


def check_consistent(records, world, nodes):
    if len(records) != world:
        fail(f"expected {world} tasks, got {len(records)}")
    if [r["rank"] for r in records] != list(range(world)):
        fail(f"ranks are not 0..{world - 1}: {[r['rank'] for r in records]}")
    for key in ("world_size", "num_nodes", "run_id", "rdzv_endpoint"):
        values = {json.dumps(r[key], sort_keys=True) for r in records}
        if len(values) != 1:
            fail(f"{key} differs between tasks: {values}")
    for r in records:
        if r["source"] != "slurm":
            fail(f"rank {r['rank']}: source {r['source']} != slurm")
        if r["world_size"] != world or r["num_nodes"] != nodes:
            fail(f"rank {r['rank']}: world {r['world_size']}/{r['num_nodes']} != {world}/{nodes}")
        s = r["slurm"]
        if s["nodes"][r["node_rank"]] != s["node_name"]:
            fail(f"rank {r['rank']}: node_rank {r['node_rank']} names {s['nodes'][r['node_rank']]}"
                 f" but the task runs on {s['node_name']}")
        if r["rdzv_endpoint"]["host"] != s["nodes"][0]:
            fail(f"rendezvous host {r['rdzv_endpoint']['host']} is not the first node")
        if not r["run_id"].startswith(s["job_id"] + "."):
            fail(f"run id {r['run_id']} does not derive from job {s['job_id']}")
    # local ranks on each node are 0..local_world_size-1, and local_world_size is the node's count
    by_node = {}
    for r in records:
        by_node.setdefault(r["node_rank"], []).append(r)
    if len(by_node) != nodes:
        fail(f"tasks span {len(by_node)} nodes, expected {nodes}")
    for node, rs in by_node.items():
        locals_ = sorted(r["local_rank"] for r in rs)
        if locals_ != list(range(len(rs))) or any(r["local_world_size"] != len(rs) for r in rs):
            fail(f"node {node}: local ranks {locals_}, local_world_size "
                 f"{[r['local_world_size'] for r in rs]}")


def case_step():
    records = run_step(["-N4", "-n8"])
    check_consistent(records, 8, 4)
    if any(r["local_world_size"] != 2 for r in records):
        fail("srun -N4 -n8 should place 2 tasks per node")


def case_pmix():
    records = run_step(["-N2", "-n4", "--mpi=pmix"])
    check_consistent(records, 4, 2)
    for r in records:
        pmix = r["mpi"].get("pmix")
        if not pmix:
            fail(f"rank {r['rank']}: PMIx not detected: {r['mpi']}")
        if pmix["rank"] != r["rank"] or not pmix["namespace"]:
            fail(f"rank {r['rank']}: PMIx rank/namespace wrong: {pmix}")


def case_hetjob():
    records = run_step(["-N1", "-n1", ":", "-N2", "-n2"])
    check_consistent(records, 3, 3)
    for r in records:
        s = r["slurm"]
        if s["het_size"] != 2 or len(s["het_components"]) != 2:
            fail(f"rank {r['rank']}: het job not detected: size {s['het_size']}")
        c0, c1 = s["het_components"]
        if (c0["task_offset"], c0["ntasks"], c1["task_offset"], c1["ntasks"]) != (0, 1, 1, 2):
            fail(f"rank {r['rank']}: component offsets wrong: {c0} {c1}")
        if (c0["node_offset"], c1["node_offset"]) != (0, 1):
            fail(f"rank {r['rank']}: component node offsets wrong: {c0} {c1}")
        expected = 0 if r["rank"] == 0 else 1
        if s["het_component"] != expected:
            fail(f"rank {r['rank']}: het_component {s['het_component']} != {expected}")
        if s["node_name"] not in s["het_components"][expected]["nodes"]:
            fail(f"rank {r['rank']}: runs on {s['node_name']}, outside its component")


if __name__ == "__main__":
    {"step": case_step, "pmix": case_pmix, "hetjob": case_hetjob}[sys.argv[1]]()
    print(f"ok: {sys.argv[1]}")
