#!/usr/bin/env bash
# examples/python/train.py (DDP over gloo, elastrun.checkpoint, elastrun.data.ElasticSampler) is
# exactly-once like the C++ trainer: the final checkpoint -- model, Adam state, RNG states -- does
# not depend on failures or world sizes, only on --seed (float summation order aside: max |Δ| <= 1e-4).
#   A  reference: one process, no agent (world 1), 30 steps
#   B  3 workers under the agent, rank 1 fails before step 17 once, one restart resumes from step
#      15 (or 10: the async save of 15 may not have committed yet) and finishes
#   C  2 workers to step 20, then 3 workers resume from step 20 and finish
#   D  like A with another --seed: must differ
#   M  the memory tier with preloaded workers (--preload=torch --memory-checkpoints, --memory-every 1):
#      2 workers, rank 1 fails before step 18 once: the restart resumes from step 17 in the agents'
#      memory (the newest file step is 15 or 10), not from the file tier
#   E  the memory tier with a budget that holds no snapshot (--memory-checkpoints=4K): one warning
#      line per worker naming the budget, training goes on with the file tier, the failure at 17
#      resumes from the file tier (15 or 10)
#   then `elastrun-ckpt diff A B`, `diff A C`, `diff A M`, `diff A E` exit 0, `diff A D` exits 1; A's events; and
#   checkpoint-and-stop (SIGUSR1 to a worker) saves and exits 85.
# Usage: test_exactly_once_python.sh path/to/elastrun path/to/elastrun-ckpt SOURCE_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1 tool=$2 source_dir=$3
train=$source_dir/examples/python/train.py
sandbox --tmpdir
out=$SANDBOX
show_on_failure 40 "$out/*.log"
export OMP_NUM_THREADS=1
unset_env '^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|ELASTRUN_.*|TORCHELASTIC_.*)$'
export ELASTRUN_PYTHON=/usr/bin/python3
steps=(--steps 30 --ckpt-every 5 --keep-last 0)

agent() {  # agent NPROC LOG ARGS...: the trainer under a standalone agent
  local nproc=$1 log=$2
  shift 2
  timeout 300 "$elastrun" --standalone --nproc-per-node="$nproc" "$@" >"$out/$log" 2>&1
}
max_delta() { sed -n 's/^max |Δ| = \([^ ]*\) over .*/\1/p' "$1"; }

# A: world 1, no agent
ELASTRUN_EVENTS_FILE=$out/a.events timeout 300 /usr/bin/python3 "$train" "${steps[@]}" --ckpt-dir "$out/a" \
  >"$out/a.log" 2>&1 || fail "A exited $?"
/usr/bin/python3 - "$out/a.events" <<'PY' || fail "A's events"
import json, sys
import elastrun.events
events = elastrun.events.read([sys.argv[1]])  # schema v1, time order
saved = [e for e in events if e["event"] == "checkpoint_saved"]
assert [e["step"] for e in saved] == list(range(5, 31, 5)), saved
assert all(e["bytes"] > 0 and 0 <= e["blocked_s"] <= e["durable_s"] for e in saved), saved
done = [e for e in events if e["event"] == "train_done"]
assert len(done) == 1 and done[0]["step"] == 30, done
PY

# B: 3 workers, rank 1 fails once before step 17, one restart
agent 3 b.log --max-restarts=1 "$train" "${steps[@]}" --ckpt-dir "$out/b" --fail-at-step 17:1 || fail "B exited $?"
grep -q "\[rank 1\] --fail-at-step 17:1: failing on purpose at step 17" "$out/b.log" || fail "B: rank 1 did not fail at step 17"
grep -Eq "\[rank 0\] resumed from .*step-0*(15|10): step (15|10), sample (960|640), world 3 \(saved at world 3\)" \
  "$out/b.log" || fail "B did not resume from step 15 (or 10)"
[[ $(grep -c "failing on purpose" "$out/b.log") -eq 1 ]] || fail "B failed more than once"
grep -q "\[rank 0\] done: 30 steps" "$out/b.log" || fail "B did not finish"

# M: the memory tier, a snapshot every step, preloaded workers
agent 2 m.log --max-restarts=1 --preload=torch --memory-checkpoints=16M --events "$out/m.events" \
  "$train" "${steps[@]}" --memory-every 1 --ckpt-dir "$out/m" --fail-at-step 17:1 || fail "M exited $?"
grep -q "\[rank 1\] --fail-at-step 17:1: failing on purpose at step 17" "$out/m.log" || fail "M: rank 1 did not fail"
grep -q "\[rank 0\] resumed from the agents' memory: step 17, sample 1088, world 2 (saved at world 2)" "$out/m.log" ||
  fail "M did not resume from step 17 in the agents' memory"
