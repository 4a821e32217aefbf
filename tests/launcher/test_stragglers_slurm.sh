#!/usr/bin/env bash
# Stragglers on a private 4-node testbed: every rank on n3 computes 90 ms longer each step
# (examples/cpp/train's ELASTRUN_TRAIN_SLOW_NODE; the result does not change), and every worker
# reports its compute time with progress(step, compute_s).
#  1. --straggler-action=report: group rank 0 names n3 -- once, with its rank and ratio, in a log
#     line, a `straggler` event and the report at the end -- and no other node; the job runs to
#     its end at world 8;
#  2. --straggler-action=exclude: n3 is named, leaves (exit 87), the others re-form at world 6
#     and finish; the final model is the one a failure-free world-1 run computes
#     (elastrun-ckpt diff), and every step on disk names the round that committed it.
# Usage: test_stragglers_slurm.sh path/to/train path/to/elastrun-ckpt
# Environment: ELASTRUN_TESTBED, TESTBED_ID (this test uses <id>-stragglers), ELASTRUN_BIN.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
train=$1 tool=$2
sandbox --tmpdir
out=$SANDBOX
show_on_failure 60 "$out/*.log"
private_testbed_up 4 stragglers
export OMP_NUM_THREADS=1
steps=(--steps 60 --ckpt-every 10 --step-ms 30 --threads 1)

# the reference: one process, no agent, no failure
timeout 120 "$train" "${steps[@]}" --ckpt-dir "$out/ref" >"$out/ref.log" 2>&1 || fail "the reference run exited $?"

run() {  # NAME ACTION
  local name=$1 action=$2
  ELASTRUN_TRAIN_SLOW_NODE=n3:90 timeout 300 srun --no-kill -N4 --ntasks-per-node=1 \
    "$ELASTRUN_BIN/elastrun" --nnodes=3:4 --nproc-per-node=2 --max-restarts=1 --log-dir="$out/$name-logs" \
    --straggler-action="$action" --straggler-window=5 --straggler-windows=3 \
    --no-python "$train" "${steps[@]}" --ckpt-dir "$out/$name" >"$out/$name.log" 2>&1 || true
}

check() {  # NAME ACTION WORLD_AT_THE_END
  /usr/bin/python3 - "$out" "$@" <<'PY'
import glob, json, re, sys
out, name, action, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
log = open(f"{out}/{name}.log").read()
named = re.findall(r"\[elastrun node (\S+)\] straggler: node (\S+): its compute time is ([0-9.]+)x", log)
assert [(by, node) for by, node, _ in named] == [("n1", "n3")], f"named: {named}"
assert float(named[0][2]) > 1.5, named
events = [json.loads(l) for f in glob.glob(f"{out}/{name}-logs/**/events-*.jsonl", recursive=True) for l in open(f)]
stragglers = [e for e in events if e["event"] == "straggler"]
assert len(stragglers) == 1, stragglers
s = stragglers[0]
assert s["node"] == "n1" and s["member"] == "n3" and s["member_rank"] in (4, 5) and s["ratio"] > 1.5 and s["windows"] == 3 and s["action"] == action, s
assert s["median_ms"] > 0 and s["compute_ms"] > s["median_ms"], s
assert re.search(r"\[elastrun node n1\] node n3 was a straggler: its compute time is", log), "not in the report at the end"
done = re.findall(r"\[rank (\d+)\] done: 60 steps", log)
assert len(done) == world, f"{len(done)} ranks finished, expected {world}"
if action == "exclude":
    assert re.search(r"\[elastrun node n3\] error: node n3 was excluded as a straggler .* exiting 87", log), "n3 did not leave"
    assert "left the job: excluded as a straggler" in log, "group rank 0 did not say n3 left"
    assert not [e for e in events if e["event"] == "workers_started" and e["node"] == "n3" and e["attempt"] > 0], \
        "n3 started workers after it was excluded"
print(f"ok: {name}: n3 named by n1 at {float(named[0][2]):.2f}x the median (rank {s['member_rank']}), no other node;",
      f"{world} ranks finished")
PY
}

run report report
check report report 8 || fail "report"
run exclude exclude
check exclude exclude 6 || fail "exclude"
"$tool" diff "$out/ref" "$out/exclude" >"$out/diff.log" 2>&1 || { cat "$out/diff.log"; fail "the model after excluding n3 differs from the failure-free one"; }
echo "ok: the model after excluding n3 is the failure-free one ($(tail -1 "$out/diff.log"))"
"$tool" ls "$out/exclude" | grep -q "committed by rendezvous round" || fail "steps without the round that committed them"
echo "ok: slurm.launcher_stragglers"
