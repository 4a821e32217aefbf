#!/usr/bin/env bash
# The elastrun agent, what each worker gets: ranks and sizes, the static launch form, its arguments, its log files.
# Usage: test_agent_ranks.sh path/to/elastrun path/to/launcher_test_worker  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
source "$(dirname "${BASH_SOURCE[0]}")/agent_lib.sh"

test_expect_success 'success: 3 workers: ranks 0..2, WORLD_SIZE 3, MASTER_PORT set, [rank N] prefixes, exit 0' <<'CASE'
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
CASE

test_expect_success 'static_form: --nnodes=1 --master-addr=localhost --master-port=P --node-rank=0 (no --rdzv-id): runs, run id none' <<'CASE'
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
CASE

test_expect_success 'module: program arguments pass through untouched; -m / --no-python contradiction' <<'CASE'
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
CASE

test_expect_success 'log_dir: --log-dir with --tee 3: per-attempt stdout/stderr files and console' <<'CASE'
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
CASE

test_done
