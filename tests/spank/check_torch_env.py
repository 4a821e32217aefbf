#!/usr/bin/python3
"""Checks the JSON lines of torch_env_task.py from one step: every rank once, values consistent.
usage: check_torch_env.py FILE NTASKS NNODES MASTER_ADDR [--allreduce]"""
import json
import sys

path, ntasks, nnodes, master_addr = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = [json.loads(l) for l in open(path) if l.startswith("{")]
assert len(rows) == ntasks, f"{len(rows)} tasks reported, expected {ntasks}: {rows}"
ranks = sorted(int(r["RANK"]) for r in rows)
assert ranks == list(range(ntasks)), f"ranks {ranks}"
first = rows[0]
for r in rows:
    assert r["RANK"] == r["SLURM_PROCID"], r
    assert r["LOCAL_RANK"] == r["SLURM_LOCALID"], r
    assert r["GROUP_RANK"] == r["SLURM_NODEID"] == r["NODE_RANK"], r
    assert int(r["WORLD_SIZE"]) == ntasks and r["ROLE_WORLD_SIZE"] == r["WORLD_SIZE"], r
    assert int(r["GROUP_WORLD_SIZE"]) == nnodes, r
    assert r["ROLE_RANK"] == r["RANK"] and r["ROLE_NAME"] == "default", r
    for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        assert r[key] == first[key], (key, r, first)
    assert r["MASTER_ADDR"] == master_addr, r
    assert 24000 <= int(r["MASTER_PORT"]) <= 31999, r
    assert r["TORCHELASTIC_RUN_ID"] == f'{r["SLURM_JOB_ID"]}.{r["SLURM_STEP_ID"]}.r{r["SLURM_RESTART_COUNT"] or 0}', r
    assert r["TORCHELASTIC_RESTART_COUNT"] == "0" and r["TORCHELASTIC_MAX_RESTARTS"] == "0", r
    if r.get("PMIX_RANK") is not None:
        assert r["PMIX_RANK"] == r["RANK"], r
# LOCAL_WORLD_SIZE = tasks on the node; LOCAL_RANKs on a node are 0..n-1
by_node = {}
for r in rows:
    by_node.setdefault(r["GROUP_RANK"], []).append(r)
assert len(by_node) == nnodes, by_node.keys()
for node, rs in by_node.items():
    assert sorted(int(r["LOCAL_RANK"]) for r in rs) == list(range(len(rs))), rs
    assert all(int(r["LOCAL_WORLD_SIZE"]) == len(rs) for r in rs), rs
    assert len({r["SLURMD_NODENAME"] for r in rs}) == 1, rs
if "--allreduce" in sys.argv:
    want = float(sum(range(ntasks)))
    for r in rows:
        assert r["allreduce"] == want and r["dist_world"] == ntasks, r
print(f"ok: {ntasks} tasks on {nnodes} nodes, MASTER_ADDR={first['MASTER_ADDR']} "
      f"MASTER_PORT={first['MASTER_PORT']} TORCHELASTIC_RUN_ID={first['TORCHELASTIC_RUN_ID']}")
