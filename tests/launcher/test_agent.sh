#!/usr/bin/env bash
# The elastrun agent in standalone mode with real worker processes (tests/launcher/test_worker.cpp).
# Usage: test_agent.sh CASE path/to/elastrun path/to/launcher_test_worker
#   success    3 workers: ranks 0..2, WORLD_SIZE 3, MASTER_PORT set, "[rank N]" prefixes, exit 0
#   restart    rank 1 fails on the first attempt only: restart, second attempt sees RESTART_COUNT=1
#   budget     rank 1 always fails, --max-restarts 1: exit 1, summary names rank 1 and exit code 7
#   bad_flags  unknown/contradictory flags: exit 2, one stderr line
#   kill9      kill -9 of the agent: no worker survives (checked by PID)
#   sigterm    SIGTERM to the agent: workers stopped, exit 143
#   error_file a failing worker's @record error file: its message is in the summary
#   module     program arguments pass through untouched; -m / --no-python contradiction
#   log_dir    --log-dir with --tee 3: per-attempt stdout/stderr files and console
#   orphans    a worker leaves a setsid'd grandchild behind: the agent (child subreaper) kills it
#   etcd       two agents with --rdzv-backend=etcd against a private etcd (skipped, 77, without etcd)
#   static_form  --nnodes=1 --master-addr=localhost --master-port=P --node-rank=0 (no --rdzv-id): runs, run id 'none'
#   agent_killed kill -9 of the agent whose workers run under `sh` wrappers deaf to SIGTERM: the
#              watchdog ends their process groups (SIGTERM, then SIGKILL after --stop-grace)
#   two_agents two agents on this machine (--rdzv-endpoint, no Slurm): a worker failure on one
#              restarts both (RESTART_COUNT=1); kill -9 of one -> the other re-forms alone and finishes
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
case_name=$1
elastrun=$2
worker=$3
FAIL_TAG=$case_name
# Agents keep per-run files under $TMPDIR (the agents' error-file dirs); an agent killed with -9
# cannot remove them. No test leaves a worker behind: at exit, whatever recorded pid is still one of
# ours (checked) is killed.
worker_sandbox launcher_test_worker
work=$SANDBOX
show_on_failure 40 "$work/stdout" "$work/stderr"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
unset_env '^(SLURM_|PET_|PMI_|PMIX_|OMPI_)'

alive_workers() { alive_recorded_pids "$work/out/pids" launcher_test_worker; } # workers that still run
no_alive_workers() { [[ -z $(alive_workers) ]]; }
# agent_pair ARGS_A... -- ARGS_B...: agent a in the background and agent b, output in $work/a.out,
# a.err, b.out, b.err; sets rc_a and rc_b once both exited; $work/stderr gets both stderrs (for fail)
agent_pair() {
  local args_a=() pid
  while [[ $1 != -- ]]; do args_a+=("$1"); shift; done
  shift
  "$elastrun" "${args_a[@]}" >"$work/a.out" 2>"$work/a.err" &
  pid=$!
  track_pid "$pid"
  "$elastrun" "$@" >"$work/b.out" 2>"$work/b.err"
  rc_b=$?
  await "$pid"; rc_a=$?
  cat "$work/a.err" "$work/b.err" >"$work/stderr"
}

