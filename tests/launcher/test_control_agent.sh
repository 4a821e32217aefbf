#!/usr/bin/env bash
# Checkpoint-and-stop through the control channel, with real agents and workers (no Slurm).
# Usage: test_control_agent.sh CASE path/to/elastrun path/to/launcher_test_worker SOURCE_DIR
#   usr1        SIGUSR1 to the agent only: both workers see checkpoint-and-stop in the control file
#               (not a signal: they got none), exit 85; the agent exits 85; no worker left
#   sigterm     SIGTERM with channel-reading workers: checkpoint-and-stop too (preemption), exit 85
#   legacy      SIGUSR1, workers that never read the channel: stopped at once, agent exits 138
#   step_signal SIGUSR1 to the agent and its workers at once (as Slurm does): workers without a
#               handler die of it; that is not a failure (no restart); exit 138
#   forward     --forward-signals: the workers also get SIGUSR1 (their handlers turn it into a stop)
#   worker_exit a worker exits 85 on its own: the agent asks the others to checkpoint, exits 85
#   python      a Python worker using elastrun_control.py (/usr/bin/python3): SIGUSR1 -> exit 85
#   torch       two gloo ranks (python3-torch) doing all-reduce steps and poll_all(): SIGUSR1 to the
#               agent -> both stop at the same step, exit 85
#   two_agents  SIGUSR1 to the second of two agents: the first sees the published stop request,
#               both nodes checkpoint, both agents exit 85
#   summary     two agents, a worker of the second fails for good: group rank 0 (the first agent,
#               whose own workers did not fail) prints the job-wide summary naming rank 3
#   scale_up    two agents (--nnodes=2:3) whose 4 workers read the channel; a third agent arrives ->
#               the two ask their workers to checkpoint-and-stop before re-forming (exit 85, 4 markers,
#               no restart counted), the 3-node round runs 6 workers, all agents exit 0; again with
#               --scale-up-checkpoint=false: re-formed without any checkpoint
#   bad_flags   bad --requeue-budget / --checkpoint-timeout: one error line, exit 2
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
case_name=$1
elastrun=$2
worker=$3
source_dir=$4
FAIL_TAG=$case_name
worker_sandbox 'launcher_test_worker|test_control_python'
work=$SANDBOX
show_on_failure 40 "$work/*.out" "$work/*.err"
pids=()
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
unset_env '^(SLURM_|PET_|PMI_|PMIX_|OMPI_|ELASTRUN_)'

alive_workers() { alive_recorded_pids "$work/out/pids" launcher_test_worker; }
wait_files() { wait_for -i 0.1 60 have_files "$2" "$1"; } # wait_files GLOB COUNT: until COUNT files match (60 s)
# start_agent NAME ARGS...: the agent in the background, output in $work/NAME.out/.err
start_agent() {
  local name=$1; shift
  "$elastrun" "$@" >"$work/$name.out" 2>"$work/$name.err" &
  pids+=($!)
  track_pid $!
}
finish() { # finish PID: its exit code (waits up to 120 s, then fails)
  wait_for -i 0.1 120 exited "$1" || fail "agent $1 did not exit"
  await "$1"
}
signal_agent() { kill -"$1" "${pids[0]}"; finish "${pids[0]}"; } # signal_agent SIG: the first agent's exit code
# sleeping_agent ARGS...: agent a (--standalone --nproc-per-node 2 ARGS... worker) whose 2 workers
# sleep (120 s); returns once both run
sleeping_agent() {
  TEST_WORKER_SLEEP=120 start_agent a --standalone --nproc-per-node 2 "$@" "$worker"
  wait_files "$work/out/rank*.json" 2 || fail "2 workers did not start"
}
# python_agent MODE: an agent whose 2 workers run test_control_python.py MODE
python_agent() {
  PYTHONPATH=$source_dir/worker/python ELASTRUN_PYTHON=/usr/bin/python3 start_agent a --standalone \
    --nproc-per-node 2 "$source_dir/tests/launcher/test_control_python.py" "$1"
}
check_checkpointed() { # check_checkpointed RANK... : each wrote its checkpoint marker from the channel
  for r in "$@"; do
    f=$work/out/checkpoint.rank$r.json
    [[ -e $f ]] || fail "rank $r did not checkpoint"
    [[ $(json "$f" 'd["request"], d["sequence"]') == "('checkpoint-and-stop', 1)" ]] || fail "rank $r: $(cat "$f")"
  done
}

