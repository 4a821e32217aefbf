#!/usr/bin/env bash
# The exactly-once fault suite: a real sbatch/ script runs examples' `train` to a fixed number of
# steps on a private testbed while the test injects a fault, and then asserts the five points of
# the promise "a failure changes nothing in the result":
#   1. the job ends COMPLETED;
#   2. the final checkpoint's model equals a failure-free reference run's (one process, same seed
#      and global batch) within 1e-4 max abs difference (elastrun-ckpt diff);
#   3. the committed checkpoint steps strictly increase across the whole job (rank 0's
#      checkpoint_saved events, in time order, over every run of the job), and every step on disk
#      names the round that committed it (elastrun-ckpt ls: the fenced commit's token), a round
#      that formed, with rounds in step order (one history: nothing from a side that lost the job);
#   4. no process of the job is left on any node (no /proc/*/environ with its SLURM_JOB_ID);
#   5. the event logs say that the fault happened and was handled the way the scenario expects.
# Scenarios (one per ctest, faults.<name>, each runnable alone: test_faults.sh NAME):
#   worker_crash  elastic.sbatch, 2 nodes x 2 workers; rank 1 exits 1 at step 17 (--fail-at-step):
#                 one restart job-wide, both rounds of world 4, resumed from step 15
#   node_loss     elastic.sbatch, 4 nodes x 2; kill-node n3 mid-run: n3 lost, a round of world 6
#   shrink        elastic.sbatch, 4 nodes x 2; scontrol update NumNodes=3 mid-run: Slurm releases a
#                 node and ends its step tasks, the survivors re-form with world 6
#   spare         spares.sbatch, 4 nodes x 2 with 1 spare (3 train, world 6), a memory snapshot
#                 every step; kill-node of a training node other than n1: the spare is admitted, the
#                 world stays 6, no restart counted, and the job resumes from the copies the lost
#                 node's partner held and the spare fetched (source memory-partner, <= 2 steps lost)
#   time_limit    requeue.sbatch, 2 nodes x 2; scancel --signal=USR1 (what --signal=USR1@T sends):
#                 checkpoint-and-stop, requeue (Restarts=1), the second run resumes and completes
#   two_faults    elastic.sbatch, 4 nodes x 2; kill-node n3, then rank 1 exits 1 at step 30 in the
#                 world of 6: a round of 6, one restart, another round of 6
#   first_node    requeue.sbatch (--nodes=2-4), 4 nodes x 2; kill-node n1, the node running the batch
#                 script, the store and group rank 0. The job survives in place: --no-kill keeps it
#                 on the other nodes, the survivors fail over to a standby store and re-form at
#                 world 6, and since the batch script died with n1, the new group rank 0 ends the
#                 job itself once slurmctld has excised n1 (event job_completed); no requeue
#   resize_requeue  requeue.sbatch (--nodes=2-4), 4 nodes x 1 worker: kill-node n3 (world 4 -> 3),
#                 then n4 drained and scancel --signal=USR1: checkpoint, requeue; the second run
#                 starts on the 2 nodes left (the node range) and resumes at world 2
#   het           het.sbatch, component 0: 3 nodes x 2 workers, component 1: 1 node x 1 (world 7,
#                 --het-nnodes=2:3,1:1); kill-node n3 of component 0, then rank 1 exits 1 at step 30:
#                 component 0 shrinks (world 5, members n1 n2 n4), component 1 keeps its node and
#                 its 1 worker (last rank), one restart, another round of 5. (Component 0 is the
#                 multi-node one: Slurm applies any node failure of a het job to the leader too.)
#   partition     elastic.sbatch, 4 nodes x 2; testbed partition n1,n2,n3 / n4 mid-run (Slurm sees
#                 every node up): the majority, with the store, goes on at world 6; n4 stops its
#                 workers on its own clock and reports no quorum (event partitioned), forms no round
#                 of its own; after heal it rejoins. With a memory snapshot every step, and n4 cut
#                 off while writing the one of step 20 (parked before its commit): world 6 resumes
#                 from step 20 in the others' memory. Label partition (#29)
#   partition_during_save  elastic.sbatch, 4 nodes x 2; rank 0's save of step 20 parked inside its
#                 commit, then `isolate n1` (rank 0's node and the store's host); the commit is
#                 released once n2..n4 re-formed at world 6 (they resume from 15): it does not land
#                 (n1's agent stopped its workers when the others' leases ended; a commit asked for
#                 then is refused by the fence: FencedCommit.* tests that part). After heal n1
#                 rejoins. Label partition (#29)
#   flap          elastic.sbatch, 4 nodes x 2; n4 cut off for 1 s and healed, twice (shorter than the
#                 heartbeat timeout): at most one re-form per flap (when n4 fences itself it
#                 reconnects to the store while its workers stop, trying again while the cut lasts,
#                 so the others find it alive and wait for it; often none: TCP resends the
#                 keep-alive after the heal); n4 never alone. Label partition
#   kill_during_save  elastic.sbatch, 2 nodes x 2; the async save of step 20 is parked inside its
#                 commit (ELASTRUN_TRAIN_PARK_SAVE_AT_STEP, a test switch of train) and every worker
#                 is SIGKILLed there: one restart, resumed from step 15, no partial step left
# With --shared-fs the private testbed has a GlusterFS volume every node mounts itself, and the
# job's checkpoints go there (labels sharedfs: faults.node_loss_sharedfs, faults.time_limit_sharedfs,
# faults.kill_during_save_sharedfs).
# With --preload (Python trainer only) the agents run with --preload=torch: every worker start,
# restart and re-form is a fork of the node's preloader, and point 5 also asserts that every
# workers_started event says started_by "preload" for each worker.
# Usage: test_faults.sh SCENARIO [--shared-fs] [--python [--preload]]   Environment: ELASTRUN_BIN (build/bin), SBATCH_DIR (sbatch/),
# and the shared testbed's (ELASTRUN_TESTBED_ENV; a private testbed is used).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
usage="usage: test_faults.sh SCENARIO [--shared-fs] [--python [--preload]]"
scenario=${1:?$usage}
shared_fs= python= preload=
for option in "${@:2}"; do
  case $option in
  --shared-fs) shared_fs=--shared-fs ;;
  --python) python=--python ;;
  --preload) preload=--preload=torch ;;
  *) fail "unknown option '$option' ($usage)" ;;
  esac
