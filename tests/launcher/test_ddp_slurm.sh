#!/usr/bin/env bash
# An unmodified PyTorch DDP script (ddp_worker.py: gloo, env://, DistributedDataParallel, @record)
# under `srun --no-kill -N2 --ntasks-per-node=1 elastrun --nproc-per-node=2` on a private 2-node
# testbed, with Debian's python3-torch (/usr/bin/python3):
#  1. it trains: 4 ranks on n1 n2, the global loss decreases, the final parameters are identical
#     on every rank (DDP kept them in sync), every agent exits 0;
#  2. rank 3 raises once after the first step (--max-restarts=1): @record's error file reaches the
#     agent's failure line, all 4 ranks restart (TORCHELASTIC_RESTART_COUNT=1) and train again.
# Exit 77 (skipped) when that interpreter has no torch.
# Usage: test_ddp_slurm.sh path/to/ddp_worker.py
# Environment: ELASTRUN_TESTBED, TESTBED_ID (the shared id; this test uses <id>-ddp), ELASTRUN_BIN.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
script=$1
py=${ELASTRUN_TEST_PYTHON:-/usr/bin/python3}
"$py" -c 'import torch.distributed' 2>/dev/null || skip "$py has no torch"
sandbox --tmpdir
out=$SANDBOX
show_on_failure 60 "$out/*.log"
private_testbed_up 2
export ELASTRUN_PYTHON=$py

check() {  # check DIR RESTART_COUNT
  "$py" - "$1" "$2" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/ddp.rank*.json")]
assert sorted(r["rank"] for r in runs) == [0, 1, 2, 3], runs
for r in runs:
    assert r["world_size"] == 4 and r["node"] == ["n1", "n2"][r["rank"] // 2], r
    assert r["all_equal"], f"rank {r['rank']}: parameters differ between ranks"
    assert r["restart"] == sys.argv[2], r
    assert r["last_loss"] < 0.5 * r["first_loss"], f"loss did not decrease: {r}"
assert len({r["digest"] for r in runs}) == 1, "final parameters differ between ranks"
assert len({(r["first_loss"], r["last_loss"]) for r in runs}) == 1, runs  # the same global loss
r = runs[0]
print(f"ok: 4 ranks on n1 n2 trained: global loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}, "
      f"identical parameters {r['digest'][:16]}, restart count {sys.argv[2]}")
PY
}

# ---- 1. plain training run ------------------------------------------------------------------
mkdir -p "$out/ok"
start=$SECONDS
timeout 300 srun --no-kill -N2 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" --nproc-per-node=2 \
  "$script" "$out/ok" >"$out/ok.log" 2>&1 &
track_pid $!
await $! || fail "srun elastrun (DDP) exited $?"
echo "DDP run: $((SECONDS - start)) s"
check "$out/ok" 0 || fail "DDP training results"
[[ $(grep -c "done; exiting 0" "$out/ok.log") -eq 2 ]] || fail "not every agent exited 0"
grep "^\[rank [0-3]\] rank" "$out/ok.log"

# ---- 2. rank 3 raises once: @record -> error file -> agent; everyone restarts ---------------
mkdir -p "$out/fail"
start=$SECONDS
DDP_TEST_FAIL_ONCE=$out/fail/failed-once timeout 300 srun --no-kill -N2 --ntasks-per-node=1 \
  "$ELASTRUN_BIN/elastrun" --nproc-per-node=2 --max-restarts=1 "$script" "$out/fail" >"$out/fail.log" 2>&1 &
track_pid $!
await $! || fail "srun elastrun (DDP, one failure) exited $?"
echo "DDP run with one failure: $((SECONDS - start)) s"
grep -q "worker 3 .* failed: .*ddp test failure on purpose" "$out/fail.log" ||
  fail "the @record error file's message is not in the agent's failure line"
check "$out/fail" 1 || fail "DDP training results after the restart"
[[ $(grep -c "done; exiting 0" "$out/fail.log") -eq 2 ]] || fail "not every agent exited 0 after the restart"
grep -E "worker 3 .* failed|state (FAILED|RESTART)|not counted" "$out/fail.log" || true
echo "ok: slurm.launcher_ddp"
