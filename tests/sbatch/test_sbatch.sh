#!/usr/bin/env bash
# The job scripts in sbatch/ submitted with sbatch on the testbed, running the launcher's test
# worker (it writes its environment as rank<R>.gen<G>.json):
#   elastic  sbatch/elastic.sbatch on 4 nodes -> 8 workers, ranks in node order, exit 0; with no
#            flag and no ELASTRUN_JOB_DIR, the job directory $SLURM_SUBMIT_DIR/elastrun-<job> (0700)
#            holds every node's events (schema v1), the ranks' logs and outcome.json, and the
#            per-user index links to it
#   het      sbatch/het.sbatch (2 nodes x 2 workers + 1 node x 1 worker) -> 5 global ranks,
#            component 0 first
#   usage    sbatch/elastic.sbatch without a program -> the job fails with a usage line
#   requeue  sbatch/requeue.sbatch on 2 nodes running examples' `train` (libtorch); once it
#            trains, `scancel --signal=USR1` (what --signal=USR1@T sends before the time limit)
#            -> every worker checkpoints the same step and exits 85, the job is requeued
#            (Restarts=1), the second run resumes from that step and the job ends COMPLETED
#   spares   (private testbed) spares.sbatch on 4 nodes with 1 spare (the first 3 agents to arrive
#            train, the 4th waits); kill-node of a training node (not n1) -> the spare is admitted:
#            WORLD_SIZE stays 6, ranks in node order, no restart counted; the job COMPLETES
#   node_loss  (private testbed) elastic.sbatch, then `kill-node n3` mid-run -> the job keeps
#            its allocation (#SBATCH --no-kill), the survivors finish with WORLD_SIZE 6 and the
#            job ends COMPLETED with exit code 0; `elastrun status` then shows both rounds (8, 6),
#            n3 lost as the root cause and the time lost to it
# Usage: test_sbatch.sh CASE path/to/launcher_test_worker [path/to/train]
# Environment: SLURM_CONF etc. of the shared testbed (ELASTRUN_TESTBED_ENV), ELASTRUN_BIN, SBATCH_DIR.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
case_=$1 worker=$2 train=${3:-}
sandbox
out=$SANDBOX
job=
on_exit '[[ -z $job ]] || scancel "$job" 2>/dev/null'
show_on_failure 40 "$out/*.out"

# Submits a script and waits for it; prints the job's exit code. TMPDIR goes with the job so
# the agents' per-run files land in $out.
sbatch_options=()  # extra sbatch options (before the script)
submit() {
  local script=$1
  shift
  local rc=0
  (cd "$out" && TMPDIR=$out/tmp TEST_WORKER_OUT_DIR=$out ELASTRUN=$ELASTRUN_BIN/elastrun \
    timeout 240 sbatch --wait --parsable --chdir="$out" --output="$out/%x-%j.out" "${sbatch_options[@]}" "$SBATCH_DIR/$script" "$@" \
    >"$out/submit.txt" 2>&1) || rc=$?
  job=
  echo "$rc"
}

# job_in_background N SBATCH_OPTION... -- SCRIPT ARGS...: submit SCRIPT (with the sbatch options,
# if any) in the background; its exit code goes to $out/rc.txt. Waits (120 s) until N workers run,
# then sets job; the job must not end before.
job_in_background() {
  local n=$1
  shift
  local options=()
  while [[ $1 != -- ]]; do options+=("$1"); shift; done
  shift
  (sbatch_options=("${options[@]}"); submit "$@" >"$out/rc.txt") &
  waiter=$!
  track_pid -s TERM "$waiter"
  wait_for -a "$waiter" "the job ended early" 120 have_files "$n" "$out/rank*.json" || fail "$n workers did not start"
  job=$(head -1 "$out/submit.txt" | cut -d';' -f1)
}

# job_completed WHAT: the background job exited 0 and ended COMPLETED (else fail naming WHAT)
job_completed() {
  await "$waiter"
  rc=$(cat "$out/rc.txt")
  ((rc == 0)) || fail "the job ended with $rc$1"
  state=$(scontrol show job "$job" | grep -o 'JobState=[A-Z]*')
  [[ $state == JobState=COMPLETED ]] || fail "job $job: $state, expected COMPLETED"
  job=
}

case $case_ in
elastic)
  unset ELASTRUN_JOB_DIR  # the default: beside the directory sbatch was run from
  rc=$(submit elastic.sbatch "$worker")
  ((rc == 0)) || fail "elastic.sbatch ended with $rc: $(cat "$out/submit.txt")"
  /usr/bin/python3 - "$out" "$(head -1 "$out/submit.txt")" "$ELASTRUN_INDEX_DIR" <<'PY'