done
[[ -z $preload || -n $python ]] || fail "--preload needs --python ($usage)"
FAIL_TAG=$scenario${shared_fs:+ on the shared filesystem}${python:+ with the Python trainer}${preload:+ (--preload=torch)}
bin=${ELASTRUN_BIN:?ELASTRUN_BIN: the bin directory of the build}
job_scripts=${SBATCH_DIR:?SBATCH_DIR: the sbatch/ directory of the repository}
# the trainer the job runs, and the same trainer as one process (the failure-free reference)
if [[ -n $python ]]; then
  # examples/python/train.py (DDP, elastrun.checkpoint): the agent runs *.py with $ELASTRUN_PYTHON,
  # and sbatch passes PYTHONPATH (the build's package) on to the job
  trainer=("${PYTHON_TRAINER:?PYTHON_TRAINER: examples/python/train.py}")
  reference_trainer=(/usr/bin/python3 "$PYTHON_TRAINER")
  export ELASTRUN_PYTHON=/usr/bin/python3
  /usr/bin/python3 -c "import elastrun.checkpoint" 2>/dev/null || fail "the elastrun Python package is not importable (PYTHONPATH=${PYTHONPATH-})"
else
  [[ -x $bin/train ]] || skip "no libtorch example trainer (build/bin/train)"
  trainer=("$bin/train")
  reference_trainer=("$bin/train")
fi
sandbox
out=$SANDBOX
mkdir -p "$out/tmp"
job=
on_exit '[[ -z $job ]] || scancel "$job" 2>/dev/null'
show_on_failure 150 "$out/job.out"
show_on_failure 20 "$out/logs/events-*.jsonl"

train_args=(--steps 40 --ckpt-every 5 --seed 11 --global-batch 240)

# ---- helpers ------------------------------------------------------------------------------------

