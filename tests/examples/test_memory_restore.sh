#!/usr/bin/env bash
# examples/cpp/train with the memory tier (--memory-every 1 under elastrun --memory-checkpoints):
# a worker crash costs no step -- the restart resumes from the agent's memory at the step of the
# crash, not from the older file checkpoint -- and the final model equals the failure-free run.
#   A  reference: one process, no agent (world 1), 30 steps, file checkpoints every 10
#   M  2 workers, a memory snapshot every step, rank 1 fails at step 17 once: the restart resumes
#      from step 17 in memory (the newest file step is 10); `elastrun-ckpt diff A M` exits 0
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
