#!/usr/bin/env bash
# Never a silent fresh start (#29 section 3), as a user meets it: examples' `train` under the
# agent on two nodes of the shared testbed (srun -w n1,n2, one worker each), resuming from a
# checkpoint directory a one-process run wrote (steps 5 and 10, world 1):
#   node_local  the directory is node-local storage: n1 sees the steps, n2 an empty directory
#               -> the job fails, the error names rank 1 on n2 and asks "not a shared filesystem?"
#   damaged     every shard of every step truncated -> the job fails with one line per step
#               ("no usable checkpoint ... all 2 step(s) ... damaged"), both steps still there
#   allowed     the same with --allow-fresh-start -> a warning naming the steps, training from
#               step 0 to the end, exit 0
# Usage: test_restore_refusals_slurm.sh path/to/train   Environment: ELASTRUN_BIN, the testbed's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
train=$1
sandbox --tmpdir
out=$SANDBOX
cd "$out"  # the agents' job directories (elastrun-<job>) go here
show_on_failure 30 "$out/*.log"
export OMP_NUM_THREADS=1
bin=$ELASTRUN_BIN
unset_env '^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|ELASTRUN_.*|TORCHELASTIC_.*)$'
steps=(--steps 15 --ckpt-every 5 --threads 1)

timeout 120 "$train" --steps 10 --ckpt-every 5 --threads 1 --ckpt-dir "$out/good" >"$out/good.log" 2>&1 ||
  fail "the one-process run exited $?"
[[ -d $out/good/step-000000010 ]] || fail "the one-process run left no step 10"

# job NAME ARGS...: the agent on n1 and n2, one train worker each; its exit code
job() {
  local name=$1 rc=0
  shift
  timeout 180 srun -w n1,n2 -N2 --ntasks-per-node=1 --kill-on-bad-exit=0 \
    "$bin/elastrun" --nnodes=2 --nproc-per-node=1 --no-python "$@" >"$out/$name.log" 2>&1 || rc=$?
  return "$rc"
}

# ---- node-local: each node its own directory (a wrapper picks it by SLURMD_NODENAME) ------------
mkdir -p "$out/local/n2"
cp -r "$out/good" "$out/local/n1"
cat >"$out/train-local.sh" <<EOF
#!/bin/sh
exec "$train" ${steps[*]} --ckpt-dir "$out/local/\$SLURMD_NODENAME"
EOF
chmod +x "$out/train-local.sh"
rc=0
job node_local "$out/train-local.sh" || rc=$?
((rc != 0)) || fail "node_local: the job succeeded on node-local directories"
grep -q "rank 1 (node n2" "$out/node_local.log" || fail "node_local: the error does not name rank 1 on n2"
grep -q "shared filesystem" "$out/node_local.log" || fail "node_local: the error does not point at the filesystem"
grep -q "starting at step 0" "$out/node_local.log" && fail "node_local: a rank started afresh"
echo "ok: node-local checkpoint directories: the job failed, naming rank 1 on n2 (exit $rc)"

# ---- every step damaged --------------------------------------------------------------------------
cp -r "$out/good" "$out/bad"
find "$out/bad" -name '*.h5' -path '*step-*' -exec truncate -s 64 {} +
rc=0
job damaged "$train" "${steps[@]}" --ckpt-dir "$out/bad" || rc=$?
((rc != 0)) || fail "damaged: the job succeeded from damaged checkpoints"
grep -q "no usable checkpoint under $out/bad: all 2 step(s) tried are damaged" "$out/damaged.log" ||
  fail "damaged: no error naming the damaged steps"
grep -q "starting at step 0" "$out/damaged.log" && fail "damaged: a rank started afresh"
[[ -d $out/bad/step-000000005 && -d $out/bad/step-000000010 ]] || fail "damaged: the damaged steps were removed"
echo "ok: every step damaged: the job failed with one line per step, the steps kept (exit $rc)"

# ---- the same, a fresh start allowed -------------------------------------------------------------
job allowed "$train" "${steps[@]}" --ckpt-dir "$out/bad" --allow-fresh-start ||
  fail "allowed: the job exited $? with --allow-fresh-start"
grep -q "warning: every checkpoint step under $out/bad is damaged; starting afresh" "$out/allowed.log" ||
  fail "allowed: no warning before the fresh start"
grep -q "\[rank 0\] done: 15 steps" "$out/allowed.log" || fail "allowed: training did not run to the end"
echo "ok: --allow-fresh-start: a warning, then training from step 0 to the end"