# submit NODES SCRIPT [VAR=VALUE...] -- ARGS...: submits an sbatch/ script on NODES nodes (a count
# or a MIN-MAX range), 2 workers per node, running train; sets job.
submit() {
  local nodes=$1 script=$2
  shift 2
  local vars=()
  while [[ $1 != -- ]]; do vars+=("$1"); shift; done
  shift
  job=$(env TMPDIR="$out/tmp" ELASTRUN="$bin/elastrun" NPROC=2 MIN_NODES=2 "${vars[@]}" \
    sbatch --parsable --nodes="$nodes" --chdir="$out" --output="$out/job.out" "$job_scripts/$script" "$@")
  job=${job%%;*}
  echo "job $job: $script on $nodes nodes"
}

# (a het job shows one record per component: they must agree)
job_state() { scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 | sort -u | paste -sd,; }
job_ended() { [[ $(job_state) == @(COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) ]]; }

# the newest step rank 0 reported (0 before the first)
progress() {
  /usr/bin/python3 -c '
import glob, sys, elastrun.events as ev
events = ev.read(glob.glob(sys.argv[1] + "/events-*.jsonl"), warn=lambda _: None)  # lines still being written
print(max((e["step"] for e in events if e["event"] == "step"), default=0))' "$out/logs"
}
past_step() { (($(progress) >= $1)); }
# seen PYTHON_EXPR: true when the expression over `events` (the event logs so far) holds
seen() {
  /usr/bin/python3 -c '
import glob, sys, elastrun.events as ev
events = ev.read(glob.glob(sys.argv[1] + "/events-*.jsonl"), warn=lambda _: None)
sys.exit(0 if eval(sys.argv[2]) else 1)' "$out/logs" "$1"
}
# wait_past_step N: until rank 0 has done N steps (fails if the job ends first)
wait_past_step() {
  local n=$1 deadline=$((SECONDS + 180))
  until past_step "$n"; do
    job_ended && fail "job $job ended ($(job_state)) before step $n"
    ((SECONDS < deadline)) || fail "training did not reach step $n in 180 s"
    sleep 0.2
  done
}

# the event logs as one JSON array, in time order
events_json() {
  /usr/bin/python3 -c '
import json, sys, elastrun.events as ev
print(json.dumps(ev.read(sys.argv[1:])))' "$out"/logs/events-*.jsonl
}