import glob, json, os, stat, sys
import elastrun.events as ev
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
job_id = sys.argv[2].split(";")[0].strip()
job_dir = os.path.join(sys.argv[1], "elastrun-" + job_id)
assert stat.S_IMODE(os.stat(job_dir).st_mode) == 0o700, oct(os.stat(job_dir).st_mode)
files = sorted(os.path.basename(f) for f in glob.glob(job_dir + "/events-*.jsonl"))
assert files == ["events-n%d.jsonl" % n for n in range(1, 5)], files
events = ev.read([job_dir])
assert all(e["v"] == 1 for e in events) and {e["node"] for e in events} == {"n1", "n2", "n3", "n4"}
assert sum(e["event"] == "round" for e in events) == 4, [e["event"] for e in events]
outcome = json.load(open(os.path.join(job_dir, "outcome.json")))
assert outcome["outcome"] == "succeeded" and outcome["exit_code"] == 0, outcome
logs = glob.glob(job_dir + "/n*/*/attempt_0/*/stdout.log")
assert len(logs) == 8, logs  # every rank's output, per node
index = glob.glob(os.path.join(sys.argv[3], "*", job_id))
assert len(index) == 1 and os.path.realpath(index[0]) == os.path.realpath(job_dir), index
print("ok: the job directory", job_dir, "has", len(events), "events of 4 nodes, 8 ranks' logs and the outcome")
assert sorted(int(r["RANK"]) for r in runs) == list(range(8)), runs
for r in runs:
    assert r["WORLD_SIZE"] == "8" and r["LOCAL_WORLD_SIZE"] == "2", r
    assert r["ELASTRUN_NODE"] == ["n1", "n2", "n3", "n4"][int(r["RANK"]) // 2], r
    assert r["TORCHELASTIC_MAX_RESTARTS"] == "3", r
    assert r["TORCHELASTIC_RUN_ID"].startswith(job_id), (job_id, r)  # run id from the job id
print("ok: elastic.sbatch ran 8 workers on 4 nodes in node order")
PY
  ;;
het)
  rc=$(submit het.sbatch "$worker")
  ((rc == 0)) || fail "het.sbatch ended with $rc: $(cat "$out/submit.txt")"
  /usr/bin/python3 - "$out" <<'PY'
import glob, json, sys
runs = sorted((json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")), key=lambda r: int(r["RANK"]))
assert [int(r["RANK"]) for r in runs] == list(range(5)), runs
assert all(r["WORLD_SIZE"] == "5" for r in runs), runs
assert all(r["LOCAL_WORLD_SIZE"] == "2" for r in runs[:4]), runs
assert [r["GROUP_RANK"] for r in runs[:4]] == ["0", "0", "1", "1"], runs
assert runs[4]["LOCAL_WORLD_SIZE"] == "1" and runs[4]["GROUP_RANK"] == "2", runs[4]
assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in runs}) == 1, runs
print("ok: het.sbatch ranks 0..4, component 0 (2 nodes x 2) first, then 1 node x 1")
PY
  ;;
usage)
  rc=$(submit elastic.sbatch)
  ((rc == 2)) || fail "elastic.sbatch without a program ended with $rc, expected 2"
  grep -q "usage: sbatch" "$out"/elastic-*.out || fail "no usage line in the job output"
  echo "ok: a missing program fails the job with a usage line"
  ;;
requeue)
  [[ -x $train ]] || skip "no libtorch example trainer"
  TMPDIR=$out/tmp CKPT=$out/ck NPROC=2 ELASTRUN=$ELASTRUN_BIN/elastrun \
    sbatch --parsable --nodes=2 --chdir="$out" --output="$out/requeue.out" "$SBATCH_DIR/requeue.sbatch" \
    "$train" --steps 400 --step-ms 50 --ckpt-every 0 >"$out/submit.txt"
  job=$(cut -d';' -f1 "$out/submit.txt")
  wait_for 180 grep -qs "step 20/400" "$out/requeue.out" || fail "job $job did not start training"
  scancel --signal=USR1 "$job"
  completed() {
    state=$(scontrol show job "$job" | grep -o 'JobState=[A-Z_]*')
    [[ $state == JobState=FAILED || $state == JobState=CANCELLED ]] && fail "job $job: $state"
    [[ $state == JobState=COMPLETED ]]
  }
  wait_for -i 1 300 completed || fail "job $job did not complete after the requeue: $(scontrol show job "$job" | grep -o 'JobState=[A-Z_]*')"
  scontrol show job "$job" | grep -q "Restarts=1" || fail "job $job was not requeued exactly once"
  job=
  saved=$(grep -o "checkpoint-and-stop: saved step [0-9]*" "$out/requeue.out" | awk '{print $4}' | sort -u)
  [[ $(wc -w <<<"$saved") -eq 1 ]] || fail "workers stopped at different steps or not at all: '$saved'"
  [[ $(grep -c "checkpoint-and-stop: saved step" "$out/requeue.out") -eq 4 ]] || fail "not all 4 workers checkpointed"
  grep -q "resumed from step $saved (saved by a world of 4, now 4)" "$out/requeue.out" ||
    fail "the requeued run did not resume from step $saved"
  grep -q "done: 400 steps" "$out/requeue.out" || fail "the requeued run did not finish"
  echo "ok: USR1 -> checkpoint of step $saved, requeued once, resumed and completed"
  ;;
