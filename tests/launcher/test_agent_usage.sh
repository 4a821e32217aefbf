#!/usr/bin/env bash
# The elastrun agent, bad command lines: exit 2 with one line; --help and --version.
# Usage: test_agent_usage.sh path/to/elastrun path/to/launcher_test_worker  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/agent_lib.sh"

test_expect_success 'bad_flags: unknown/contradictory flags: exit 2, one stderr line' <<'CASE'
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
check "--rdzv-conf" --rdzv-conf=join_timeout "$worker"
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
CASE

test_done
