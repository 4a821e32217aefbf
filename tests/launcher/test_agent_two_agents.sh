#!/usr/bin/env bash
# The elastrun agent, two agents on this machine (--rdzv-endpoint, no Slurm): restarts, a lost agent, the budget.
# Usage: test_agent_two_agents.sh path/to/elastrun path/to/launcher_test_worker  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/agent_lib.sh"

test_expect_success 'two_agents: two agents on this machine (--rdzv-endpoint, no Slurm): a worker failure on one' <<'CASE'
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
CASE

test_done
