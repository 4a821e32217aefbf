#!/usr/bin/env bash
# examples/cpp/train is exactly-once (docs/trainer.md): the final checkpoint does not depend on
# failures or world sizes, only on --seed (float summation order aside: max |Δ| <= 1e-4).
#   A  reference: one process, no agent, no Slurm (world 1), 40 steps
#   B  3 workers under the agent, rank 1 fails at step 17 once (--fail-at-step 17:1, marker in
#      the checkpoint directory), one restart resumes from step 15 (or 10: the async save of step
#      15 may not have committed when rank 1 died, on a loaded machine) and finishes
#   C  2 workers to step 20, then 3 workers resume from step 20 and finish
#   D  like A with another --seed: must differ
#   then `elastrun-ckpt diff A B`, `diff A C` exit 0, `diff A D` exits 1; the events of A (and,
#   when the agent has --events, of B); SIGTERM exits 143 promptly.
# Usage: test_exactly_once.sh path/to/elastrun path/to/train path/to/elastrun-ckpt
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1 train=$2 tool=$3
sandbox --tmpdir
out=$SANDBOX
show_on_failure 40 "$out/*.log"
export OMP_NUM_THREADS=1
unset_env '^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|ELASTRUN_.*|TORCHELASTIC_.*)$'
common=(--ckpt-every 5 --threads 1)
steps=(--steps 40 "${common[@]}")

agent() {  # agent NPROC LOG ARGS...: the trainer under a standalone agent
  local nproc=$1 log=$2
  shift 2
  timeout 120 "$elastrun" --standalone --nproc-per-node="$nproc" --no-python "$@" >"$out/$log" 2>&1
}
max_delta() { sed -n 's/^max |Δ| = \([^ ]*\) over .*/\1/p' "$1"; }

# A: world 1, no agent
ELASTRUN_EVENTS_FILE=$out/a.events timeout 120 "$train" "${steps[@]}" --ckpt-dir "$out/a" >"$out/a.log" 2>&1 ||
  fail "A exited $?"
grep -q "^\[rank 0\] final loss [0-9]" "$out/a.log" || fail "A printed no final loss"
/usr/bin/python3 - "$out/a.events" "$out/a.log" <<'PY' || fail "A's events"
import json, re, sys
import elastrun.events
events = elastrun.events.read([sys.argv[1]])  # schema v1, time order
saved = [e for e in events if e["event"] == "checkpoint_saved"]
assert [e["step"] for e in saved] == list(range(5, 41, 5)), saved
for e in saved:
    assert e["rank"] == 0 and e["bytes"] > 0 and 0 <= e["blocked_s"] <= e["durable_s"], e
    assert isinstance(e["time"], float) and e["node"], e
done = [e for e in events if e["event"] == "train_done"]
final = float(re.search(r"final loss (\S+)", open(sys.argv[2]).read()).group(1))
assert len(done) == 1 and done[0]["step"] == 40 and abs(done[0]["loss"] - final) <= 1e-6 * abs(final), done
PY

# B: 3 workers, rank 1 fails once at step 17, one restart
bargs=()
if "$elastrun" --help 2>&1 | grep -q -- "--events"; then bargs=(--events "$out/b.events"); fi
agent 3 b.log --max-restarts=1 "${bargs[@]}" "$train" "${steps[@]}" --ckpt-dir "$out/b" --fail-at-step 17:1 ||
  fail "B exited $?"
grep -q "\[rank 1\] --fail-at-step 17:1: failing on purpose at step 17" "$out/b.log" || fail "B: rank 1 did not fail at step 17"
[[ -e $out/b/train-fail-at-step-17.rank-1.done ]] || fail "B: no marker of the failure: $(ls "$out/b")"
grep -Eq "\[rank 0\] resumed from step (15|10) \(saved by a world of 3, now 3\)" "$out/b.log" ||
  fail "B did not resume from step 15 (or 10, if step 15's async save had not committed)"
[[ $(grep -c "failing on purpose" "$out/b.log") -eq 1 ]] || fail "B failed more than once"
grep -q "\[rank 0\] done: 40 steps" "$out/b.log" || fail "B did not finish"
if ((${#bargs[@]})); then
  /usr/bin/python3 - "$out/b.events" <<'PY' || fail "B's events"
import json, sys
import elastrun.events
events = elastrun.events.read([sys.argv[1]])  # schema v1, time order
resumed = [e for e in events if e["event"] == "resumed"]
assert len(resumed) == 1 and resumed[0]["step"] in (10, 15) and resumed[0]["world_size"] == 3, resumed
ranks = {e["rank"] for e in events if e["event"] == "checkpoint_saved" and e["step"] == 40}
assert ranks == {0, 1, 2}, ranks
PY
fi

# C: 2 workers to step 20, then 3 workers to 40
agent 2 c1.log "$train" --steps 20 "${common[@]}" --ckpt-dir "$out/c" || fail "C (2 workers) exited $?"
agent 3 c2.log "$train" "${steps[@]}" --ckpt-dir "$out/c" || fail "C (3 workers) exited $?"
grep -q "\[rank 0\] resumed from step 20 (saved by a world of 2, now 3)" "$out/c2.log" || fail "C did not resume from step 20 at world 3"

# D: another seed
timeout 120 "$train" "${steps[@]}" --ckpt-dir "$out/d" --seed 2 >"$out/d.log" 2>&1 || fail "D exited $?"

for run in b c; do
  rc=0
  "$tool" diff "$out/a" "$out/$run" >"$out/diff-$run.log" 2>&1 || rc=$?
  ((rc == 0)) || fail "diff A ${run^^} exited $rc: $(cat "$out/diff-$run.log")"
  grep -q "^a: .* (step 40, world size 1)$" "$out/diff-$run.log" || fail "diff A ${run^^} did not compare step 40"
  grep -q "^max |Δ| = .* over 8 tensors (tol 0.0001)$" "$out/diff-$run.log" || fail "diff A ${run^^}: $(cat "$out/diff-$run.log")"
done
rc=0
"$tool" diff "$out/a" "$out/d" >"$out/diff-d.log" 2>&1 || rc=$?
((rc == 1)) || fail "diff A D (other seed) exited $rc, expected 1: $(cat "$out/diff-d.log")"

# SIGTERM with no checkpoint-and-stop request: exit 143 after the current step, no new checkpoint
"$train" --steps 100000 --step-ms 20 --ckpt-every 0 --ckpt-dir "$out/t" >"$out/t.log" 2>&1 &
pid=$!
track_pid "$pid"
wait_for -i 0.1 30 grep -q "step 20/" "$out/t.log" || fail "the SIGTERM run did not start"
start=$(date +%s%N)
kill -TERM "$pid"
rc=0
await "$pid" || rc=$?
ms=$((($(date +%s%N) - start) / 1000000))
((rc == 143)) || fail "SIGTERM: exited $rc, expected 143"
((ms < 2000)) || fail "SIGTERM: took $ms ms"
grep -q "SIGTERM: stopping after step [0-9]* without a checkpoint; exiting 143" "$out/t.log" || fail "SIGTERM: no log line"
[[ -z $(compgen -G "$out/t/step-*") ]] || fail "SIGTERM saved a checkpoint: $(ls "$out/t")"

echo "ok: max |Δ| vs the world-1 run: failure+restart at world 3 $(max_delta "$out/diff-b.log")," \
  "world 2 -> 3 $(max_delta "$out/diff-c.log"); another seed $(max_delta "$out/diff-d.log") (diff exit 1);" \
  "SIGTERM -> 143 in $ms ms"
