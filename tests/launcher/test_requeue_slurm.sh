#!/usr/bin/env bash
# Requeue through libslurm on a private testbed.
# Usage: test_requeue_slurm.sh CASE path/to/launcher_test_worker
# signal: checkpoint-and-stop and requeue on a 2-node testbed:
#   sbatch --requeue --open-mode=append a job running
#     srun --no-kill -N2 --ntasks-per-node=1 elastrun --nproc-per-node=2 --checkpoint-dir=DIR worker
#   with workers polling the control channel (TEST_WORKER_POLL_CONTROL); once they run,
#   `scancel --signal=USR1 JOB` (Slurm signals every process of the job's steps, agents included)
#   -> both agents enter CHECKPOINT_STOP, the 4 workers write their checkpoint marker and exit 85,
#   -> group rank 0 (n1) calls slurm_requeue; the job really comes back: its second run sees
#      SLURM_RESTART_COUNT=1 (marker written by the batch script and by every worker), finishes
#      (workers exit 0) and the job ends COMPLETED; the requeue ledger counts one timelimit requeue.
# node: a 3-node testbed, sbatch -k --requeue -N2 with elastrun --nnodes=2 (MIN 2); kill-node of the
#   second node -> the survivor cannot form a 2-node round within join_timeout (20 s) -> it
#   requeues the job (class node) excluding the lost node; the second run runs on the two other
#   nodes (SLURM_RESTART_COUNT=1) and finishes; the ledger counts one node requeue.
# unhealthy: as node, but instead of dying the second node's "GPU fails" (a marker its
#   --health-check command looks for) and its worker is killed: after the failure its agent checks
#   the node again, fails, does not join (exit 87); the survivor cannot form a 2-node round, and the
#   requeue excludes the unhealthy node (not down in Slurm: excluded because it said so).
# rendezvous: as node, but join_timeout is long: the survivor (group rank 0 of the lost round)
#   waits in RENDEZVOUS with no workers; `scancel --signal=USR1 JOB` then makes it requeue the job
#   (class timelimit: no worker can checkpoint, the last checkpoint stands) before it exits; the
#   second run finishes; the ledger counts one timelimit requeue and no node requeue.
# preempt: the signal case on a testbed with preemption (TESTBED_PREEMPT=1: partition `urgent`
#   preempts `test`, GraceTime 20 s); instead of USR1, an exclusive 2-node job in `urgent` preempts
#   ours -> Slurm sends SIGTERM -> both agents CHECKPOINT_STOP class preempt, the 4 workers
#   checkpoint, n1 asks slurmctld (preempted, not cancelled) and requeues once; the urgent job runs,
#   then the second run finishes; the ledger counts one preempt requeue.
# Environment: ELASTRUN_TESTBED, TESTBED_ID (this test uses <id>-requeue), ELASTRUN_BIN.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
case_name=$1
worker=$2
sandbox
out=$SANDBOX
job=
show_on_failure 80 "$out/job.out"
on_failure 'scontrol show job "$job" 2>/dev/null | head -20 >&2'
on_exit '[[ -z $job ]] || scancel "$job" 2>/dev/null'
job_state() { scontrol show job "$job" 2>/dev/null | grep -oP 'JobState=\K\S+' || echo GONE; }
job_completed() { [[ $(job_state) == COMPLETED ]]; }
# second_run_done START EVENT [LOST]: the requeued job comes back (300 s; LOST: the node whose loss
# requeued it), restarted how long after EVENT (at SECONDS=START); its second run finishes (180 s)
# and the job ends COMPLETED (60 s)
second_run_done() {
  wait_for -i 1 300 test -e "$out/batch.run1" ||
    fail "the job did not come back${3:+ after losing $3} (state $(job_state))"
  echo "job $job requeued and restarted $((SECONDS - $1)) s after $2"
  wait_for -i 1 180 grep -qs "srun exited .* in run 1" "$out/job.out" ||
    fail "the second run did not finish (state $(job_state))"
  wait_for -i 1 60 job_completed || true
  [[ $(job_state) == COMPLETED ]] || fail "job state $(job_state), expected COMPLETED"
}

[[ $case_name == preempt ]] && export TESTBED_PREEMPT=1 TESTBED_GRACE_TIME=20
private_testbed_up "$([[ $case_name == signal || $case_name == preempt ]] && echo 2 || echo 3)"

if [[ $case_name == node || $case_name == rendezvous || $case_name == unhealthy ]]; then
  join_timeout=20; [[ $case_name == rendezvous ]] && join_timeout=600
  # unhealthy: a node whose marker file exists fails its health check (checked after a failure)
  health=; [[ $case_name == unhealthy ]] && health="--max-restarts=1 --health-check='if [ -e $out/unhealthy.\$SLURMD_NODENAME ]; then echo GPU 0 fell off the bus; exit 1; fi'"
  cat >"$out/job.sh" <<EOF
