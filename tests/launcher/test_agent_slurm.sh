#!/usr/bin/env bash
# The elastrun agent on a private 4-node testbed (zero rendezvous flags: endpoint, run id and
# identity come from Slurm):
#  1. srun --no-kill -N4 --ntasks-per-node=1 elastrun --nnodes=2:4 --nproc-per-node=2 worker
#     -> 8 workers, WORLD_SIZE 8, ranks 0..7 in node order n1..n4, one MASTER_ADDR:PORT, exit 0;
#  2. rank 3 fails once -> every node restarts (TORCHELASTIC_RESTART_COUNT=1), exit 0;
#  3. the same with workers sleeping in the 8-rank round; `kill-node n3` -> the survivors stop
#     their workers at once, re-form with 3 nodes, restart with WORLD_SIZE 6 (no restart counted)
#     and finish; every surviving agent exits 0;
#  4. rank 3 (n2) fails every time, --max-restarts=1 -> after one restart every agent gives up
#     (exit 1) and group rank 0 (n1) prints the job-wide summary: root cause rank 3 on n2 with its
#     @record message;
#  5. kill -9 of the agent on n2 while its workers run -> none of n2's workers survives;
#  6. a bad flag -> every agent exits 2 with one error line, no worker starts;
#  7. --health-check: n3's fails -> it does not join, world 6, n3 named; the same for n1 (the
#     store's host, which keeps serving the store); with --health-check-interval, n3's check
#     fails while its workers run -> it leaves, the others go on at world 6.
# Usage: test_agent_slurm.sh path/to/launcher_test_worker
# Environment: ELASTRUN_TESTBED, TESTBED_ID (the shared id; this test uses <id>-launcher),
# ELASTRUN_BIN (build/bin).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
worker=$1
# Agents keep per-run files under $TMPDIR (srun passes it on); the test removes them.
sandbox --tmpdir
out=$SANDBOX
show_on_failure 60 "$out/*.log"
private_testbed_up 4 launcher

# ---- 1. success path ------------------------------------------------------------------------
mkdir -p "$out/ok"
start=$SECONDS
TEST_WORKER_OUT_DIR=$out/ok timeout 180 srun --no-kill -N4 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nnodes=2:4 --nproc-per-node=2 "$worker" >"$out/ok.log" 2>&1 ||
  fail "srun elastrun exited $?"