# check_promise EXPECT_PY: the five points; EXPECT_PY is Python over `events` (a list, in time
# order) that asserts point 5.
check_promise() {
  local expect=$1
  wait_for -i 0.5 ${JOB_PATIENCE:-300} job_ended || fail "job $job did not end within 300 s: $(job_state)"
  # 1.
  [[ $(job_state) == COMPLETED ]] || fail "1: job $job ended $(job_state), expected COMPLETED"
  # 2.
  "$bin/elastrun-ckpt" diff "$ckpt" "$out/reference" >"$out/diff.txt" 2>&1 ||
    fail "2: the final model differs from the failure-free run: $(tail -3 "$out/diff.txt")"
  # 3. and 5.
  events_json >"$out/events.json"
  "$bin/elastrun-ckpt" ls "$ckpt" >"$out/ls.txt" 2>&1 || fail "3: elastrun-ckpt ls: $(cat "$out/ls.txt")"
  /usr/bin/python3 - "$out/events.json" "$expect" "$preload" "$out/ls.txt" <<'PY' || fail "3/5: the event logs do not show what should have happened (above)"
import json, re, sys
events = json.load(open(sys.argv[1]))
saved = [e["step"] for e in events if e["event"] == "checkpoint_saved" and e.get("rank") == 0 and e.get("tier", "file") == "file"]
assert saved, "3: no checkpoint was committed"
assert all(a < b for a, b in zip(saved, saved[1:])), f"3: committed steps do not strictly increase: {saved}"
rounds = [e for e in events if e["event"] == "round"]
# every step on disk names the round that committed it (the fenced commit token, requeue and
# generation): a round that formed in this job, and in step order the rounds never go back, so
# the directory holds one history (no step of a side that lost the job)
formed = {(int(e["run_id"].rsplit(".r", 1)[1]), e["generation"]) for e in rounds}
on_disk = []
for line in open(sys.argv[4]):
    if not re.match(r"[0-9]+ ", line):
        continue
    m = re.search(r"\(committed by rendezvous round ([0-9]+), requeue ([0-9]+)\)$", line.rstrip())
    assert m, f"3: a step on disk without the round that committed it: {line.strip()}"
    on_disk.append((int(line.split()[0]), (int(m[2]), int(m[1]))))
assert on_disk, "3: elastrun-ckpt ls lists no step"
for step, token in on_disk:
    assert token in formed, f"3: step {step} was committed by round {token}, which never formed (rounds {sorted(formed)})"
by_round = [token for _, token in sorted(on_disk)]
assert by_round == sorted(by_round), f"3: the steps on disk do not follow one history of rounds: {sorted(on_disk)}"
worlds = []
for e in rounds:  # one entry per round (every agent logs it)
    if not worlds or worlds[-1][0] != (e["run_id"], e["generation"]):
        worlds.append(((e["run_id"], e["generation"]), e["world_size"]))
worlds = [w for _, w in worlds]
kinds = [e["event"] for e in events]
try:
    exec(sys.argv[2])
    if sys.argv[3]:  # --preload: every worker of every start was forked by the preloader
        starts = [e for e in events if e["event"] == "workers_started"]
        how = sorted({h for e in starts for h in e.get("started_by", ["(none)"])})
        assert starts and how == ["preload"], f"workers not started by the preloader: started_by {how}"
except AssertionError as err:
    print(f"5: {err}; rounds' world sizes {worlds}; committed steps {saved}", file=sys.stderr)
    sys.exit(1)
print(f"rounds' world sizes {worlds}; committed steps {saved}; on disk (step, (requeue, round)): {sorted(on_disk)}")
PY
  # 4.
  job_processes() {
    local p
    for p in /proc/[0-9]*; do
      tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qxE "SLURM_(HET_)?JOB_ID=$job" && echo "${p#/proc/}"
    done
    return 0
  }
  no_job_processes() { [[ -z $(job_processes) ]]; }
  wait_for -i 0.5 30 no_job_processes || fail "4: processes of job $job are left: $(job_processes | tr '\n' ' ')"
  echo "ok: $scenario: COMPLETED, $(tail -1 "$out/diff.txt"), steps increase, no process left, events as expected"
  job=
}

# ---- the scenarios ------------------------------------------------------------------------------

nodes=4
[[ $scenario == @(worker_crash|time_limit|kill_during_save) ]] && nodes=2
# shellcheck disable=SC2086 # $shared_fs: no option or one
private_testbed_up $shared_fs "$nodes" "faults-$scenario${shared_fs:+-sfs}${python:+-py}${preload:+-pre}"
# the job's checkpoints: the local disk every emulated node shares, or with --shared-fs the
# GlusterFS volume every node mounts itself (the test reads them through the login node's mount)
ckpt=$out/ckpt
if [[ -n $shared_fs ]]; then
  ckpt=$TESTBED_SHARED_FS/faults-ckpt
  echo "checkpoints on the shared filesystem: $ckpt"
fi

# the failure-free reference: one process, world 1
"${reference_trainer[@]}" "${train_args[@]}" --ckpt-dir "$out/reference" >"$out/reference.log" 2>&1 ||
  fail "the reference run failed: $(tail -5 "$out/reference.log")"

agent_args=(--log-dir "$out/logs" --checkpoint-dir "$ckpt" ${preload:+"$preload"})
case $scenario in
worker_crash)
  submit 2 elastic.sbatch -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 100 --fail-at-step 17:1
  check_promise '
assert worlds == [4, 4], "expected two rounds of world 4 (a restart)"
decisions = [e["action"] for e in events if e["event"] == "failure_decision"]
assert decisions.count("restart") == 1, f"expected one counted restart, got {decisions}"
assert any(e["event"] == "worker_exit" and e["rank"] == 1 and e["exit_code"] == 1 for e in events), "no exit 1 of rank 1"
assert [e["step"] for e in events if e["event"] == "resumed"] == [15], "expected one resume from step 15"'
  ;;
node_loss)
  submit 4 elastic.sbatch -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 150
  wait_past_step 12
  "$TB" kill-node n3
  check_promise '