case $case_name in
success)
  "$elastrun" --standalone --nproc-per-node 3 "$worker" --flag -x 'a b' >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 0 ]] || fail "exit $rc"
  for r in 0 1 2; do
    f=$(ls "$work"/out/rank$r.gen*.json 2>/dev/null | head -1)
    [[ -n $f ]] || fail "rank $r did not run"
    [[ $(json "$f" 'd["WORLD_SIZE"], d["LOCAL_WORLD_SIZE"], d["LOCAL_RANK"], d["GROUP_RANK"], d["GROUP_WORLD_SIZE"]') == "('3', '3', '$r', '0', '1')" ]] ||
      fail "rank $r env: $(cat "$f")"
    [[ $(json "$f" 'int(d["MASTER_PORT"]) > 0 and d["MASTER_ADDR"] == "127.0.0.1"') == True ]] || fail "rank $r master: $(cat "$f")"
    [[ $(json "$f" 'd["TORCHELASTIC_RESTART_COUNT"], d["TORCHELASTIC_MAX_RESTARTS"], d["ROLE_NAME"], d["ROLE_RANK"], d["ROLE_WORLD_SIZE"], d["OMP_NUM_THREADS"]') == "('0', '0', 'default', '$r', '3', '1')" ]] ||
      fail "rank $r torchelastic env: $(cat "$f")"
    [[ $(json "$f" 'd["TORCHELASTIC_RUN_ID"].startswith("standalone-") and d["TORCHELASTIC_ERROR_FILE"].endswith("/error.json") and d["args"] == ["--flag", "-x", "a b"] and d["pid"] == d["pgid"]') == True ]] ||
      fail "rank $r run id / error file / args / own process group: $(cat "$f")"
    grep -q "^\[rank $r\] {" "$work/stdout" || fail "no '[rank $r]' prefixed stdout line"
    grep -q "^\[rank $r\] stderr line" "$work/stderr" || fail "no '[rank $r]' prefixed stderr line"
  done
  ports=$(cat "$work"/out/rank*.json | /usr/bin/python3 -c 'import json,sys; print(len({json.loads(l)["MASTER_PORT"] for l in sys.stdin}))')
  [[ $ports == 1 ]] || fail "workers disagree on MASTER_PORT"
  for s in RENDEZVOUS START_WORKERS MONITOR SUCCEEDED; do
    grep -q "^\[elastrun node [^]]*\] state $s" "$work/stderr" || fail "no 'state $s' log line"
  done
  echo "ok: success path"
  ;;
static_form)
  # torchrun's static launch line from PyTorch's docs: no --rdzv-id, a localhost master that this
  # agent hosts, and the default --rdzv-auth=auto (a generated token on one host)
  port=$(free_port_pair)
  "$elastrun" --nnodes=1 --nproc-per-node=2 --master-addr=localhost --master-port="$port" --node-rank=0 "$worker" \
    >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 0 ]] || fail "the static form exited $rc"
  f=$(ls "$work"/out/rank1.gen*.json 2>/dev/null | head -1)
  [[ -n $f ]] || fail "rank 1 did not run"
  [[ $(json "$f" 'd["WORLD_SIZE"], d["TORCHELASTIC_RUN_ID"]') == "('2', 'none')" ]] || fail "rank 1 env: $(cat "$f")"
  grep -q "hosted here), store localhost:$((port + 1))" "$work/stderr" ||
    fail "this agent did not host the store on localhost:--master-port + 1"
  [[ $(json "$f" 'd["MASTER_PORT"]') == "$port" ]] || fail "workers did not get MASTER_PORT=--master-port: $(cat "$f")"
  # nobody hosts the store: a progress line within seconds, then the error at join_timeout
  "$elastrun" --nnodes=1 --rdzv-endpoint=127.0.0.1:"$port" --rdzv-conf=is_host=0,join_timeout=6 "$worker" \
    >"$work/stdout" 2>"$work/stderr"
  rc=$?
  ((rc == 1)) || fail "no store: exit $rc, expected 1"
  grep -q "still no rendezvous store for run 'none' at 127.0.0.1:$port after [3-5] s" "$work/stderr" ||
    fail "no early progress line: $(cat "$work/stderr")"
  echo "ok: the static form runs with torchrun's default run id; a missing store is reported within seconds"
  ;;
