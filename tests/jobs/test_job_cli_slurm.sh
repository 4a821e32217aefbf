#!/usr/bin/env bash
# The job CLI on the shared testbed, driven as a user would, in sequence, on one job:
#   --dryrun -> a script `sbatch --test-only` accepts; run dist.ddp -j 2x2 -> the handle; status
#   RUNNING at world 4; log (from another directory) shows every rank's lines; describe; list;
#   cancel -> the workers checkpoint, the job is not requeued, status CANCELLED; a short utils.sh
#   job run --wait -> SUCCEEDED, and its status still SUCCEEDED after slurmctld forgot it
#   (MinJobAge); --max_retries with scancel --signal=USR1 (the time limit's warning): checkpoint,
#   requeue seen in status, SUCCEEDED; --het -j 2x1 -j 1x2 -> world 4, SUCCEEDED;
#   Slurm's refusal of a job quoted in one line.
# Usage: test_job_cli_slurm.sh   Environment: the shared testbed's (ELASTRUN_TESTBED_ENV), ELASTRUN_BIN.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
elastrun=$ELASTRUN_BIN/elastrun
sandbox
out=$SANDBOX
export ELASTRUN_PYTHON=/usr/bin/python3
cd "$out"
jobs_started=()
on_exit 'for j in "${jobs_started[@]}"; do scancel "$j" 2>/dev/null; done; true'
show_on_failure 30 "$out/index/*/*/batch.out"

handle_of() { grep -o 'slurm://[^ ]*' "$1" | head -1; }
state_of() { "$elastrun" status --json "$1" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)[sys.argv[1]])' "$2"; }

test_expect_success '--dryrun prints a batch script sbatch --test-only accepts' <<'CASE'
  "$elastrun" run --dryrun dist.ddp -j 2:4x2 --script "$here/cli_worker.py" -- 5 >dry.sbatch
  grep -q '^#SBATCH --nodes=4$' dry.sbatch || fail "dryrun: $(cat dry.sbatch)"
  sbatch --test-only dry.sbatch >test_only.txt 2>&1 || fail "sbatch --test-only refused it: $(cat test_only.txt)"
  grep -q 'to start at' test_only.txt || fail "sbatch --test-only: $(cat test_only.txt)"
CASE

test_expect_success 'run --wait of a short utils.sh job: SUCCEEDED' <<'CASE'
  timeout 120 "$elastrun" run --wait utils.sh echo short job >short.txt 2>&1 || fail "run --wait: $(cat short.txt)"
  short=$(handle_of short.txt)
  jobs_started+=("${short##*/}")
  grep -q "$short SUCCEEDED" short.txt || fail "no SUCCEEDED line: $(cat short.txt)"
  "$elastrun" log "$short" | grep -qx '\[rank 0\] short job' || fail "log: $("$elastrun" log "$short")"
  echo "$short" >short_handle
CASE

