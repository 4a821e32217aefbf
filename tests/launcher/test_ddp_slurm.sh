#!/usr/bin/env bash
# An unmodified PyTorch DDP script (ddp_worker.py: gloo, env://, DistributedDataParallel, @record)
# under `srun --no-kill -N2 --ntasks-per-node=1 elastrun --nproc-per-node=2` on a private 2-node
# testbed, with Debian's python3-torch (/usr/bin/python3):
#  1. it trains: 4 ranks on n1 n2, the global loss decreases, the final parameters are identical
#     on every rank (DDP kept them in sync), every agent exits 0;
#  2. rank 3 raises once after the first step (--max-restarts=1): @record's error file reaches the
#     agent's failure line, all 4 ranks restart (TORCHELASTIC_RESTART_COUNT=1) and train again;
#  3. a node loss is never charged: `srun -N3 elastrun --nnodes=2:3` with no --max-restarts
#     (budget 0), `kill-node n3` mid-training -> the survivors' workers die of gloo's "Connection
#     reset by peer" before any store reports the loss; the agents confirm their peers alive
#     first, find n3 lost, re-form without counting a restart, and the 2 survivors train to the
#     end; once on the embedded store (zero rendezvous flags) and once on a real etcd (whose
#     lease of n3 runs for seconds after its death: the case that used to end the whole job).
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
private_testbed_up 3
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
# ---- 3. kill-node n3 mid-training, budget 0: never charged, the survivors finish -------------
node_loss() {  # node_loss NAME [RENDEZVOUS FLAGS...]
  local name=$1 dir=$out/$1
  shift
  mkdir -p "$dir"
  DDP_TEST_STEP_SLEEP=0.2 srun --no-kill -N3 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" "$@" --nnodes=2:3 \
    --nproc-per-node=1 "$script" "$dir" 80 >"$out/$name.log" 2>&1 &
  local srun_pid=$!
  track_pid "$srun_pid"
  wait_for -a "$srun_pid" "srun ended early" 180 have_files 1 "$dir/trained.w3" || fail "$name: 3 ranks did not train"
  "$TB" kill-node n3
  wait_for 240 have_lines 2 "done; exiting" "$out/$name.log" || fail "$name: the two survivors did not end"
  await "$srun_pid" || true  # srun reports the lost node's task as failed
  "$py" - "$dir" <<'PY' || fail "$name: the survivors' results"
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/ddp.rank*.json")]
assert sorted((r["rank"], r["node"], r["world_size"]) for r in runs) == [(0, "n1", 2), (1, "n2", 2)], runs
assert all(r["restart"] == "0" for r in runs), runs  # a lost node does not consume the budget
assert all(r["all_equal"] for r in runs) and len({r["digest"] for r in runs}) == 1, runs
print(f"ok: n1 n2 trained to the end at world 2 after the loss of n3, restart count 0")
PY
  grep -E "did not confirm|coincides with|member .* lost|state (FAILED|MEMBERSHIP_CHANGED|RESTART)|giving up" \
    "$out/$name.log" | cut -c1-200 || true
  [[ $(grep -c "done; exiting 0" "$out/$name.log") -eq 2 ]] || fail "$name: not every surviving agent exited 0"
  ! grep -E "giving up|state RESTART" "$out/$name.log" || fail "$name: the node loss was charged as a restart"
  grep -E "not counted against --max-restarts|state MEMBERSHIP_CHANGED" "$out/$name.log" ||
    fail "$name: no agent says the loss was not counted"
  # every survivor of the last round joined: the round forms at once, not after the 1 s last call
  # (the last survivor to join waits for no one; a generous bound on 2 noisy cores)
  local fastest
  fastest=$(grep -oE "formed in [0-9]+ ms: group rank [01] of 2," "$out/$name.log" | awk '{print $3}' | sort -n | head -1)
  echo "$name: the re-formed round's fastest formation: ${fastest:-none} ms"
  [[ -n $fastest ]] && ((fastest < 700)) || fail "$name: the re-form waited for the last call (${fastest:-no round of 2})"
  "$TB" revive-node n3
  "$TB" wait-node n3 idle 120
}
node_loss embedded
if command -v etcd >/dev/null; then
  client=$(free_port)
  peer=$(free_port)
  etcd --name t --data-dir "$out/etcd" --listen-client-urls "http://127.0.0.1:$client" \
    --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" --initial-cluster "t=http://127.0.0.1:$peer" \
    >"$out/etcd.log" 2>&1 &
  track_pid -s TERM $!
  wait_for -i 0.1 20 curl -fso /dev/null "http://127.0.0.1:$client/health" || fail "etcd did not start"
  # the seed document's torchelastic line
  node_loss etcd --rdzv_backend=etcd --rdzv_endpoint=127.0.0.1:$client --rdzv_id=ddp-loss
elif [[ ${CI:-} == true ]]; then
  fail "etcd is not installed: the etcd node-loss case cannot run (scripts/setup installs etcd-server)"
else
  echo "skipped: the etcd node-loss case (etcd is not installed)"
fi
echo "ok: slurm.launcher_ddp"