assert worlds[0] == 8 and worlds[-1] == 6, "expected world 8, then 6"
lost = {e["member"] for e in events if e["event"] == "member_lost"}
assert lost == {"n3"}, f"expected n3 lost, got {lost}"
assert not any(e["event"] == "failure_decision" and e["action"] == "restart" for e in events), "a node loss counted as a restart"'
  ;;
shrink)
  submit 4 elastic.sbatch -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 150
  wait_past_step 12
  scontrol update JobId="$job" NumNodes=3 >"$out/scontrol.txt" 2>&1 || fail "scontrol update NumNodes=3: $(cat "$out/scontrol.txt")"
  shrunk=$job
  check_promise '
assert worlds[0] == 8 and worlds[-1] == 6, "expected world 8, then 6 after the shrink"
assert len({e["member"] for e in events if e["event"] == "member_lost"}) == 1, "expected one member lost"'
  scontrol show job "$shrunk" | grep -q "NumNodes=3" || fail "job $shrunk does not show NumNodes=3 after the shrink"
  ;;
spare)
  submit 4 spares.sbatch SPARES=1 -- "${agent_args[@]}" --memory-checkpoints=64M "${trainer[@]}" "${train_args[@]}" \
    --step-ms 150 --memory-every 1
  wait_past_step 12
  victim=$(/usr/bin/python3 -c '
import glob, sys, elastrun.events as ev
events = ev.read(glob.glob(sys.argv[1] + "/events-*.jsonl"), warn=lambda _: None)
first = next(e for e in events if e["event"] == "round")
print(next(m for m in first["members"] if m != "n1"))' "$out/logs")
  echo "killing $victim, a training node other than n1"
  "$TB" kill-node "$victim"
  check_promise "
assert worlds[0] == 6 and worlds[-1] == 6 and len(worlds) >= 2, 'expected world 6, then 6 again with the spare'
assert {e['member'] for e in events if e['event'] == 'member_lost'} == {'$victim'}, 'expected $victim lost'
members = [e['members'] for e in rounds]
assert '$victim' not in members[-1] and len(members[-1]) == 3, f'the last round should be 3 nodes without $victim: {members[-1]}'
assert not any(e['event'] == 'failure_decision' and e['action'] == 'restart' for e in events), 'a node loss counted as a restart'
at = [i for i, e in enumerate(events) if e['event'] == 'resumed']
assert at and events[at[-1]]['source'] == 'memory-partner', f'expected a restore from the partner copies: {[events[i] for i in at]}'
reached = max(e['step'] for e in events[:at[-1]] if e['event'] == 'step')
assert reached - events[at[-1]]['step'] <= 2, f'resumed at step {events[at[-1]][\"step\"]} after step {reached}: more than 2 steps lost'"
  ;;
time_limit)
  submit 2 requeue.sbatch CKPT="$ckpt" -- --log-dir "$out/logs" ${preload:+"$preload"} "${trainer[@]}" "${train_args[@]}" --step-ms 100
  wait_past_step 12
  scancel --signal=USR1 "$job"
  requeued=$job
  check_promise '
requeues = [e for e in events if e["event"] == "requeue"]
assert len(requeues) == 1 and requeues[0]["requeued"] and requeues[0]["class"] == "timelimit", f"expected one timelimit requeue, got {requeues}"
assert len({e["run_id"] for e in rounds}) == 2, "expected a second run after the requeue"
stops = [e for e in events if e["event"] == "checkpoint_outcome" and e["kind"] == "stop"]
assert stops and all(e["complete"] for e in stops), f"checkpoint-and-stop incomplete: {stops}"
assert len([e for e in events if e["event"] == "resumed"]) == 1, "expected one resume"'
  scontrol show job "$requeued" | grep -q "Restarts=1" || fail "job $requeued was not requeued exactly once"
  ;;
two_faults)
  submit 4 elastic.sbatch -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 150 --fail-at-step 30:1
  wait_past_step 12
  "$TB" kill-node n3
  check_promise '
assert worlds[0] == 8 and worlds[-2:] == [6, 6], f"expected world 8, then 6, then 6 again after the restart"
assert {e["member"] for e in events if e["event"] == "member_lost"} == {"n3"}, "expected n3 lost"
decisions = [e["action"] for e in events if e["event"] == "failure_decision"]
assert decisions.count("restart") == 1, f"expected one counted restart after the re-form, got {decisions}"'
  ;;