restart)
  TEST_WORKER_FAIL_RANK=1 TEST_WORKER_FAIL_ONCE=$work/failed-once TEST_WORKER_EXIT_CODE=5 \
    "$elastrun" --standalone --nproc_per_node=2 --max-restarts=2 --monitor-interval=0.05 "$worker" \
    >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 0 ]] || fail "exit $rc"
  gens=$(ls "$work"/out/rank1.gen*.json | wc -l)
  [[ $gens -eq 2 ]] || fail "rank 1 ran $gens times, expected 2"
  last=$(ls "$work"/out/rank1.gen*.json | sort -V | tail -1)
  [[ $(json "$last" 'd["TORCHELASTIC_RESTART_COUNT"]') == 1 ]] || fail "second attempt: $(cat "$last")"
  last0=$(ls "$work"/out/rank0.gen*.json | sort -V | tail -1)
  [[ $(json "$last0" 'd["TORCHELASTIC_RESTART_COUNT"]') == 1 ]] || fail "rank 0 second attempt: $(cat "$last0")"
  grep -q "state FAILED rank 1 .*exited with code 5" "$work/stderr" || fail "no FAILED line naming rank 1 / code 5"
  grep -q "state RESTART restart 1 of 2" "$work/stderr" || fail "no RESTART line"
  echo "ok: one failure, one restart, success"
  ;;
budget)
  TEST_WORKER_FAIL_RANK=1 TEST_WORKER_EXIT_CODE=7 TEST_WORKER_SLEEP=30 \
    "$elastrun" --standalone --nproc-per-node 2 --max-restarts 1 "$worker" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 1 ]] || fail "exit $rc, expected 1"
  [[ $(ls "$work"/out/rank1.gen*.json | wc -l) -eq 2 ]] || fail "expected 2 attempts"
  grep -q "root cause (first failure)" "$work/stderr" || fail "no failure summary"
  grep -qE "rank +: 1 \(local rank 1\)" "$work/stderr" || fail "summary does not name rank 1"
  grep -qE "exit code *: 7" "$work/stderr" || fail "summary does not name exit code 7"
  [[ -z $(alive_workers) ]] || fail "workers left alive: $(alive_workers)"
  echo "ok: restart budget exhausted -> exit 1 with a summary"
  ;;
bad_flags)
  check() { # check EXPECTED_SUBSTRING ARGS...
    local want=$1; shift
    "$elastrun" "$@" >"$work/stdout" 2>"$work/stderr"; local rc=$?
    [[ $rc -eq 2 ]] || fail "elastrun $* exited $rc, expected 2"
    [[ $(wc -l <"$work/stderr") -eq 1 ]] || fail "elastrun $*: not one stderr line: $(cat "$work/stderr")"
    grep -q -- "$want" "$work/stderr" || fail "elastrun $*: error does not mention '$want': $(cat "$work/stderr")"
    [[ -z $(ls "$work"/out/ 2>/dev/null) ]] || fail "elastrun $*: a worker ran"
  }
  check "--no-such-flag" --standalone --no-such-flag "$worker"
  check "module" --no-python -m foo
  check "--nnodes" --nnodes=4:2 "$worker"
  check "--nnodes" --nnodes=x "$worker"
  check "--nproc-per-node" --nproc-per-node=0 "$worker"
  check "--rdzv-backend" --rdzv-backend=zookeeper "$worker"
  check "--standalone" --standalone --rdzv-endpoint=h:1 "$worker"
  check "--rdzv-conf" --rdzv-conf=frobnicate=1 "$worker"
  check "no program" --standalone
  check "not found" --standalone /nonexistent/prog
  check "script '/nonexistent/train.py' not found" --standalone /nonexistent/train.py
  check "--rdzv-endpoint='h:0'" --rdzv-endpoint=h:0 --rdzv-id=x "$worker"
  check "--rdzv-auth='maybe'" --standalone --rdzv-auth=maybe "$worker"
  check "--rdzv-id=" --standalone --rdzv-id="$(printf 'x%.0s' {1..300})" "$worker"
  check "--nnodes is empty" --nnodes "" "$worker"
  check "resolves neither" --nnodes=2 --rdzv-endpoint=nosuchhost.invalid:29400 --rdzv-id=x "$worker"
  check "--max-restarts" --max-restarts=-1 "$worker"
  "$elastrun" --help >"$work/stdout" 2>&1 || fail "--help failed"
  for f in --nnodes --nproc-per-node --rdzv-backend --rdzv-endpoint --rdzv-id --rdzv-conf --standalone \
           --max-restarts --monitor-interval --role --node-rank --master-addr --master-port --log-dir \
           --redirects --tee --local-ranks-filter --module --no-python --run-path --rdzv-auth; do
    grep -q -- "$f" "$work/stdout" || fail "--help does not mention $f"
  done
  "$elastrun" --version | grep -q '^elastrun ' || fail "--version"
  echo "ok: bad flags -> exit 2, one line; --help complete"
  ;;