grep -q "\[rank 0\] done: 30 steps" "$out/m.log" || fail "M did not finish"
/usr/bin/python3 - "$out/m.events" <<'PY' || fail "M's events"
import sys
import elastrun.events
events = elastrun.events.read([sys.argv[1]])
resumed = [e for e in events if e["event"] == "resumed"]
assert len(resumed) == 1 and resumed[0]["step"] == 17 and resumed[0]["source"] == "memory-local", resumed
memory = [e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("tier") == "memory"]
assert 17 in memory and len(memory) >= 25 and 30 not in memory, memory  # every step but the last, rank 0
files = {e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("tier") == "file"}
assert {20, 25, 30} <= files, files
started = [e for e in events if e["event"] == "workers_started"]
assert started and all(set(e["started_by"]) == {"preload"} for e in started), started
PY

# E: a memory budget too small for any snapshot: a warning, and the file tier does the work
agent 2 e.log --max-restarts=1 --memory-checkpoints=4K "$train" "${steps[@]}" --memory-every 1 --ckpt-dir "$out/e" \
  --fail-at-step 17:1 || fail "E exited $?"
grep -Eq "\[rank 0\] warning: memory snapshot of step 1: .*budget.*--memory-checkpoints" "$out/e.log" ||
  fail "E: no warning naming the memory budget"
[[ $(grep -c "\[rank 0\] warning: memory snapshot" "$out/e.log") -eq 2 ]] ||
  fail "E: rank 0 should warn once per process (2 attempts)"
grep -Eq "\[rank 0\] resumed from .*step-0*(15|10): step (15|10), sample (960|640), world 2 \(saved at world 2\)" \
  "$out/e.log" || fail "E did not resume from the file tier (step 15 or 10)"
grep -q "\[rank 0\] done: 30 steps" "$out/e.log" || fail "E did not finish"

# C: 2 workers to step 20, then 3 workers to 30
agent 2 c1.log "$train" --steps 20 --ckpt-every 5 --ckpt-dir "$out/c" || fail "C (2 workers) exited $?"
agent 3 c2.log "$train" "${steps[@]}" --ckpt-dir "$out/c" || fail "C (3 workers) exited $?"
grep -q "\[rank 0\] resumed from .*: step 20, sample 1280, world 3 (saved at world 2)" "$out/c2.log" ||
  fail "C did not resume from step 20 at world 3"

# D: another seed
timeout 300 /usr/bin/python3 "$train" "${steps[@]}" --ckpt-dir "$out/d" --seed 2 >"$out/d.log" 2>&1 || fail "D exited $?"

for run in b c m e; do
  rc=0
  "$tool" diff "$out/a" "$out/$run" >"$out/diff-$run.log" 2>&1 || rc=$?
  ((rc == 0)) || fail "diff A ${run^^} exited $rc: $(cat "$out/diff-$run.log")"
  grep -q "^a: .* (step 30, world size 1)$" "$out/diff-$run.log" || fail "diff A ${run^^} did not compare step 30"
done
rc=0
"$tool" diff "$out/a" "$out/d" >"$out/diff-d.log" 2>&1 || rc=$?
((rc == 1)) || fail "diff A D (other seed) exited $rc, expected 1: $(cat "$out/diff-d.log")"

# checkpoint-and-stop: SIGUSR1 to the workers (what Slurm's --signal sends) -> save, exit 85
"$elastrun" --standalone --nproc-per-node=2 "$train" --steps 100000 --step-ms 20 --ckpt-every 0 \
  --ckpt-dir "$out/s" >"$out/s.log" 2>&1 &
agent_pid=$!
track_pid "$agent_pid"
wait_for -i 0.2 120 grep -q "step 20/" "$out/s.log" || fail "the stop run did not start"
pkill -USR1 -f -- "--ckpt-dir $out/s" || fail "no worker to signal"
rc=0
await "$agent_pid" || rc=$?
((rc == 85)) || fail "checkpoint-and-stop: the agent exited $rc, expected 85"
grep -q "\[rank 0\] checkpoint-and-stop: saved step [0-9]*; exiting 85" "$out/s.log" || fail "no checkpoint-and-stop line"
[[ -n $(compgen -G "$out/s/step-*") ]] || fail "checkpoint-and-stop saved nothing: $(ls "$out/s")"

echo "ok: max |Δ| vs the world-1 run: failure+restart at world 3 $(max_delta "$out/diff-b.log"),"
echo "  the same restored from the agents' memory (0 steps lost) $(max_delta "$out/diff-m.log")," \
  "world 2 -> 3 $(max_delta "$out/diff-c.log"); another seed $(max_delta "$out/diff-d.log") (diff exit 1);" \
  "SIGUSR1 -> checkpoint, exit 85"
