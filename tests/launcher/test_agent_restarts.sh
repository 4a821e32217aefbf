#!/usr/bin/env bash
# The elastrun agent, worker failures: a restart, the budget used up, the failure summary (error file, signal).
# Usage: test_agent_restarts.sh path/to/elastrun path/to/launcher_test_worker  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/agent_lib.sh"

test_expect_success 'restart: rank 1 fails on the first attempt only: restart, second attempt sees RESTART_COUNT=1' <<'CASE'
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
CASE

test_expect_success 'budget: rank 1 always fails, --max-restarts 1: exit 1, summary names rank 1 and exit code 7' <<'CASE'
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
CASE

test_expect_success 'error_file: a failing workers @record error file: its message is in the summary' <<'CASE'
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
CASE

test_done
