#!/usr/bin/env bash
# The elastrun agent, two agents over etcd (--rdzv-backend=etcd; skipped, 77, without etcd).
# Usage: test_agent_etcd.sh path/to/elastrun path/to/launcher_test_worker  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/agent_lib.sh"

test_expect_success 'etcd: two agents with --rdzv-backend=etcd against a private etcd (skipped, 77, without etcd)' <<'CASE'
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
CASE

test_done