#!/bin/bash
run=\${SLURM_RESTART_COUNT:-0}
echo "batch run \$run job \$SLURM_JOB_ID on \$SLURM_JOB_NODELIST" > "$out/batch.run\$run"
mkdir -p "$out/run\$run"
sleep_s=300; [[ \$run -ge 1 ]] && sleep_s=2
TMPDIR=$out/tmp TEST_WORKER_SLEEP=\$sleep_s TEST_WORKER_OUT_DIR=$out/run\$run \\
  srun --no-kill -N2 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" --nnodes=2 --nproc-per-node=1 \\
  --checkpoint-dir=$out/ckpt --rdzv-conf=join_timeout=$join_timeout,heartbeat_timeout=2 $health "$worker"
echo "srun exited \$? in run \$run"
EOF
  chmod +x "$out/job.sh"
  mkdir -p "$out/ckpt"
  # -k: the allocation survives a node failure (else slurmctld itself kills or requeues the job)
  job=$(sbatch --parsable -N2 -k --requeue --open-mode=append -o "$out/job.out" "$out/job.sh")
  echo "submitted job $job"
  wait_for 120 have_files 2 "$out/run0/rank*.json" || fail "2 workers of the first run did not start (job state $(job_state))"
  victim=$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["ELASTRUN_NODE"])' \
    "$(ls "$out"/run0/rank1.gen*.json | head -1)")
  if [[ $case_name == unhealthy ]]; then
    # its GPU "fails" and its worker dies of it: after the failure its agent checks the node again
    touch "$out/unhealthy.$victim"
    kill -KILL "$(/usr/bin/python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' \
      "$(ls "$out"/run0/rank1.gen*.json | head -1)")"
    echo "$victim's GPU failed (marker), its worker killed"
  else
    "$TB" kill-node "$victim"
    echo "killed $victim (group rank 1)"
  fi
  killed=$SECONDS
  if [[ $case_name == rendezvous ]]; then
    # the survivor's second RENDEZVOUS: it waits for a 2nd node that will not come
    wait_for 120 have_lines 3 "\] state RENDEZVOUS run" "$out/job.out" ||
      fail "the survivor did not go back to RENDEZVOUS (state $(job_state))"
    sleep 1
    scancel --signal=USR1 "$job"
    echo "sent USR1 to job $job while the survivor waits in RENDEZVOUS"
  fi
  second_run_done "$killed" "kill-node $victim" "$victim"
  /usr/bin/python3 - "$out" "$victim" "$case_name" <<'PY'
import glob, json, sys
out, victim = sys.argv[1], sys.argv[2]
second = [json.load(open(f)) for f in glob.glob(out + "/run1/rank*.json")]
assert sorted(int(r["RANK"]) for r in second) == [0, 1], second
assert all(r["SLURM_RESTART_COUNT"] == "1" for r in second), second
assert victim not in {r["ELASTRUN_NODE"] for r in second}, second
ledger = json.load(open(out + "/ckpt/elastrun-requeue.json"))
want = {"node": (1, 0), "unhealthy": (1, 0), "rendezvous": (0, 1)}[sys.argv[3]]
assert (ledger["node"], ledger["timelimit"]) == want, ledger
print("ok: second run on", sorted(r["ELASTRUN_NODE"] for r in second), "with SLURM_RESTART_COUNT=1; ledger", ledger)
PY
  log=$out/job.out
  if [[ $case_name == rendezvous ]]; then
    grep -q "received SIGUSR1 during the rendezvous (no workers running): the last checkpoint stands" "$log" ||
      fail "the survivor did not take USR1 as a requeue request during the rendezvous"
    [[ $(grep -c "requeued job $job (class timelimit, requeue 1 of inf)" "$log") -eq 1 ]] ||
      fail "expected one timelimit-class requeue"
    grep -q "requeued job $job (class node" "$log" && fail "unexpected node-class requeue"
    grep -E "\] (state |error|requeue|received|exiting)" "$log" | head -40
    echo "ok: slurm.launcher_requeue_rendezvous"
    exit 0
  fi
  if [[ $case_name == unhealthy ]]; then
    grep -q "error: node $victim failed its health check (after a failure, command): .*GPU 0 fell off the bus; it does not join; exiting 87" "$log" ||
      fail "$victim did not fail its health check after the failure"
  fi
  [[ $(grep -c "requeued job $job (class node, requeue 1 of 3)" "$log") -eq 1 ]] || fail "expected one node-class requeue"
  grep -q "excluding node(s) $victim from requeued job $job" "$log" || fail "no line about excluding $victim"
  # the agent may be killed by the requeue before it logs the outcome: ask slurmctld
  scontrol show job "$job" | grep -q "ExcNodeList=$victim\b" || fail "job $job does not exclude $victim"
  grep -E "\] (state |error|requeue|exiting)" "$log" | head -40
  echo "ok: slurm.launcher_requeue_$case_name"
  exit 0