echo "success path: $((SECONDS - start)) s"
/usr/bin/python3 - "$out/ok" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
assert len(runs) == 8, f"{len(runs)} workers ran, expected 8"
assert sorted(int(r["RANK"]) for r in runs) == list(range(8)), runs
nodes = ["n1", "n2", "n3", "n4"]
for r in runs:
    rank = int(r["RANK"])
    assert r["WORLD_SIZE"] == "8" and r["GROUP_WORLD_SIZE"] == "4" and r["LOCAL_WORLD_SIZE"] == "2", r
    assert r["ELASTRUN_NODE"] == nodes[rank // 2], r            # ranks follow node order
    assert int(r["GROUP_RANK"]) == rank // 2 and int(r["LOCAL_RANK"]) == rank % 2, r
    assert r["TORCHELASTIC_RESTART_COUNT"] == "0", r
assert len({(r["MASTER_ADDR"], r["MASTER_PORT"], r["TORCHELASTIC_RUN_ID"], r["ELASTRUN_GENERATION"]) for r in runs}) == 1, runs
print("ok: 8 workers on 4 nodes, ranks in node order, one master", runs[0]["MASTER_ADDR"], runs[0]["MASTER_PORT"])
PY
[[ $(grep -c "done; exiting 0" "$out/ok.log") -eq 4 ]] || fail "not every agent exited 0"

# ---- 2. a worker fails on n2 (rank 3, first attempt only): every node restarts once --------
mkdir -p "$out/fail"
TEST_WORKER_OUT_DIR=$out/fail TEST_WORKER_FAIL_RANK=3 TEST_WORKER_FAIL_ONCE=$out/fail/failed-once \
  TEST_WORKER_FAIL_AFTER=1 TEST_WORKER_SLEEP=2 timeout 180 srun --no-kill -N4 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nnodes=4 --nproc-per-node=2 --max-restarts=1 "$worker" >"$out/fail.log" 2>&1 ||
  fail "srun elastrun (one worker failure) exited $?"
/usr/bin/python3 - "$out/fail" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
gens = sorted({int(r["ELASTRUN_GENERATION"]) for r in runs})
assert len(gens) == 2, gens
second = [r for r in runs if int(r["ELASTRUN_GENERATION"]) == gens[1]]
assert sorted(int(r["RANK"]) for r in second) == list(range(8)), second
assert all(r["TORCHELASTIC_RESTART_COUNT"] == "1" and r["WORLD_SIZE"] == "8" for r in second), second
print("ok: rank 3 failed once; all 8 workers restarted with TORCHELASTIC_RESTART_COUNT=1")
PY
[[ $(grep -c "state RESTART restart 1 of 1" "$out/fail.log") -eq 1 ]] || fail "expected exactly one RESTART (on n2)"
[[ $(grep -c "done; exiting 0" "$out/fail.log") -eq 4 ]] || fail "not every agent exited 0 after the restart"

# ---- 3. kill-node n3 while workers sleep ----------------------------------------------------
mkdir -p "$out/kill"
TEST_WORKER_OUT_DIR=$out/kill TEST_WORKER_SLEEP=120 TEST_WORKER_SLEEP_WORLD_SIZE=8 \
  srun --no-kill -N4 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nnodes=2:4 --nproc-per-node=2 --rdzv-conf heartbeat_timeout=2 "$worker" \
  >"$out/kill.log" 2>&1 &
srun_pid=$!
track_pid "$srun_pid"
wait_for -a "$srun_pid" "srun ended early" 120 have_files 8 "$out/kill/rank*.json" || fail "8 workers did not start"
"$TB" kill-node n3
killed=$SECONDS
wait_for 120 have_lines 3 "done; exiting 0" "$out/kill.log" || fail "the three survivors did not finish after kill-node n3"
echo "kill-node n3 -> survivors finished in $((SECONDS - killed)) s"
await "$srun_pid" || true  # srun reports the lost node's task as failed
/usr/bin/python3 - "$out/kill" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
six = [r for r in runs if r["WORLD_SIZE"] == "6"]
assert len(six) == 6, f"{len(six)} workers ran with WORLD_SIZE 6: {runs}"
assert sorted(int(r["RANK"]) for r in six) == list(range(6)), six
order = ["n1", "n2", "n4"]
for r in six:
    assert r["ELASTRUN_NODE"] == order[int(r["RANK"]) // 2], r
    assert r["TORCHELASTIC_RESTART_COUNT"] == "0", r  # a lost node does not consume the budget
assert len({(r["MASTER_ADDR"], r["MASTER_PORT"], r["ELASTRUN_GENERATION"]) for r in six}) == 1, six
assert int(six[0]["ELASTRUN_GENERATION"]) > int([r for r in runs if r["WORLD_SIZE"] == "8"][0]["ELASTRUN_GENERATION"])
print("ok: survivors n1 n2 n4 restarted with WORLD_SIZE 6 in generation", six[0]["ELASTRUN_GENERATION"])
PY
grep -q "state MEMBERSHIP_CHANGED member lost" "$out/kill.log" || fail "no MEMBERSHIP_CHANGED (member lost) log line"
grep -E "state (MEMBERSHIP_CHANGED|RENDEZVOUS round)|done; exiting" "$out/kill.log" || true
"$TB" revive-node n3
"$TB" wait-node n3 idle 120

# ---- 4. past --max-restarts: clean failure and the job-wide summary on group rank 0 --------
mkdir -p "$out/budget"
rc=0
TEST_WORKER_OUT_DIR=$out/budget TEST_WORKER_FAIL_RANK=3 TEST_WORKER_ERROR_MESSAGE="boom on purpose" \
  TEST_WORKER_SLEEP=1 timeout 180 srun --no-kill -N4 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nnodes=4 --nproc-per-node=2 --max-restarts=1 "$worker" >"$out/budget.log" 2>&1 || rc=$?
((rc != 0)) || fail "srun succeeded although rank 3 always fails"
/usr/bin/python3 - "$out/budget.log" <<'PY'
import re, sys
log = open(sys.argv[1]).read()
# group rank 0 (n1) prints the job-wide summary; its lines carry n1's prefix
n1 = "\n".join(l[len("[elastrun node n1] "):] for l in log.splitlines() if l.startswith("[elastrun node n1] "))
assert "elastrun: job failed" in n1, "no summary on n1"
summary = n1[n1.index("elastrun: job failed"):]
head = summary[:summary.index("other failures") if "other failures" in summary else len(summary)]
assert re.search(r"node\s+: n2", head) and re.search(r"rank\s+: 3 ", head), head
assert "boom on purpose" in head, head
assert "restart    : 1 of 1" in summary or "restart    : 0 of 1" in summary, summary
assert len(re.findall(r"task \d: Exited with exit code 1", log)) == 4, "not every agent exited 1"
print("ok: rank 3 failing twice -> every agent exits 1; n1 reports rank 3 on n2 with its @record message")
PY

# ---- 5. kill -9 of one agent: none of its workers survives ----------------------------------
mkdir -p "$out/kill9"
TEST_WORKER_OUT_DIR=$out/kill9 TEST_WORKER_SLEEP=120 srun --no-kill -N4 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nnodes=4 --nproc-per-node=2 "$worker" >"$out/kill9.log" 2>&1 &
srun_pid=$!
track_pid "$srun_pid"
wait_for 120 have_files 8 "$out/kill9/rank*.json" || fail "8 workers did not start"
agent=
for p in /proc/[0-9]*; do
  [[ $(readlink "$p/exe" 2>/dev/null) == "$ELASTRUN_BIN/elastrun" ]] || continue
  [[ $(cat "$p/comm" 2>/dev/null) == elastrun-wdog ]] && continue  # the agent's watchdog (same binary)
  grep -qzx "SLURMD_NODENAME=n2" "$p/environ" 2>/dev/null && grep -qzx "TEST_WORKER_OUT_DIR=$out/kill9" "$p/environ" 2>/dev/null &&
    agent=${p#/proc/}
done
[[ -n $agent ]] || fail "no agent process found for n2"
n2_workers=$(/usr/bin/python3 -c '
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/rank*.json"):
    r = json.load(open(f))
    if r["ELASTRUN_NODE"] == "n2": print(r["pid"])' "$out/kill9")
[[ $(wc -w <<<"$n2_workers") -eq 2 ]] || fail "expected 2 workers on n2, got '$n2_workers'"
kill -KILL "$agent"
gone() { [[ -z $(alive_pids "$@") ]]; }
# shellcheck disable=SC2086 # one PID a word
wait_for -i 0.2 30 gone $n2_workers || fail "worker $(alive_pids $n2_workers) of the SIGKILLed agent on n2 is still alive"
echo "ok: kill -9 of n2's agent: its workers $(echo $n2_workers) are gone"
scancel "$(squeue -h -o %i | head -1)" 2>/dev/null || true
stop_pid "$srun_pid"

# ---- 6. a bad flag: exit 2, one line, no worker ---------------------------------------------
rc=0
srun -N2 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" --nnodes=3:2 "$worker" >"$out/bad.log" 2>&1 || rc=$?
((rc == 2)) || fail "srun elastrun --nnodes=3:2 exited $rc, expected 2"
[[ $(grep -c "error:" "$out/bad.log") -ge 2 ]] || fail "no one-line error from each agent: $(cat "$out/bad.log")"
grep -q '"RANK"' "$out/bad.log" && fail "a worker ran despite the bad flag"
echo "ok: --nnodes=3:2 -> every agent exits 2: $(grep -m1 "error:" "$out/bad.log")"

# ---- 7. health checks: a node that fails one does not join; the job goes on without it ------
# n3's site check fails (as a GPU with ECC errors would): world 6 (n1 n2 n4), n3 named in its own
# error line, its event and group rank 0's report; then the same for n1, the store's host, which
# keeps serving the store (without joining) until the job ends. builtin runs too (clock against
# the store's host, the checkpoint directory shared by every node, /dev/shm, memory).
health_case() {  # NAME UNHEALTHY_NODE EXPECTED_ORDER
  local name=$1 bad=$2
  mkdir -p "$out/$name" "$out/$name-ckpt"
  local check="if [ \"\$SLURMD_NODENAME\" = $bad ]; then echo 'GPU 2: 3 uncorrectable ECC errors'; exit 1; fi"
  TEST_WORKER_OUT_DIR=$out/$name timeout 180 srun --no-kill -N4 --ntasks-per-node=1 \
    "$ELASTRUN_BIN/elastrun" --nnodes=3:4 --nproc-per-node=2 --health-check=builtin --health-check="$check" \
    --checkpoint-dir="$out/$name-ckpt" --log-dir="$out/$name-logs" "$worker" >"$out/$name.log" 2>&1 || true
  /usr/bin/python3 - "$out" "$name" "$bad" "$3" <<'PY'
import glob, json, re, sys
out, name, bad, order = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
runs = [json.load(open(f)) for f in glob.glob(f"{out}/{name}/rank*.json")]
assert sorted(int(r["RANK"]) for r in runs) == list(range(6)), runs
for r in runs:
    assert r["WORLD_SIZE"] == "6" and r["ELASTRUN_NODE"] == order[int(r["RANK"]) // 2], r
log = open(f"{out}/{name}.log").read()
line = [l for l in log.splitlines() if f"node {bad} failed its health check" in l]
assert len(line) == 1 and "GPU 2: 3 uncorrectable ECC errors" in line[0] and "exiting 87" in line[0], line
assert len(re.findall(r"done; exiting 0", log)) == 3, "the three healthy agents did not all finish"
assert re.search(rf"node {bad} left the job: failed its health check \(first join, command\)", log), "group rank 0 did not name it"
events = lambda node: [json.loads(l) for l in open(glob.glob(f"{out}/{name}-logs/**/events-{node}.jsonl", recursive=True)[0])]
failed = [e for e in events(bad) if e["event"] == "health_check"]
assert len(failed) == 1 and failed[0]["ok"] is False and failed[0]["check"] == "command", failed
assert not [e for e in events(bad) if e["event"] == "workers_started"], "the unhealthy node started workers"
passed = [e for e in events(order[0]) if e["event"] == "health_check"]
assert len(passed) == 1 and passed[0]["ok"] is True, passed
checks = {c["check"]: c for c in passed[0]["checks"]}
assert {"gpus", "memory", "shm", "clock", "checkpoint-dir", "command"} <= set(checks), checks
assert all(c["ok"] for c in checks.values()), checks
print(f"ok: {bad} failed its health check -> world 6 on {' '.join(order)}; {bad} named;", checks["clock"]["what"])
PY
  ls -A "$out/$name-ckpt" | grep -q . && fail "health-check markers left in the checkpoint directory: $(ls -A "$out/$name-ckpt")"
  return 0
}
health_case health n3 n1,n2,n4
health_case health-store-host n1 n2,n3,n4

# ... and while training (--health-check-interval): n3's check starts failing while its workers run
# -> it stops them and leaves (exit 87); the others re-form at world 6 and finish.
mkdir -p "$out/health-live"
live_check="if [ -e $out/health-live/bad.\$SLURMD_NODENAME ]; then echo 'GPU 1: XID 79, fallen off the bus'; exit 1; fi"
TEST_WORKER_OUT_DIR=$out/health-live TEST_WORKER_SLEEP=120 TEST_WORKER_SLEEP_WORLD_SIZE=8 \
  srun --no-kill -N4 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nnodes=3:4 --nproc-per-node=2 --health-check="$live_check" --health-check-interval=1 \
  "$worker" >"$out/health-live.log" 2>&1 &
srun_pid=$!
track_pid "$srun_pid"
wait_for 120 have_files 8 "$out/health-live/rank*.json" || fail "8 workers did not start"
touch "$out/health-live/bad.n3"
broke=$SECONDS
wait_for 120 have_lines 3 "done; exiting 0" "$out/health-live.log" || fail "the three others did not finish after n3's check failed"
echo "n3's check failed while training -> the others finished in $((SECONDS - broke)) s"
await "$srun_pid" || true
grep -q "\[elastrun node n3\] error: node n3 failed its health check (while training, command): .*fallen off the bus; it stops its workers and leaves the job; exiting 87" \
  "$out/health-live.log" || fail "n3 did not leave with its health check's reason"
/usr/bin/python3 - "$out/health-live" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
six = [r for r in runs if r["WORLD_SIZE"] == "6"]
assert sorted(int(r["RANK"]) for r in six) == list(range(6)), six
assert {r["ELASTRUN_NODE"] for r in six} == {"n1", "n2", "n4"}, six
print("ok: n3 left while training; n1 n2 n4 went on at world 6")
PY

echo "ok: slurm.launcher_agent"
