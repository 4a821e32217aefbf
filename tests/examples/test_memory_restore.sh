#!/usr/bin/env bash
# examples/cpp/train with the memory tier (--memory-every 1 under elastrun --memory-checkpoints):
# a worker crash costs no step -- the restart resumes from the agent's memory at the step of the
# crash, not from the older file checkpoint -- and the final model equals the failure-free run.
#   A  reference: one process, no agent (world 1), 30 steps, file checkpoints every 10
#   M  2 workers, a memory snapshot every step, rank 1 fails at step 17 once: the restart resumes
#      from step 17 in memory (the newest file step is 10); `elastrun-ckpt diff A M` exits 0
#   H  two agents on this machine (partner copies), node 1's own snapshots of step 17 corrupted once
#      sent to its partner (ELASTRUN_TEST_FLIP_MEMORY_STEP, tests only), rank 2 fails at step 17:
#      the restart asks node 0 for its copies (the next source) and resumes from step 17, source
#      memory-partner; `elastrun-ckpt diff A H` exits 0
# Usage: test_memory_restore.sh path/to/elastrun path/to/train path/to/elastrun-ckpt
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1 train=$2 tool=$3
sandbox --tmpdir
out=$SANDBOX
show_on_failure 40 "$out/*.log"
export OMP_NUM_THREADS=1
unset_env '^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|ELASTRUN_.*|TORCHELASTIC_.*)$'
steps=(--steps 30 --ckpt-every 10 --threads 1)

timeout 120 "$train" "${steps[@]}" --ckpt-dir "$out/a" >"$out/a.log" 2>&1 || fail "A exited $?"

timeout 120 "$elastrun" --standalone --nproc-per-node=2 --no-python --max-restarts=1 --memory-checkpoints=16M \
  --events "$out/m.events" "$train" "${steps[@]}" --memory-every 1 --ckpt-dir "$out/m" --fail-at-step 17:1 \
  >"$out/m.log" 2>&1 || fail "M exited $?"
grep -q "\[rank 1\] --fail-at-step 17:1: failing on purpose at step 17" "$out/m.log" || fail "M: rank 1 did not fail"
# newest file step 10, or none when the crash came while step 10's asynchronous commit (a fenced
# one: the agent confirms the round on the store) was still in flight on a loaded machine
grep -Eq "\[rank 0\] resumed from step 17 in the agents' memory \(saved by a world of 2, now 2; newest file checkpoint: (10|none)\)" \
  "$out/m.log" || fail "M did not resume from step 17 in memory"
grep -q "\[rank 0\] done: 30 steps" "$out/m.log" || fail "M did not finish"
/usr/bin/python3 - "$out/m.events" <<'PY' || fail "M's events"
import sys
import elastrun.events
events = elastrun.events.read([sys.argv[1]])
resumed = [e for e in events if e["event"] == "resumed"]
assert len(resumed) == 1 and resumed[0]["step"] == 17 and resumed[0]["source"] == "memory-local", resumed
memory = [e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("tier") == "memory"]
assert 17 in memory and len(memory) >= 25, memory  # every step but the last, from rank 0
files = {e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("tier") == "file"}
assert {20, 30} <= files <= {10, 20, 30}, files  # 10: unless its commit was cut short by the crash
PY
# every file step committed under the agent says which round committed it (the fence's token);
# steps without an agent (run A) have no record
"$tool" ls "$out/m" >"$out/m.ls" || fail "ls M: $(cat "$out/m.ls")"
listed=$(grep -cE "^[0-9]+ " "$out/m.ls" || true)
recorded=$(grep -cE "^[0-9]+ .*\(committed by rendezvous round [0-9]+, requeue 0\)$" "$out/m.ls" || true)
((listed >= 2 && recorded == listed)) || fail "M: $recorded of $listed file steps name the round that committed them: $(cat "$out/m.ls")"
"$tool" ls "$out/a" | grep -q "committed by" && fail "A (no agent) has a commit record"
rc=0
"$tool" diff "$out/a" "$out/m" >"$out/diff.log" 2>&1 || rc=$?
((rc == 0)) || fail "diff A M exited $rc: $(cat "$out/diff.log")"
grep -q "^a: .* (step 30, world size 1)$" "$out/diff.log" || fail "diff A M did not compare step 30"
echo "ok: a crash at step 17 resumed from step 17 in the agents' memory (0 steps lost; file tier: 10);" \
  "$(sed -n 's/^\(max |Δ| = [^ ]*\) over .*/\1/p' "$out/diff.log") vs the failure-free world-1 run"

# H: the next source after a bad checksum, with the C++ trainer
port=$(free_port)
for n in 0 1; do
  flip=()
  ((n == 0)) || flip=(ELASTRUN_TEST_FLIP_MEMORY_STEP=17)
  env "${flip[@]}" timeout 120 "$elastrun" --nnodes=2 --nproc-per-node=2 --no-python --max-restarts=1 \
    --rdzv-endpoint=127.0.0.1:$port --rdzv-id=hash-cpp --rdzv-conf=is_host=$((1 - n)) --node-rank=$n \
    --memory-checkpoints=16M --events "$out/h$n.events" "$train" "${steps[@]}" --memory-every 1 --ckpt-dir "$out/h" \
    --fail-at-step 17:2 >"$out/h$n.log" 2>&1 &
  printf -v "pid_h$n" '%s' "$!"
  track_pid "$!"
done
rc=0
await "$pid_h0" || rc=$?
await "$pid_h1" || rc=$((rc + $?))
((rc == 0)) || fail "H: the agents exited $rc"
grep -q "flipped a byte of step 17 rank [23] here" "$out/h1.log" || fail "H: node 1 did not flip its copies of step 17"
grep -Eq "\[rank [23]\] warning: the memory snapshot of step 17 rank [23] fails its checksum: asking a peer agent" \
  "$out/h1.log" || fail "H: no rank on node 1 found its copy bad"
grep -q "memory checkpoints: step 17 rank [23] held here failed its checksum: fetched again from 127.0.0.1:" \
  "$out/h1.log" || fail "H: node 1's agent did not fetch a copy again"
/usr/bin/python3 - "$out/h0.events" <<'PY' || fail "H's events"
import sys
import elastrun.events
resumed = [e for e in elastrun.events.read([sys.argv[1]]) if e["event"] == "resumed"]
assert [(e["step"], e["source"]) for e in resumed] == [(17, "memory-partner")], resumed
PY
same_model "$tool" "$out/a" "$out/h" "$out/diff-h.log" 30
echo "ok: node 1's bad copies replaced by node 0's: resumed from step 17 in memory (memory-partner);" \
  "$MAX_DELTA vs the failure-free world-1 run"