first_node)
  submit 2-4 requeue.sbatch CKPT="$ckpt" -- --log-dir "$out/logs" ${preload:+"$preload"} "${trainer[@]}" "${train_args[@]}" --step-ms 150
  wait_past_step 12
  [[ $(scontrol show job "$job" | grep -o ' BatchHost=[^ ]*') == " BatchHost=n1" ]] || fail "the batch script does not run on n1"
  "$TB" kill-node n1
  survived=$job
  check_promise '
assert worlds[0] == 8 and worlds[-1] == 6, "expected world 8, then 6 without n1"
assert "n1" not in rounds[-1]["members"], "n1 is in the last round"
assert [e["store_node"] for e in events if e["event"] == "store_lost"][:1] == ["n1"], "expected the store on n1 lost"
assert len({e["run_id"] for e in rounds}) == 1, "expected one run (no requeue)"
ended = [e for e in events if e["event"] == "job_completed"]
assert len(ended) == 1 and ended[0]["ok"] and ended[0]["exit_code"] == 0 and ended[0]["batch_host"] == "n1", f"expected the new group rank 0 to end the job: {ended}"'
  scontrol show job "$survived" | grep -q "Restarts=0" || fail "job $survived was requeued"
  # a crashed node runs nothing: an srun that woke up on n1 would have killed the step everywhere
  if grep -q "srun: forcing job termination" "$out/job.out"; then fail "srun on the killed n1 ran again (testbed kill-node)"; fi
  ;;
resize_requeue)
  submit 2-4 requeue.sbatch CKPT="$ckpt" NPROC=1 -- --log-dir "$out/logs" ${preload:+"$preload"} "${trainer[@]}" "${train_args[@]}" --step-ms 150
  wait_past_step 8
  "$TB" kill-node n3
  world3() {
    /usr/bin/python3 -c '
import glob, sys, elastrun.events as ev
events = ev.read(glob.glob(sys.argv[1] + "/events-*.jsonl"), warn=lambda _: None)
sys.exit(0 if any(e["event"] == "round" and e["world_size"] == 3 for e in events) else 1)' "$out/logs"
  }
  wait_for -i 0.2 120 world3 || fail "no round of world 3 after kill-node n3"
  wait_past_step 20
  scontrol update NodeName=n4 State=DRAIN Reason=faults-resize_requeue
  scancel --signal=USR1 "$job"
  requeued=$job
  on_failure 'scontrol show job "$requeued" >&2; sinfo >&2'
  check_promise '
assert worlds == [4, 3, 2], "expected world 4, then 3 (node lost), then 2 (requeued onto the 2 nodes left)"
requeues = [e for e in events if e["event"] == "requeue"]
assert len(requeues) == 1 and requeues[0]["requeued"] and requeues[0]["class"] == "timelimit", f"expected one timelimit requeue, got {requeues}"
assert len([e for e in events if e["event"] == "resumed"]) == 2, "expected two resumes (after the loss, after the requeue)"'
  grep -h "max |Δ|" "$out/diff.txt"
  scontrol show job "$requeued" | grep -q "Restarts=1" || fail "job $requeued was not requeued exactly once"
  ;;