case $case_name in
usr1 | sigterm)
  sig=USR1; [[ $case_name == sigterm ]] && sig=TERM
  TEST_WORKER_POLL_CONTROL=1 sleeping_agent --checkpoint-dir "$work/ckpt"
  # the workers' first poll leaves the .seen marker: without it the agent takes the never-polled path
  wait_files "$work/tmp/elastrun-*/attempt_0/control.seen" 1 || fail "the workers never polled the channel"
  signal_agent $sig; rc=$?
  [[ $rc -eq 85 ]] || fail "exit $rc, expected 85"
  check_checkpointed 0 1
  for r in 0 1; do
    [[ $(json "$work/out/checkpoint.rank$r.json" 'd["signal"], d["checkpoint_dir"]') == "(0, '$work/ckpt')" ]] ||
      fail "rank $r got a signal or no ELASTRUN_CHECKPOINT_DIR: $(cat "$work/out/checkpoint.rank$r.json")"
  done
  grep -q "state CHECKPOINT_STOP class $([[ $sig == TERM ]] && echo preempt || echo timelimit): SIG$sig" "$work/a.err" ||
    fail "no CHECKPOINT_STOP state line"
  grep -q "2 of 2 local worker(s) checkpointed" "$work/a.err" || fail "no checkpoint count line"
  grep -q "not running under Slurm, so the job cannot be requeued" "$work/a.err" || fail "no 'cannot requeue' line"
  [[ -z $(alive_workers) ]] || fail "workers alive: $(alive_workers)"
  echo "ok: SIG$sig -> checkpoint-and-stop via the control file -> workers exit 85 -> agent exits 85"
  ;;
legacy)
  sleeping_agent --stop-grace 2
  signal_agent USR1; rc=$?
  [[ $rc -eq 138 ]] || fail "exit $rc, expected 138 (128 + SIGUSR1)"
  grep -q "never polled" "$work/a.err" || fail "no 'never polled' line"
  [[ -z $(alive_workers) ]] || fail "workers alive: $(alive_workers)"
  echo "ok: workers that ignore the channel are stopped at once; exit 138"
  ;;
step_signal)
  # like Slurm's --signal/scancel: SIGUSR1 to every process (workers without a handler die of it)
  sleeping_agent --max-restarts 3
  kill -USR1 $(ls "$work/out/pids") "${pids[0]}"
  finish "${pids[0]}"; rc=$?
  [[ $rc -eq 138 ]] || fail "exit $rc, expected 138 (stopped by SIGUSR1, no checkpoint)"
  grep -q "state FAILED\|state RESTART" "$work/a.err" && fail "workers killed by the step's SIGUSR1 were taken for a failure"
  grep -q "state CHECKPOINT_STOP class timelimit: SIGUSR1" "$work/a.err" || fail "no CHECKPOINT_STOP line"
  [[ -z $(alive_workers) ]] || fail "workers alive: $(alive_workers)"
  echo "ok: SIGUSR1 to agent and workers: no restart, stop, exit 138"
  ;;
forward)
  TEST_WORKER_POLL_CONTROL=1 sleeping_agent --forward-signals
  # the forwarded SIGUSR1 kills a worker that has not installed its handler yet
  wait_files "$work/out/polling.rank*" 2 || fail "the workers never polled the channel"
  signal_agent USR1; rc=$?
  [[ $rc -eq 85 ]] || fail "exit $rc, expected 85"
  grep -q "forwarding SIGUSR1 to the workers" "$work/a.err" || fail "no forwarding line"
  for r in 0 1; do [[ -e $work/out/checkpoint.rank$r.json ]] || fail "rank $r did not checkpoint"; done
  echo "ok: --forward-signals: workers checkpoint, exit 85"
  ;;
worker_exit)
  TEST_WORKER_POLL_CONTROL=1 TEST_WORKER_SLEEP=120 TEST_WORKER_FAIL_RANK=1 TEST_WORKER_EXIT_CODE=85 \
    TEST_WORKER_FAIL_AFTER=1 start_agent a --standalone --nproc-per-node 2 "$worker"
  finish "${pids[0]}"; rc=$?
  [[ $rc -eq 85 ]] || fail "exit $rc, expected 85"
  check_checkpointed 0
  grep -q "worker 1 exited 85: checkpointed" "$work/a.err" || fail "no line for rank 1's exit 85"
  grep -q "state FAILED" "$work/a.err" && fail "exit 85 was taken for a failure"
  echo "ok: a worker's own exit 85 stops the others through the channel; exit 85"
  ;;
