#!/usr/bin/env bash
# examples/cpp/train (libtorch, Gloo, elastrun checkpoints, control channel) under the agent:
#   resume  2 workers train to step 30 and checkpoint; 3 workers resume from step 30 (a
#           different world size) and finish at 50
#   stop    SIGUSR1 to the agent -> every worker checkpoints the same step and exits 85, the
#           agent exits 85, no worker is left; a rerun resumes from that step
# Usage: test_train.sh CASE path/to/elastrun path/to/train
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
case_=$1 elastrun=$2 train=$3
sandbox --tmpdir
out=$SANDBOX
show_on_failure 30 "$out/*.log"

run() {  # run NPROC LOG ARGS...: the trainer under a standalone agent
  local nproc=$1 log=$2
  shift 2
  timeout 300 "$elastrun" --standalone --nproc-per-node="$nproc" --no-python "$train" --ckpt-dir "$out/ck" "$@" >"$out/$log" 2>&1
}

case $case_ in
resume)
  run 2 first.log --steps 30 || fail "first run exited $?"
  grep -q "\[rank 0\] done: 30 steps" "$out/first.log" || fail "first run did not finish"
  [[ -d $out/ck/step-000000030 ]] || fail "no checkpoint of step 30: $(ls "$out/ck")"
  run 3 second.log --steps 50 || fail "second run exited $?"
  grep -q "\[rank 0\] resumed from step 30 (saved by a world of 2, now 3)" "$out/second.log" ||
    fail "the 3-worker run did not resume from step 30"
  grep -q "\[rank 0\] step 50/50 loss .* world 3" "$out/second.log" || fail "the 3-worker run did not reach step 50"
  # the model: replicated, hence bit-identical, loss far below the initial one
  /usr/bin/python3 - "$out/ck/step-000000050/index.h5" "$out/first.log" "$out/second.log" <<'PY'
import re, sys
import h5py
f = h5py.File(sys.argv[1], "r")
names = []
f.visit(lambda n: names.append(n) if isinstance(f[n], h5py.Dataset) else None)
assert any(n.startswith("model/") for n in names), names
losses = [float(m) for p in sys.argv[2:] for m in re.findall(r"\[rank 0\] step \d+/\d+ loss ([0-9.]+)", open(p).read())]
assert losses[-1] < losses[0] / 5, losses
print(f"ok: resumed at world 3; loss {losses[0]:.3f} -> {losses[-1]:.3f}; {len(names)} datasets readable by h5py")
PY
  ;;
stop)
  "$elastrun" --standalone --nproc-per-node=2 --no-python "$train" --ckpt-dir "$out/ck" --ckpt-every 0 \
    --steps 100000 --step-ms 20 >"$out/stop.log" 2>&1 &
  agent=$!
  track_pid "$agent"
  wait_for -i 0.2 120 grep -q "step 20/" "$out/stop.log" || fail "training did not start"
  kill -USR1 "$agent"
  rc=0
  await "$agent" || rc=$?
  ((rc == 85)) || fail "agent exited $rc after SIGUSR1, expected 85 (checkpointed)"
  [[ $(grep -c "checkpoint-and-stop: saved step" "$out/stop.log") -eq 2 ]] || fail "not both workers checkpointed"
  steps=$(grep -o "checkpoint-and-stop: saved step [0-9]*" "$out/stop.log" | awk '{print $4}' | sort -u)
  [[ $(wc -l <<<"$steps") -eq 1 ]] || fail "workers stopped at different steps: $steps"
  pgrep -f -- "$train --ckpt-dir $out/ck" >/dev/null && fail "a worker is still alive"
  run 2 resume.log --steps $((steps + 10)) || fail "rerun exited $?"
  grep -q "\[rank 0\] resumed from step $steps " "$out/resume.log" || fail "rerun did not resume from step $steps"
  echo "ok: SIGUSR1 -> both workers saved step $steps and exited 85; the rerun resumed there"
  ;;
*) fail "unknown case $case_" ;;
esac