spares)
  private_testbed_up 4
  # workers record their environment, then run until the test releases them
  printf '#!/bin/bash\n"%s" || exit\nuntil [[ -e %s/release ]]; do sleep 0.2; done\n' "$worker" "$out" >"$out/worker.sh"
  chmod +x "$out/worker.sh"
  job_in_background 6 --nodes=4 -- spares.sbatch "$out/worker.sh"
  # the first three agents to arrive train; the fourth waits as the spare
  read -r spare victim < <(/usr/bin/python3 - "$out" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
training = sorted({r["ELASTRUN_NODE"] for r in runs})
assert len(training) == 3, training
spare = ({"n1", "n2", "n3", "n4"} - set(training)).pop()
print(spare, [n for n in training if n != "n1"][0])
PY
)
  "$TB" kill-node "$victim"
  admitted() { ls "$out"/rank*.json | xargs grep -l "\"ELASTRUN_NODE\": *\"$spare\"" >/dev/null 2>&1; }
  wait_for 120 admitted || fail "the spare $spare was not admitted after kill-node $victim"
  touch "$out/release"
  job_completed ""
  /usr/bin/python3 - "$out" "$victim" "$spare" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
last = max(int(r["ELASTRUN_GENERATION"]) for r in runs)
final = sorted((r for r in runs if int(r["ELASTRUN_GENERATION"]) == last), key=lambda r: int(r["RANK"]))
assert [r["WORLD_SIZE"] for r in final] == ["6"] * 6, final
nodes = sorted({"n1", "n2", "n3", "n4"} - {sys.argv[2]})
assert [r["ELASTRUN_NODE"] for r in final] == [n for n in nodes for _ in (0, 1)], final
assert all(r["TORCHELASTIC_RESTART_COUNT"] == "0" for r in final), final
print(f"ok: kill-node {sys.argv[2]} -> the spare {sys.argv[3]} took its place: WORLD_SIZE 6 on {' '.join(nodes)}, job COMPLETED")
PY
  ;;
node_loss)
  private_testbed_up 4
  TEST_WORKER_SLEEP=120 TEST_WORKER_SLEEP_WORLD_SIZE=8 job_in_background 8 -- elastic.sbatch "$worker"
  "$TB" kill-node n3
  job_completed " after kill-node n3"
  /usr/bin/python3 - "$out" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.json")]
six = sorted((r for r in runs if r["WORLD_SIZE"] == "6"), key=lambda r: int(r["RANK"]))
assert [int(r["RANK"]) for r in six] == list(range(6)), runs
assert [r["ELASTRUN_NODE"] for r in six] == ["n1", "n1", "n2", "n2", "n4", "n4"], six
print("ok: after kill-node n3 the job finished on n1 n2 n4 with WORLD_SIZE 6 and ended COMPLETED")
PY
  # `elastrun status` of the sbatch job (the job CLI, docs/jobs.md): the loss, the smaller world, the time lost
  "$ELASTRUN_BIN/elastrun" status --json "$(head -1 "$out/submit.txt" | cut -d';' -f1)" >"$out/status.json" ||
    fail "elastrun status: $(cat "$out/status.json")"
  /usr/bin/python3 - "$out/status.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["state"] == "SUCCEEDED" and s["world_size"] == 6, s
assert [r["world_size"] for r in s["rounds"]] == [8, 6], s
assert [l["node"] for l in s["nodes_lost"]] == ["n3"] and s["root_cause"] == "node n3 lost", s
assert 0 < s["time_lost_s"] < 60 and s["restarts"] == 0, s
print(f"ok: elastrun status: world 8 -> 6, n3 lost, {s['time_lost_s']:.2f} s lost to it")
PY
  ;;
*) fail "unknown case $case_" ;;
esac