fi

cat >"$out/job.sh" <<EOF
#!/bin/bash
# first run: workers run long (until the USR1 below); second run (SLURM_RESTART_COUNT=1): 2 s
run=\${SLURM_RESTART_COUNT:-0}
echo "batch run \$run job \$SLURM_JOB_ID" > "$out/batch.run\$run"
mkdir -p "$out/run\$run"
sleep_s=300; [[ \$run -ge 1 ]] && sleep_s=2
TMPDIR=$out/tmp TEST_WORKER_POLL_CONTROL=1 TEST_WORKER_SLEEP=\$sleep_s TEST_WORKER_OUT_DIR=$out/run\$run \\
  srun --no-kill -N2 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" --nproc-per-node=2 \\
  --checkpoint-dir=$out/ckpt --checkpoint-timeout=60 "$worker"
echo "srun exited \$? in run \$run"
EOF
chmod +x "$out/job.sh"
mkdir -p "$out/ckpt"
job=$(sbatch --parsable -N2 --requeue --open-mode=append -o "$out/job.out" "$out/job.sh")
echo "submitted job $job"

wait_for 120 have_files 4 "$out/run0/rank*.json" || fail "4 workers of the first run did not start (job state $(job_state))"
# signal only once every worker has installed its handlers and polled the channel
wait_for 60 have_files 4 "$out/run0/polling.rank*" || fail "the 4 workers of the first run never polled the channel"
if [[ $case_name == preempt ]]; then
  urgent=$(sbatch --parsable -p urgent -N2 --exclusive -o "$out/urgent.out" --wrap "echo urgent ran")
  signalled=$SECONDS
  echo "submitted urgent job $urgent (preempts job $job)"
else
  scancel --signal=USR1 "$job"
  signalled=$SECONDS
  echo "sent USR1 to job $job"
fi

second_run_done "$signalled" "$([[ $case_name == preempt ]] && echo "the urgent job's submission" || echo USR1)"

cls=$([[ $case_name == preempt ]] && echo preempt || echo timelimit)
/usr/bin/python3 - "$out" "$cls" <<'PY'
import glob, json, sys
out, cls = sys.argv[1], sys.argv[2]
ck = [json.load(open(f)) for f in glob.glob(out + "/run0/checkpoint.rank*.json")]
assert sorted(int(c["rank"]) for c in ck) == [0, 1, 2, 3], ck
assert all(c["request"] == "checkpoint-and-stop" for c in ck), ck
first = [json.load(open(f)) for f in glob.glob(out + "/run0/rank*.json")]
assert all("SLURM_RESTART_COUNT" not in r for r in first), first
second = [json.load(open(f)) for f in glob.glob(out + "/run1/rank*.json")]
assert sorted(int(r["RANK"]) for r in second) == [0, 1, 2, 3], second
assert all(r["SLURM_RESTART_COUNT"] == "1" for r in second), second
assert not glob.glob(out + "/run1/checkpoint.rank*.json"), "the second run was asked to checkpoint"
ledger = json.load(open(out + "/ckpt/elastrun-requeue.json"))
assert ledger[cls] == 1 and sum(v for k, v in ledger.items() if k != "job_id") == 1, ledger
print("ok: 4 workers checkpointed in run 0; run 1 saw SLURM_RESTART_COUNT=1 and finished; ledger", ledger)
PY
log=$out/job.out
[[ $(grep -c "state CHECKPOINT_STOP class $cls" "$log") -eq 2 ]] || fail "expected CHECKPOINT_STOP class $cls on both agents"
[[ $(grep -c "2 of 2 local worker(s) checkpointed" "$log") -eq 2 ]] || fail "expected both agents' workers checkpointed"
[[ $(grep -c "requeued job $job (class $cls, requeue 1 of inf)" "$log") -eq 1 ]] ||
  fail "expected exactly one requeue call (group rank 0)"
grep -q "^\[elastrun node n1\] requeued job $job" "$log" || fail "the requeue did not come from n1 (group rank 0)"
[[ $(grep -c "done; exiting 0" "$log") -eq 2 ]] || fail "the second run's agents did not both exit 0"
if [[ $case_name == preempt ]]; then
  grep -q "urgent ran" "$out/urgent.out" 2>/dev/null || fail "the urgent job did not run"
fi
grep -E "state CHECKPOINT_STOP|received|requeue|exiting" "$log" | head -20
echo "ok: slurm.launcher_requeue_$case_name"