het)
  # 3 nodes x 2 workers + 1 node x 1 (world 7); sbatch's `:` gives each component its node count.
  # The multi-node component comes first: Slurm applies a node failure anywhere in a het job to
  # the leader (component 0) too, which survives it only with --no-kill and more than one node.
  job=$(env TMPDIR="$out/tmp" ELASTRUN="$bin/elastrun" NPROC0=2 NPROC1=1 MIN_NODES0=2 \
    sbatch --parsable --nodes=3 -w 'n[1-3]' --chdir="$out" --output="$out/job.out" : --nodes=1 -w n4 \
    "$job_scripts/het.sbatch" \
    "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 600 --fail-at-step 30:1)
  job=${job%%;*}
  echo "job $job: het.sbatch on 3 + 1 nodes"
  wait_past_step 12
  "$TB" kill-node n3
  # the point: the het job is still running once slurmctld has handled the node failure
  n3_down() { [[ $(sinfo -h -n n3 -o %T) == down* ]]; }
  wait_for -i 0.5 90 n3_down || fail "slurmctld did not mark n3 down"
  past_step 40 && fail "training ended before slurmctld handled the lost node; slow it down (--step-ms)"
  [[ $(job_state) == RUNNING ]] || fail "the het job did not survive the loss of n3: $(job_state)"
  survived=$job
  check_promise '
assert worlds[0] == 7 and worlds[-2:] == [5, 5], "expected world 7 (3x2 + 1x1), then 5 without n3, then 5 again after the restart"
assert {e["member"] for e in events if e["event"] == "member_lost"} == {"n3"}, "expected n3 lost"
first, last = rounds[0]["members"], rounds[-1]["members"]
assert first == ["n1", "n2", "n3", "n4"], f"ranks not in component order: {first}"
assert last == ["n1", "n2", "n4"], f"component 0 should have shrunk to n1, n2: {last}"
decisions = [e["action"] for e in events if e["event"] == "failure_decision"]
assert decisions.count("restart") == 1, f"expected one counted restart after the re-form, got {decisions}"
assert any(e["event"] == "worker_exit" and e["rank"] == 1 and e["exit_code"] == 1 for e in events), "no exit 1 of rank 1"
assert len({e["run_id"] for e in rounds}) == 1, "expected one run (the het job survives in place, no requeue)"'
  scontrol show job "$survived" | grep -q "Restarts=0" || fail "het job $survived was requeued"
  ;;
partition)
  # with a memory snapshot every step, and n4 cut off while it writes the one of step 20 (#29 (7)):
  # its local rank 0 is parked between the write into the agent's segment and the commit
  submit 4 elastic.sbatch ELASTRUN_TRAIN_PARK_MEMORY_AT=20@n4 -- "${agent_args[@]}" --memory-checkpoints=64M \
    "${trainer[@]}" "${train_args[@]}" --step-ms 150 --memory-every 1
  wait_for -i 0.2 180 test -e "$ckpt/train-parked-memory-20" || fail "n4's memory snapshot of step 20 was not parked"
  "$TB" partition n1,n2,n3 / n4
  # the majority (with the store) goes on at world 6; n4 stops its workers and waits without quorum
  wait_for -i 0.5 90 seen 'any(e["event"] == "round" and e["world_size"] == 6 for e in events)' ||
    fail "no round of world 6 after partition n1,n2,n3 / n4"
  wait_for -i 0.5 60 seen 'any(e["event"] == "partitioned" and e["waiting"] and e["node"] == "n4" for e in events)' ||
    fail "n4 did not report that it has no quorum"
  "$TB" heal
  touch "$ckpt/train-parked-memory-20.release"  # (n4's worker was stopped while parked)
  check_promise '
assert worlds[0] == 8 and 6 in worlds, "expected world 8, then 6 while n4 was cut off"
resumed = [(e["step"], e["source"]) for e in events if e["event"] == "resumed"]
assert resumed and resumed[0] == (20, "memory-local"), f"world 6 resumed from {resumed}: expected step 20 in memory"
assert 2 not in worlds, "n4 formed a round of its own"
waits = {e["node"] for e in events if e["event"] == "partitioned" and e["waiting"]}
assert waits == {"n4"}, f"expected only n4 without quorum, got {waits}"
alone = [e for e in events if e["event"] == "round" and e["node"] == "n4" and e["world_size"] < 8]
assert not alone, f"n4 was in a smaller round: {alone}"
assert not any(e["event"] == "failure_decision" and e["action"] == "restart" for e in events), "a partition counted as a restart"'
  ;;
partition_during_save)
  # rank 0 (n1, also the store's host) is inside the commit of step 20 when n1 is cut off; the
  # commit goes on only after the others have re-formed without n1 -- it must not land (fenced)
  submit 4 elastic.sbatch ELASTRUN_TRAIN_PARK_SAVE_AT_STEP=20 -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 150
  wait_for -i 0.2 180 test -e "$ckpt/train-parked-save-20" || fail "the save of step 20 was not parked"
  "$TB" isolate n1
  wait_for -i 0.5 90 seen 'any(e["event"] == "round" and e["world_size"] == 6 for e in events)' ||
    fail "n2..n4 did not re-form without n1"
  touch "$ckpt/train-parked-save-20.release"
  wait_for -i 0.5 60 seen 'any(e["event"] == "partitioned" and e["waiting"] and e["node"] == "n1" for e in events)' ||
    fail "n1 did not report that it has no quorum"
  "$TB" heal
  check_promise '