test_expect_success 'run dist.ddp -j 2x2: the handle, RUNNING at world 4, every rank in log from elsewhere' <<'CASE'
  "$elastrun" run -cfg time=00:05:00 dist.ddp -j 2x2 --script "$here/cli_worker.py" --name clitest >run.txt 2>&1 \
    || fail "run: $(cat run.txt)"
  h=$(handle_of run.txt)
  [[ $h == slurm://$(scontrol show config | awk '/^ClusterName/ {print $3}')/[0-9]* ]] || fail "handle: $(cat run.txt)"
  jobs_started+=("${h##*/}")
  echo "$h" >handle
  all_ranks() { (($(cd / && "$elastrun" log "$h" | grep -c '^\[rank [0-3]\] hello from rank [0-3] of 4$') == 4)); }
  wait_for 120 all_ranks || fail "not every rank's line: $("$elastrun" log "$h"; "$elastrun" status "$h")"
  [[ $(state_of "$h" state) == RUNNING ]] || fail "status: $("$elastrun" status "$h")"
  [[ $(state_of "$h" world_size) == 4 ]] || fail "world size: $("$elastrun" status "$h")"
  [[ $(state_of "$h" slurm_state) == RUNNING ]] || fail "slurm state: $("$elastrun" status "$h")"
CASE

test_expect_success 'describe and list show the job' <<'CASE'
  h=$(cat handle)
  "$elastrun" describe "$h" >describe.txt
  grep -q 'dist.ddp -j 2x2' describe.txt && grep -q '#SBATCH --nodes=2' describe.txt && grep -q 'time=00:05:00' describe.txt \
    || fail "describe: $(cat describe.txt)"
  "$elastrun" list >list.txt
  grep -q "^$h  *clitest  *RUNNING  *4 " list.txt || fail "list: $(cat list.txt)"
  grep -q "^$(cat short_handle) .*SUCCEEDED" list.txt || fail "list: $(cat list.txt)"
  "$elastrun" list --all-users | grep -q "^$h " || fail "list --all-users: $("$elastrun" list --all-users)"
CASE

test_expect_success 'cancel: checkpoint first, no requeue, CANCELLED' <<'CASE'
  h=$(cat handle)
  timeout 120 "$elastrun" cancel --timeout 90 "$h" >cancel.txt 2>&1 || fail "cancel: $(cat cancel.txt)"
  grep -q 'the workers checkpointed first' cancel.txt || fail "cancel: $(cat cancel.txt)"
  for r in 0 1 2 3; do
    "$elastrun" log --rank $r "$h" | grep -q "rank $r checkpointed" || fail "rank $r did not checkpoint: $("$elastrun" log "$h")"
  done
  # cancel returns once Slurm has it ended too: status right after says so
  [[ $(state_of "$h" state) == CANCELLED ]] || fail "status right after cancel: $("$elastrun" status "$h")"
  [[ $(state_of "$h" requeues) == 0 ]] || fail "requeued: $("$elastrun" status "$h")"
  scontrol show job "${h##*/}" 2>/dev/null | grep -q 'Restarts=0' || fail "Slurm requeued it: $(scontrol show job "${h##*/}")"
CASE

test_expect_success '--max_retries and a time limit: checkpoint, the requeue in status, then SUCCEEDED' <<'CASE'
  "$elastrun" run -cfg time=00:05:00 dist.ddp --max_retries 1 -j 2x1 --script "$here/cli_worker.py" -- 50 \
    >requeue_run.txt 2>&1 || fail "run: $(cat requeue_run.txt)"
  h=$(handle_of requeue_run.txt)
  jobs_started+=("${h##*/}")
  both_up() { (($("$elastrun" log "$h" | grep -c 'hello from rank [01] of 2$') == 2)); }
  wait_for 120 both_up || fail "not started: $("$elastrun" status "$h")"
  # what Slurm's --signal=USR1@120 sends the steps before the time limit
  scancel --signal=USR1 "${h##*/}"
  requeued() { [[ $(state_of "$h" requeues) == 1 ]]; }
  wait_for 90 requeued || fail "no requeue in status: $("$elastrun" status "$h")"
  for r in 0 1; do
    "$elastrun" log --rank $r "$h" | grep -q "rank $r checkpointed" || fail "rank $r did not checkpoint: $("$elastrun" log "$h")"
  done
  timeout 300 "$elastrun" status --watch "$h" >watch.txt 2>&1 || fail "status --watch: $(tail -5 watch.txt)"
  [[ $(state_of "$h" state) == SUCCEEDED ]] || fail "status: $("$elastrun" status "$h")"
  [[ $(state_of "$h" requeues) == 1 ]] || fail "requeues: $("$elastrun" status "$h")"
  (($("$elastrun" log "$h" | grep -c 'rank [01] done$') == 2)) || fail "the requeued run did not finish: $("$elastrun" log "$h")"
  scontrol show job "${h##*/}" 2>/dev/null | grep -q 'Restarts=1' || fail "Slurm: $(scontrol show job "${h##*/}")"
CASE

test_expect_success '--het: one component per -j, all in one rendezvous (world 4)' <<'CASE'
  "$elastrun" run --dryrun dist.ddp --het -j 2x2 -j 1x1 --script "$here/cli_worker.py" -- 5 >het.sbatch
  sbatch --test-only het.sbatch >het_test_only.txt 2>&1 || fail "sbatch --test-only refused it: $(cat het_test_only.txt)"
  timeout 240 "$elastrun" run --wait dist.ddp --het -j 2x1 -j 1x2 --script "$here/cli_worker.py" -- 10 \
    >het_run.txt 2>&1 || fail "run --wait: $(cat het_run.txt)"
  h=$(handle_of het_run.txt)
  jobs_started+=("${h##*/}")
  "$elastrun" log "$h" >het_log.txt
  for r in 0 1 2 3; do grep -qx "\[rank $r\] hello from rank $r of 4" het_log.txt || fail "rank $r: $(cat het_log.txt)"; done
  [[ $(state_of "$h" state) == SUCCEEDED ]] || fail "status: $("$elastrun" status "$h")"
  "$elastrun" describe "$h" | grep -q -- '--het -j 2x1 -j 1x2' || fail "describe: $("$elastrun" describe "$h")"
CASE

test_expect_success "sbatch's refusal is quoted in one line" <<'CASE'
  rc=0
  "$elastrun" run -cfg partition=no_such_partition utils.sh true >refused.txt 2>&1 || rc=$?
  ((rc == 1)) && (($(wc -l <refused.txt) == 1)) && grep -q 'sbatch refused the job: .*[Pp]artition' refused.txt \
    || fail "rc $rc: $(cat refused.txt)"
CASE

test_expect_success 'status after slurmctld forgot the job: from the job directory' <<'CASE'
  short=$(cat short_handle)
  forgotten() { ! scontrol show job "${short##*/}" >/dev/null 2>&1; }
  wait_for -i 2 90 forgotten || fail "slurmctld still knows job ${short##*/} (MinJobAge)"
  [[ $(state_of "$short" state) == SUCCEEDED ]] || fail "status: $("$elastrun" status "$short")"
  [[ $(state_of "$short" slurm_state) == None ]] || fail "slurm state: $("$elastrun" status --json "$short")"
CASE

test_done