kill9)
  TEST_WORKER_SLEEP=60 "$elastrun" --standalone --nproc-per-node 3 "$worker" >"$work/stdout" 2>"$work/stderr" &
  agent_pid=$!
  track_pid "$agent_pid"
  wait_for -i 0.1 10 have_files 3 "$work/out/pids/*"
  [[ $(ls "$work/out/pids" | wc -l) -eq 3 ]] || fail "3 workers did not start"
  stop_pid "$agent_pid"
  wait_for -i 0.1 5 no_alive_workers
  [[ -z $(alive_workers) ]] || fail "workers alive 5 s after kill -9 of the agent: $(alive_workers)"
  echo "ok: kill -9 of the agent leaves no worker"
  ;;
sigterm)
  TEST_WORKER_SLEEP=60 "$elastrun" --standalone --nproc-per-node 2 --stop-grace 2 "$worker" >"$work/stdout" 2>"$work/stderr" &
  agent_pid=$!
  track_pid "$agent_pid"
  wait_for -i 0.1 10 have_files 2 "$work/out/pids/*"
  [[ $(ls "$work/out/pids" | wc -l) -eq 2 ]] || fail "2 workers did not start"
  start=$SECONDS
  kill -TERM "$agent_pid"
  await "$agent_pid"; rc=$?
  [[ $rc -eq 143 ]] || fail "exit $rc, expected 143"
  ((SECONDS - start <= 5)) || fail "took $((SECONDS - start)) s to stop"
  [[ -z $(alive_workers) ]] || fail "workers alive after SIGTERM: $(alive_workers)"
  echo "ok: SIGTERM -> workers stopped, exit 143"
  ;;
error_file)
  TEST_WORKER_FAIL_RANK=0 TEST_WORKER_ERROR_MESSAGE='RuntimeError: CUDA out of memory (test)' \
    "$elastrun" --standalone --nproc-per-node 1 "$worker" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 1 ]] || fail "exit $rc, expected 1"
  grep -q "message *: RuntimeError: CUDA out of memory (test)" "$work/stderr" || fail "error-file message not in the summary"
  grep -q "traceback" "$work/stderr" || fail "no traceback in the summary"
  TEST_WORKER_FAIL_RANK=0 TEST_WORKER_SIGNAL=11 \
    "$elastrun" --standalone "$worker" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 1 ]] || fail "signal case: exit $rc, expected 1"
  grep -qE "signal *: SIGSEGV \(11\)" "$work/stderr" || fail "summary does not name SIGSEGV"
  echo "ok: error file and signal in the summary"
  ;;