python)
  [[ -x /usr/bin/python3 ]] || skip "no /usr/bin/python3"
  PYTHONPATH=$source_dir/worker/python ELASTRUN_PYTHON=/usr/bin/python3 \
    /usr/bin/python3 "$source_dir/tests/launcher/test_control_python.py" unit >"$work/unit.out" 2>&1 ||
    { cat "$work/unit.out" >&2; fail "python unit checks failed"; }
  python_agent worker
  # the .seen marker shows both python workers are polling
  wait_files "$work/out/polling.rank*" 2 || fail "python workers never polled the channel"
  signal_agent USR1; rc=$?
  [[ $rc -eq 85 ]] || fail "exit $rc, expected 85"
  for r in 0 1; do
    [[ $(json "$work/out/checkpoint.rank$r.json" 'd["request"], d["sequence"], d["signal"], d["python"]') == "('checkpoint-and-stop', 1, 0, True)" ]] ||
      fail "rank $r: $(cat "$work/out/checkpoint.rank$r.json" 2>/dev/null)"
  done
  echo "ok: python helper: unit checks; SIGUSR1 -> python workers exit 85 -> agent exits 85"
  ;;
torch)
  /usr/bin/python3 -c 'import torch' 2>/dev/null || skip "no python3-torch"
  python_agent torch
  wait_files "$work/out/polling.rank*" 2 || fail "the torch workers did not reach their second step"
  signal_agent USR1; rc=$?
  [[ $rc -eq 85 ]] || fail "exit $rc, expected 85"
  s0=$(json "$work/out/checkpoint.rank0.json" 'd["step"]')
  s1=$(json "$work/out/checkpoint.rank1.json" 'd["step"]')
  [[ $s0 == "$s1" && $s0 -gt 1 ]] || fail "ranks stopped at steps $s0 and $s1 (poll_all must agree)"
  echo "ok: gloo ranks agree through poll_all(): both stopped after step $s0, exit 85"
  ;;
two_agents | summary)
  port=$(free_port)
  common=(--nnodes=2 --nproc-per-node=2 --rdzv-endpoint=127.0.0.1:$port --rdzv-auth=none --rdzv-id=$case_name)
  if [[ $case_name == two_agents ]]; then
    export TEST_WORKER_POLL_CONTROL=1 TEST_WORKER_SLEEP=120
  else
    export TEST_WORKER_FAIL_RANK=3 TEST_WORKER_ERROR_MESSAGE='ValueError: bad batch (test)' TEST_WORKER_SLEEP=120 \
      TEST_WORKER_FAIL_AFTER=1
  fi
  start_agent a --rdzv-conf=is_host=1 --node-rank=0 "${common[@]}" "$worker"
  start_agent b --rdzv-conf=is_host=0 --node-rank=1 "${common[@]}" "$worker"
  if [[ $case_name == two_agents ]]; then
    wait_files "$work/out/rank*.json" 4 || fail "4 workers did not start"
    wait_files "$work/tmp/elastrun-*/attempt_0/control.seen" 2 || fail "the workers of both agents never polled"
    kill -USR1 "${pids[1]}"
  fi
  finish "${pids[1]}"; rc_b=$?
  finish "${pids[0]}"; rc_a=$?
  if [[ $case_name == two_agents ]]; then
    [[ $rc_a -eq 85 && $rc_b -eq 85 ]] || fail "agents exited $rc_a/$rc_b, expected 85/85"
    check_checkpointed 0 1 2 3
    grep -q "state CHECKPOINT_STOP class timelimit: requested by node" "$work/a.err" ||
      fail "agent a did not act on b's published stop request"
    grep -q "not running under Slurm" "$work/a.err" || fail "group rank 0 did not decide about the requeue"
    grep -q "not running under Slurm" "$work/b.err" && fail "agent b (group rank 1) decided about the requeue"
    echo "ok: SIGUSR1 to one agent -> both nodes checkpoint (published request) -> both exit 85"
  else
    [[ $rc_a -eq 1 && $rc_b -eq 1 ]] || fail "agents exited $rc_a/$rc_b, expected 1/1"
    grep -q "other failures (all nodes, by time)\|root cause (first failure)" "$work/a.err" ||
      fail "group rank 0 printed no summary"
    grep -qE "rank +: 3 \(local rank 1\)" "$work/a.err" || fail "group rank 0's summary does not name rank 3"
    grep -q "message *: ValueError: bad batch (test)" "$work/a.err" || fail "summary lacks the error-file message"
    echo "ok: group rank 0 prints the job-wide summary of another node's failure"
  fi
  ;;
