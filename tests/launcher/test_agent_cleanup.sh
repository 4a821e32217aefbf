#!/usr/bin/env bash
# The elastrun agent, no process outlives the agent: kill -9, SIGTERM, the watchdog, orphaned grandchildren.
# Usage: test_agent_cleanup.sh path/to/elastrun path/to/launcher_test_worker  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/agent_lib.sh"

test_expect_success 'kill9: kill -9 of the agent: no worker survives (checked by PID), no metrics file lingers' <<'CASE'
rm -rf "$work/prom"
TEST_WORKER_SLEEP=60 "$elastrun" --standalone --nproc-per-node 3 --events "$work/events.jsonl" --metrics-dir "$work/prom" \
  "$worker" >"$work/stdout" 2>"$work/stderr" &
agent_pid=$!
track_pid "$agent_pid"
wait_for -i 0.1 10 have_files 3 "$work/out/pids/*"
[[ $(ls "$work/out/pids" | wc -l) -eq 3 ]] || fail "3 workers did not start"
have_files 1 "$work/prom/elastrun-standalone-*.prom" || fail "no metrics file: $(ls "$work/prom")"
stop_pid "$agent_pid"
wait_for -i 0.1 5 no_alive_workers
[[ -z $(alive_workers) ]] || fail "workers alive 5 s after kill -9 of the agent: $(alive_workers)"
wait_for -i 0.1 5 eval '[[ -z $(ls "$work/prom") ]]' || fail "left in the metrics directory: $(ls "$work/prom")"
echo "ok: kill -9 of the agent leaves no worker and no metrics file (its watchdog removed it)"
CASE

test_expect_success 'sigterm: SIGTERM to the agent: workers stopped, exit 143' <<'CASE'
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
CASE

test_expect_success 'agent_killed: kill -9 of the agent whose workers run under `sh` wrappers deaf to SIGTERM: the' <<'CASE'
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
CASE

test_expect_success 'orphans: a worker leaves a setsidd grandchild behind: the agent (child subreaper) kills it' <<'CASE'
TEST_WORKER_SPAWN_ORPHAN=1 "$elastrun" --standalone --nproc-per-node 2 "$worker" >"$work/stdout" 2>"$work/stderr"
rc=$?
[[ $rc -eq 0 ]] || fail "exit $rc"
[[ $(grep -l orphan "$work"/out/pids/* 2>/dev/null | wc -l) -eq 2 ]] || fail "the workers did not leave 2 grandchildren"
[[ -z $(alive_workers) ]] || fail "left alive after the agent exited: $(alive_workers)"
grep -q "left behind by a worker" "$work/stderr" || fail "no warning about the killed orphans"
echo "ok: grandchildren that left the process group are killed"
CASE

test_done