module)
  # a python module and a script, arguments untouched; python from ELASTRUN_PYTHON
  mkdir -p "$work/pkg"
  cat >"$work/pkg/echoargs.py" <<'PY'
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "rank": os.environ["RANK"]}))
PY
  (cd "$work/pkg" && ELASTRUN_PYTHON=/usr/bin/python3 "$elastrun" --standalone -m echoargs --nnodes 1 -x "a b" >"$work/stdout" 2>"$work/stderr") ||
    fail "-m run failed"
  grep -qF '[rank 0] {"argv": ["--nnodes", "1", "-x", "a b"], "rank": "0"}' "$work/stdout" || fail "module args not passed through"
  ELASTRUN_PYTHON=/usr/bin/python3 "$elastrun" --standalone --nproc-per-node=2 "$work/pkg/echoargs.py" --standalone >"$work/stdout" 2>"$work/stderr" ||
    fail "script run failed"
  [[ $(grep -c '"argv": \["--standalone"\]' "$work/stdout") -eq 2 ]] || fail "script args not passed through"
  # torch.distributed.launch's --local_rank argument, and torchrun's ${local_rank} in arguments
  rm -rf "$work/out"/*
  "$elastrun" --standalone --nproc-per-node 2 --local-rank-arg=--local_rank "$worker" a 'r${local_rank}' \
    >"$work/stdout" 2>"$work/stderr" || fail "--local-rank-arg run failed"
  f=$(ls "$work"/out/rank1.gen*.json | head -1)
  [[ $(json "$f" 'd["args"]') == "['--local_rank=1', 'a', 'r1']" ]] || fail "rank 1 args: $(json "$f" 'd["args"]')"
  echo "ok: -m and *.py with untouched arguments; --local-rank-arg and \${local_rank}"
  ;;
log_dir)
  "$elastrun" --standalone --nproc-per-node 2 --log-dir "$work/logs" --tee 3 --rdzv-id myrun "$worker" >"$work/stdout" 2>"$work/stderr" ||
    fail "run failed"
  for r in 0 1; do
    grep -q '"RANK":"'$r'"' "$work/logs/myrun/attempt_0/$r/stdout.log" || fail "no stdout.log for rank $r"
    grep -q 'stderr line' "$work/logs/myrun/attempt_0/$r/stderr.log" || fail "no stderr.log for rank $r"
    grep -q "^\[rank $r\]" "$work/stdout" || fail "tee: rank $r not on the console"
  done
  rm -rf "$work/logs" "$work/out"/*
  "$elastrun" --standalone --nproc-per-node 2 --log-dir "$work/logs" -r 1 --local-ranks-filter 1 --rdzv-id r2 "$worker" >"$work/stdout" 2>"$work/stderr" ||
    fail "redirect run failed"
  grep -q '"RANK":"0"' "$work/logs/r2/attempt_0/0/stdout.log" || fail "redirected stdout not in the file"
  grep -q '^\[rank' "$work/stdout" && fail "redirected stdout reached the console"
  grep -q '^\[rank 1\] stderr' "$work/stderr" || fail "rank 1 stderr not on the console"
  grep -q '^\[rank 0\]' "$work/stderr" && fail "--local-ranks-filter 1 let rank 0 through"
  # torchrun 2.x: a prefix template and the duplicate filters (tee'd stdout lines with "RANK")
  rm -rf "$work/logs" "$work/out"/*
  "$elastrun" --standalone --nproc-per-node 2 --log-dir "$work/logs" --tee 1 --rdzv-id r3 \
    --log-line-prefix-template '<${role_name}${local_rank}>' --duplicate-stdout-filters 'a,,b,"RANK"' \
    "$worker" >"$work/stdout" 2>"$work/stderr" || fail "prefix/filter run failed"
  grep -q '^<default1>{' "$work/stdout" || fail "no templated prefix: $(head -3 "$work/stdout")"
  filtered=$work/logs/r3/attempt_0/filtered_stdout.log
  [[ $(grep -c '^<default[01]>{.*"RANK"' "$filtered") -eq 2 ]] || fail "filtered_stdout.log: $(cat "$filtered" 2>&1)"
  echo "ok: log dir, tee, redirects, local ranks filter, prefix template, duplicate filters"
  ;;
agent_killed)
  # kill -9 of the agent: workers started through a shell wrapper (PDEATHSIG reaches only the
  # wrapper) and deaf to SIGTERM must still die -- the agent's watchdog ends their process groups
  printf '#!/bin/sh\ntrap "" TERM\n"%s" "$@"\necho done\n' "$worker" >"$work/wrapper.sh"
  chmod +x "$work/wrapper.sh"
  # (each worker also leaves a grandchild in a session of its own, out of every process group)
  TEST_WORKER_SPAWN_ORPHAN=1 TEST_WORKER_SLEEP=120 \
    "$elastrun" --standalone --nproc-per-node 2 --stop-grace 1 --no-python "$work/wrapper.sh" \
    >"$work/stdout" 2>"$work/stderr" &
  agent_pid=$!
  track_pid "$agent_pid"
  wait_for -i 0.1 20 have_files 4 "$work/out/pids/*" || fail "2 workers and their 2 grandchildren did not start"
  watchdog=$(pgrep -P "$agent_pid" -x elastrun-wdog) || fail "no watchdog process under the agent"
  kill -9 "$agent_pid"
  await "$agent_pid" || true
  wait_for -i 0.2 15 no_alive_workers || fail "workers outlived their killed agent: $(alive_workers)"
  wait_for -i 0.2 15 exited "$watchdog" || fail "the watchdog $watchdog did not exit"
  grep -q "elastrun watchdog\] the agent is gone" "$work/stderr" || fail "no watchdog message"
  echo "ok: kill -9 of the agent: the wrapped workers and their setsid grandchildren died with it, and so did the watchdog"
  ;;
orphans)
  TEST_WORKER_SPAWN_ORPHAN=1 "$elastrun" --standalone --nproc-per-node 2 "$worker" >"$work/stdout" 2>"$work/stderr"
  rc=$?
  [[ $rc -eq 0 ]] || fail "exit $rc"
  [[ $(grep -l orphan "$work"/out/pids/* 2>/dev/null | wc -l) -eq 2 ]] || fail "the workers did not leave 2 grandchildren"
  [[ -z $(alive_workers) ]] || fail "left alive after the agent exited: $(alive_workers)"
  grep -q "left behind by a worker" "$work/stderr" || fail "no warning about the killed orphans"
  echo "ok: grandchildren that left the process group are killed"
  ;;
etcd)
  command -v etcd >/dev/null || skip "etcd is not installed (Debian etcd-server)"
  client=$(free_port); peer=$(free_port)
  etcd --name t --data-dir "$work/etcd" --listen-client-urls "http://127.0.0.1:$client" \
    --advertise-client-urls "http://127.0.0.1:$client" --listen-peer-urls "http://127.0.0.1:$peer" \
    --initial-advertise-peer-urls "http://127.0.0.1:$peer" --initial-cluster "t=http://127.0.0.1:$peer" \
    >"$work/etcd.log" 2>&1 &
  track_pid -s TERM $!
  wait_for -i 0.1 10 curl -fso /dev/null "http://127.0.0.1:$client/health"
  common=(--rdzv-backend=etcd --rdzv-endpoint=127.0.0.1:$client --rdzv-id=e1 --nnodes=2 --nproc-per-node=2)
  agent_pair "${common[@]}" --node-rank=0 "$worker" -- "${common[@]}" --node-rank=1 "$worker"
  [[ $rc_a -eq 0 && $rc_b -eq 0 ]] || fail "agents exited $rc_a/$rc_b"
  for r in 0 1 2 3; do
    f=$(ls "$work"/out/rank$r.gen*.json 2>/dev/null | head -1)
    [[ -n $f ]] || fail "rank $r did not run"
    [[ $(json "$f" 'd["WORLD_SIZE"], d["GROUP_RANK"], d["TORCHELASTIC_RUN_ID"]') == "('4', '$((r / 2))', 'e1')" ]] || fail "rank $r: $(cat "$f")"
  done
  grep -q "backend etcd, store 127.0.0.1:$client" "$work/a.err" || fail "not run over etcd"
  echo "ok: two agents over etcd"
  ;;
two_agents)
  port=$(free_port)
  common=(--nproc-per-node=2 --rdzv-endpoint=127.0.0.1:$port --rdzv-auth=none --monitor-interval=0.05)
  # 1. rank 3 (on the second agent) fails once: both agents restart, budget 1 used
  TEST_WORKER_FAIL_RANK=3 TEST_WORKER_FAIL_ONCE=$work/failed-once TEST_WORKER_SLEEP=1 agent_pair \
    --nnodes=2 --rdzv-id=t1 --rdzv-conf=is_host=1 --node-rank=0 --max-restarts=1 "${common[@]}" "$worker" -- \
    --nnodes=2 --rdzv-id=t1 --rdzv-conf=is_host=0 --node-rank=1 --max-restarts=1 "${common[@]}" "$worker"
  [[ $rc_a -eq 0 && $rc_b -eq 0 ]] || fail "agents exited $rc_a/$rc_b after one failure"
  for r in 0 1 2 3; do
    last=$(ls "$work"/out/rank$r.gen*.json | sort -V | tail -1)
    [[ $(json "$last" 'd["TORCHELASTIC_RESTART_COUNT"], d["WORLD_SIZE"]') == "('1', '4')" ]] || fail "rank $r last attempt: $(cat "$last")"
  done
  grep -q "state RESTART restart 1 of 1" "$work/b.err" || fail "agent b did not restart"
  grep -q "state MEMBERSHIP_CHANGED new round requested" "$work/a.err" || fail "agent a did not see the new round"
  # 2. kill -9 of the second agent while workers sleep: the first re-forms alone (--nnodes=1:2)
  rm -rf "$work"/out/*
  TEST_WORKER_SLEEP=60 TEST_WORKER_SLEEP_WORLD_SIZE=4 \
    "$elastrun" --nnodes=1:2 --rdzv-id=t2 --rdzv-conf=is_host=1,last_call_timeout=2 --node-rank=0 "${common[@]}" "$worker" \
    >"$work/a.out" 2>"$work/a.err" &
  agent_pid=$!
  TEST_WORKER_SLEEP=60 TEST_WORKER_SLEEP_WORLD_SIZE=4 \
    "$elastrun" --nnodes=1:2 --rdzv-id=t2 --rdzv-conf=is_host=0 --node-rank=1 "${common[@]}" "$worker" >"$work/b.out" 2>"$work/b.err" &
  b_pid=$!
  track_pid "$agent_pid" "$b_pid"
  wait_for -i 0.1 20 have_files 4 "$work/out/rank*.gen*.json"
  [[ $(ls "$work"/out/rank*.json 2>/dev/null | wc -l) -ge 4 ]] || { cp "$work/a.err" "$work/stderr"; fail "4 workers did not start"; }
  stop_pid "$b_pid"
  start=$SECONDS
  await "$agent_pid"; rc_a=$?
  cp "$work/a.err" "$work/stderr"
  [[ $rc_a -eq 0 ]] || fail "surviving agent exited $rc_a"
  ((SECONDS - start < 30)) || fail "survivor took $((SECONDS - start)) s"
  grep -q "state MEMBERSHIP_CHANGED member lost" "$work/a.err" || fail "no member-lost change"
  [[ $(ls "$work"/out/rank*.json | xargs cat | grep -c '"WORLD_SIZE":"2"') -eq 2 ]] || fail "no WORLD_SIZE 2 restart"
  wait_for -i 0.1 5 no_alive_workers
  [[ -z $(alive_workers) ]] || fail "workers of the killed agent survive: $(alive_workers)"
  # 3. rank 3 always fails, --max-restarts=0: its agent closes the rendezvous; both exit 1
  rm -rf "$work"/out/*
  TEST_WORKER_FAIL_RANK=3 TEST_WORKER_FAIL_AFTER=0.5 TEST_WORKER_SLEEP=60 agent_pair \
    --nnodes=2 --rdzv-id=t3 --rdzv-conf=is_host=1 --node-rank=0 "${common[@]}" "$worker" -- \
    --nnodes=2 --rdzv-id=t3 --rdzv-conf=is_host=0 --node-rank=1 "${common[@]}" "$worker"
  [[ $rc_a -eq 1 && $rc_b -eq 1 ]] || fail "agents exited $rc_a/$rc_b, expected 1/1 when the budget is used up"
  grep -q "root cause (first failure)" "$work/b.err" || fail "no summary on the failing agent"
  grep -q "is closed: failed: rank 3 .*exited with code 3" "$work/a.err" || fail "the other agent does not report the root cause"
  wait_for -i 0.1 5 no_alive_workers
  [[ -z $(alive_workers) ]] || fail "workers left alive: $(alive_workers)"
  echo "ok: two agents: failure restarts both; kill -9 of one -> the other re-forms and finishes; budget used up -> both exit 1"
  ;;
*)
  echo "unknown case $case_name" >&2
  exit 2
  ;;
esac