assert worlds[0] == 8 and 6 in worlds, "expected world 8, then 6 without n1"
waits = {e["node"] for e in events if e["event"] == "partitioned" and e["waiting"]}
assert waits == {"n1"}, f"expected only n1 without quorum, got {waits}"
resumed = [e["step"] for e in events if e["event"] == "resumed"]
assert resumed and resumed[0] == 15, f"the others resumed from {resumed}: the parked step 20 must not count"'
  # what became of the released commit on n1 (refused by the fence, or its worker stopped first)
  grep -E "step 20.*(not committed|refused)|commit of .* refused" "$out/job.out" | head -3 || echo "n1's parked commit: its worker was stopped before it could ask"
  ;;
flap)
  # a link that flaps faster than the heartbeat timeout: cut n4 off for 1 s, twice
  submit 4 elastic.sbatch -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 150
  wait_past_step 12
  for _ in 1 2; do
    "$TB" partition n1,n2,n3 / n4
    sleep 1
    "$TB" heal
    sleep 2
  done
  check_promise '
assert worlds[0] == 8 and worlds[-1] == 8 and 2 not in worlds, "n4 formed a round of its own, or the job did not end at 8"
t0 = min(e["time"] for e in events)
causes = [(round(e["time"] - t0, 2), e["node"], e["event"], e.get("member", e.get("state", e.get("generation", ""))))
          for e in events if e["event"] in ("member_lost", "store_lost", "partitioned", "round", "state", "worker_exit")
          and (e["event"] != "round" or e["node"] == "n1") and (e["event"] != "state" or e["node"] == "n4")]
print("flap: what ended rounds:", sorted(causes)[:60])
# at most one re-form per flap: n4 tries the store again while the cut lasts (up to a heartbeat
# timeout, 3 s: the heal itself can take half a second under CI load), so the others never form a
# round without it; none when the keep-alive got through after the heal (TCP resends it)
assert len(worlds) <= 3, f"more than one re-form per flap: {worlds}"
print("flap: re-forms", len(worlds) - 1)'
  grep -E "\] \[rdzv\]" "$out/job.out" | head -20  # how each flap went (shown with ctest -V or on failure)
  ;;
kill_during_save)
  submit 2 elastic.sbatch ELASTRUN_TRAIN_PARK_SAVE_AT_STEP=20 -- "${agent_args[@]}" "${trainer[@]}" "${train_args[@]}" --step-ms 100
  wait_for -i 0.2 180 test -e "$ckpt/train-parked-save-20" || fail "the save of step 20 was not parked"
  workers() { # the job's train processes
    local p
    for p in /proc/[0-9]*; do
      [[ $(cat "$p/comm" 2>/dev/null) == train ]] || continue
      tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qx "SLURM_JOB_ID=$job" && echo "${p#/proc/}"
    done
    return 0
  }
  victims=$(workers)
  (($(wc -w <<<"$victims") >= 4)) || fail "expected 4 workers to kill, found: $victims"
  kill -KILL $victims
  echo "SIGKILLed workers $victims while step 20 was being committed"
  check_promise '
assert worlds == [4, 4], "expected two rounds of world 4 (a restart)"
assert [e["step"] for e in events if e["event"] == "resumed"] == [15], "expected one resume from step 15, the newest committed step"
assert [e["action"] for e in events if e["event"] == "failure_decision"].count("restart") == 1, "expected one counted restart"
assert sum(1 for e in events if e["event"] == "worker_exit" and e["signal"] == "SIGKILL") >= 4, "the 4 SIGKILLs are not in the log"'
  left=$(find "$ckpt" -maxdepth 1 -name 'step-*.*' | tr '\n' ' ')
  [[ -z $left ]] || fail "partial or retired step directories left: $left"
  ;;
*)
  fail "unknown scenario '$scenario' (worker_crash node_loss first_node shrink spare time_limit two_faults kill_during_save resize_requeue het)"
  ;;
esac