scale_up)
  for mode in true false; do
    rm -rf "$work"/out/* && mkdir -p "$work/out"
    port=$(free_port)
    common=(--nnodes=2:3 --nproc-per-node=2 --rdzv-endpoint=127.0.0.1:$port --rdzv-auth=none --rdzv-id=scale-$mode
            --monitor-interval=0.05 --scale-up-checkpoint=$mode)
    # 4-worker round: poll the channel for up to 120 s; the 6-worker round: exit 0 at once
    export TEST_WORKER_POLL_CONTROL=1 TEST_WORKER_SLEEP=120 TEST_WORKER_SLEEP_WORLD_SIZE=4
    pids=()
    start_agent a --rdzv-conf=is_host=1 --node-rank=0 "${common[@]}" "$worker"
    start_agent b --rdzv-conf=is_host=0 --node-rank=1 "${common[@]}" "$worker"
    wait_files "$work/out/rank*.json" 4 || fail "4 workers did not start"
    wait_files "$work/tmp/elastrun-*/attempt_0/control.seen" 2 || fail "the workers of a and b never polled"
    start_agent c --rdzv-conf=is_host=0 --node-rank=2 "${common[@]}" "$worker"
    finish "${pids[2]}"; rc_c=$?
    finish "${pids[1]}"; rc_b=$?
    finish "${pids[0]}"; rc_a=$?
    [[ $rc_a -eq 0 && $rc_b -eq 0 && $rc_c -eq 0 ]] || fail "[$mode] agents exited $rc_a/$rc_b/$rc_c, expected 0/0/0"
    six=$(grep -l '"WORLD_SIZE":"6"' "$work"/out/rank*.gen*.json 2>/dev/null | wc -l)
    ((six == 6)) || fail "[$mode] $six workers ran in a 6-worker round, expected 6"
    grep -h -o '"TORCHELASTIC_RESTART_COUNT":"[0-9]*"' "$work"/out/rank*.gen*.json | grep -qv '"0"' &&
      fail "[$mode] a restart was counted"
    for x in a b; do grep -q "state MEMBERSHIP_CHANGED member waiting" "$work/$x.err" || fail "[$mode] agent $x saw no scale-up"; done
    if [[ $mode == true ]]; then
      check_checkpointed 0 1 2 3
      for x in a b; do
        grep -q "scale-up: 2 of 2 local worker(s) checkpointed" "$work/$x.err" || fail "agent $x: workers did not checkpoint"
        grep -q "scale-up: every node checkpointed; re-forming" "$work/$x.err" || fail "agent $x did not wait for the other node"
      done
    else
      # markers may come from the SIGTERM of the stop (the worker's handlers): never from the channel
      for f in "$work"/out/checkpoint.rank*.json; do
        [[ -e $f ]] || continue
        [[ $(json "$f" 'd["sequence"]') == 0 ]] || fail "[false] a worker was asked to checkpoint: $(cat "$f")"
      done
      grep -q "scale-up:" "$work/a.err" "$work/b.err" && fail "[false] the agents went through the scale-up checkpoint"
    fi
    [[ -z $(alive_workers) ]] || fail "[$mode] workers left: $(alive_workers)"
    echo "ok: --scale-up-checkpoint=$mode: 3rd agent -> re-formed with 6 workers$([[ $mode == true ]] && echo ", the 4 first checkpointed (exit 85)")"
  done
  ;;
bad_flags)
  for args in "--requeue-budget=app:x" "--requeue-budget=gpu:1" "--requeue-budget=app" "--checkpoint-timeout=soon" \
              "--scale-up-checkpoint=maybe"; do
    "$elastrun" --standalone $args "$worker" >"$work/bad.out" 2>"$work/bad.err"
    rc=$?
    [[ $rc -eq 2 ]] || fail "$args: exit $rc, expected 2"
    [[ $(wc -l <"$work/bad.err") -eq 1 ]] || fail "$args: expected one error line: $(cat "$work/bad.err")"
    grep -q "^elastrun: error: --" "$work/bad.err" || fail "$args: $(cat "$work/bad.err")"
  done
  "$elastrun" --help >"$work/help.out" || fail "--help exited $?"
  grep -q -- "--requeue-budget" "$work/help.out" || fail "--help lacks --requeue-budget"
  echo "ok: bad checkpoint/requeue flags -> exit 2 with one line"
  ;;
*)
  echo "unknown case $case_name" >&2
  exit 2
  ;;
esac
