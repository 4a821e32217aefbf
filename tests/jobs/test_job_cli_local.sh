#!/usr/bin/env bash
# The job CLI on this machine (`elastrun run -s local`, no Slurm): run -> handle, status, log,
# describe, list, cancel, each verb's bad input (one line, exit 2), and `elastrun -- run`, which
# runs a program called `run` under the agent instead of the verb.
# Usage: test_job_cli_local.sh path/to/elastrun
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
sandbox --tmpdir
out=$SANDBOX
export ELASTRUN_PYTHON=/usr/bin/python3
cd "$out"
# every agent a local run starts is recorded in its job directory; stop what is left at exit
on_exit 'for f in "$out"/index/local/*/local.json; do [[ -e $f ]] && kill -9 "$(json "$f" "d[\"pid\"]")" 2>/dev/null; done; true'
show_on_failure 30 "$out/index/local/*/batch.out"

handle_of() { grep -o 'local://[^ ]*' "$1" | head -1; }

test_expect_success 'run --wait of utils.sh: the handle, progress lines, SUCCEEDED, exit 0' <<'CASE'
  "$elastrun" run -s local --wait utils.sh echo 'hello world' >run.txt 2>&1 || fail "run --wait: $(cat run.txt)"
  h=$(handle_of run.txt)
  [[ $h == local://$(hostname)/echo-* ]] || fail "handle: $(cat run.txt)"
  grep -q "$h SUCCEEDED" run.txt || fail "no SUCCEEDED progress line: $(cat run.txt)"
  "$elastrun" status --json "$h" >status.json
  [[ $(json status.json 'd["state"]') == SUCCEEDED ]] || fail "status: $(cat status.json)"
  [[ $(json status.json 'd["world_size"]') == 1 ]] || fail "status world: $(cat status.json)"
  "$elastrun" log "$h" >log.txt
  grep -qx '\[rank 0\] hello world' log.txt || fail "log: $(cat log.txt)"
  echo "$h" >first_handle
CASE

test_expect_success 'dist.ddp -j 2x2 locally: 4 ranks, log --rank and --regex, describe, list' <<'CASE'
  "$elastrun" run -s local_cwd --wait dist.ddp -j 2x2 --script "$here/cli_worker.py" --env GREETING=hi -- 3 >run2.txt 2>&1 \
    || fail "run: $(cat run2.txt)"
  h=$(handle_of run2.txt)
  "$elastrun" log "$h" >log2.txt
  for r in 0 1 2 3; do grep -qx "\[rank $r\] hello from rank $r of 4" log2.txt || fail "rank $r missing: $(cat log2.txt)"; done
  grep -qx '\[rank 2\] a line on stderr from rank 2' log2.txt || fail "stderr lines missing: $(cat log2.txt)"
  "$elastrun" log --rank 1 "$h" >log3.txt
  ! grep -v '^\[rank 1\] ' log3.txt || fail "--rank 1 shows other ranks: $(cat log3.txt)"
  grep -q 'rank 1 done' log3.txt || fail "--rank 1: $(cat log3.txt)"
  "$elastrun" log "$h" --regex 'done$' >log4.txt
  (($(wc -l <log4.txt) == 4)) || fail "--regex: $(cat log4.txt)"
  # --since: a duration or a time (local, or UTC with Z); the workers started a moment ago
  (($("$elastrun" log "$h" --since 1h --regex 'done$' | wc -l) == 4)) || fail "--since 1h: $("$elastrun" log "$h" --since 1h)"
  (($("$elastrun" log "$h" --since "$(date -d '-1 hour' +%Y-%m-%dT%H:%M)" | grep -c 'done$') == 4)) \
    || fail "--since an hour ago (local)"
  [[ -z $("$elastrun" log "$h" --since "$(date -u -d '+1 hour' +%Y-%m-%dT%H:%M:%SZ)") ]] || fail "--since in an hour (UTC)"
  (cd / && "$elastrun" describe "$h") >describe.txt
  grep -q 'dist.ddp -j 2x2' describe.txt && grep -q 'GREETING=hi' describe.txt && grep -q 'cli_worker.py' describe.txt \
    || fail "describe: $(cat describe.txt)"
  "$elastrun" list >list.txt
  (($(grep -c '^local://' list.txt) == 2)) || fail "list: $(cat list.txt)"
  head -2 list.txt | tail -1 | grep -q "^$h .*SUCCEEDED" || fail "list is not newest first: $(cat list.txt)"
CASE

test_expect_success 'a failing program: run --wait exits 3, status FAILED with the root cause' <<'CASE'
  rc=0
  "$elastrun" run -s local --wait utils.sh 'exit 7' >run3.txt 2>&1 || rc=$?
  ((rc == 3)) || fail "run --wait of a failing job exited $rc: $(cat run3.txt)"
  "$elastrun" status "$(handle_of run3.txt)" >status3.txt
  grep -q 'FAILED' status3.txt && grep -q 'root cause *rank 0 on node .* exited with code 7' status3.txt \
    || fail "status: $(cat status3.txt)"
CASE

test_expect_success 'cancel: the workers checkpoint and stop, the state is CANCELLED, nothing left' <<'CASE'
  "$elastrun" run -s local dist.ddp -j 1x2 --script "$here/cli_worker.py" >run4.txt 2>&1 || fail "run: $(cat run4.txt)"
  h=$(handle_of run4.txt)
  rank1_started() { "$elastrun" log --rank 1 "$h" | grep -q 'hello from rank 1'; }
  wait_for 30 rank1_started || fail "the workers did not start: $("$elastrun" status "$h")"
  [[ $("$elastrun" status --json "$h" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])') == RUNNING ]] \
    || fail "not RUNNING"
  pid=$(json "$out/index/local/${h##*/}/local.json" 'd["pid"]')
  "$elastrun" cancel --timeout 60 "$h" >cancel.txt 2>&1 || fail "cancel: $(cat cancel.txt)"
  grep -q 'the workers checkpointed first' cancel.txt || fail "cancel: $(cat cancel.txt)"
  "$elastrun" log "$h" | grep -q 'rank 1 checkpointed' || fail "no checkpoint: $("$elastrun" log "$h")"
  wait_for 10 exited "$pid" || fail "the agent $pid still runs"
  cancelled() { "$elastrun" status "$h" | head -1 | grep -q CANCELLED; }
  wait_for 10 cancelled || fail "status: $("$elastrun" status "$h")"
CASE

test_expect_success 'run without --wait returns at once, even inside $(...); cancel --now' <<'CASE'
  h=$(timeout 20 "$elastrun" run -s local utils.sh sleep 60) || fail "run inside \$(...) did not return"
  [[ $h == local://* ]] || fail "handle: $h"
  pid_known() { [[ -s $out/index/local/${h##*/}/local.json ]]; }
  wait_for 10 pid_known || fail "no local.json"
  pid=$(json "$out/index/local/${h##*/}/local.json" 'd["pid"]')
  "$elastrun" cancel --now "$h" >now.txt 2>&1 || fail "cancel --now: $(cat now.txt)"
  wait_for 10 exited "$pid" || fail "the agent $pid still runs after cancel --now"
  cancelled() { "$elastrun" status "$h" | head -1 | grep -q CANCELLED; }
  wait_for 10 cancelled || fail "status: $("$elastrun" status "$h")"
CASE

test_expect_success 'an argument with a newline: the script stays a script' <<'CASE'
  code=$'import sys\nprint("two", "lines", sys.argv[1:])'
  "$elastrun" run --dryrun utils.python -c "$code" >multi.sbatch
  bash -n multi.sbatch || fail "not a bash script: $(cat multi.sbatch)"
  # sbatch reads #SBATCH lines up to the first command: every line before the last #SBATCH is a comment
  last=$(grep -n '^#SBATCH' multi.sbatch | tail -1 | cut -d: -f1)
  ! head -n "$last" multi.sbatch | grep -v '^#' || fail "a command before the #SBATCH lines: $(cat multi.sbatch)"
  "$elastrun" run -s local --wait utils.python -c "$code" -- a b >multi.txt 2>&1 || fail "run: $(cat multi.txt)"
  "$elastrun" log "$(handle_of multi.txt)" | grep -qx "\[rank 0\] two lines \['a', 'b'\]" \
    || fail "log: $("$elastrun" log "$(handle_of multi.txt)")"
CASE

test_expect_success "a handle of another cluster: its directory answers, Slurm here is not asked" <<'CASE'
  mkdir -p index/othercluster/7
  echo '{"handle": "slurm://othercluster/7", "name": "far", "submitted_at": 1}' >index/othercluster/7/job.json
  echo '{"outcome": "succeeded", "exit_code": 0}' >index/othercluster/7/outcome.json
  [[ $("$elastrun" status --json slurm://othercluster/7 | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])') == SUCCEEDED ]] \
    || fail "status: $("$elastrun" status slurm://othercluster/7)"
  rc=0
  "$elastrun" cancel slurm://othercluster/7 >far.txt 2>&1 || rc=$?
  ((rc == 1)) || fail "cancel of another cluster's job exited $rc: $(cat far.txt)"
CASE

test_expect_success 'bad input: one line naming it, exit 2; an unknown handle exit 1' <<'CASE'
  check_refusal() {  # EXPECTED_RC PATTERN ARGS...
    local want=$1 pattern=$2 rc=0
    shift 2
    "$elastrun" "$@" >bad.txt 2>&1 || rc=$?
    ((rc == want)) || fail "elastrun $* exited $rc (expected $want): $(cat bad.txt)"
    (($(wc -l <bad.txt) == 1)) || fail "elastrun $*: more than one line: $(cat bad.txt)"
    grep -q -- "$pattern" bad.txt || fail "elastrun $*: '$(cat bad.txt)' does not say '$pattern'"
  }
  check_refusal 2 "unknown component 'dist.dpp'" run -s local dist.dpp --script x.py
  check_refusal 2 "bad -j '0x2'" run -s local dist.ddp -j 0x2 --script "$here/cli_worker.py"
  check_refusal 2 'no such file' run -s local dist.ddp --script nowhere.py
  check_refusal 2 'takes one handle' status
  check_refusal 2 "bad handle 'k8s://a/b'" status k8s://a/b
  check_refusal 2 "unknown option '--bogus'" log "$(cat first_handle)" --bogus
  check_refusal 2 "bad --rank 'x'" log "$(cat first_handle)" --rank x
  check_refusal 2 "bad --since '2026-13-45T99:00'" log "$(cat first_handle)" --since 2026-13-45T99:00
  check_refusal 2 "bad --since 'yesterday'" log "$(cat first_handle)" --since yesterday
  check_refusal 2 'takes one handle' cancel
  check_refusal 2 'takes no handle' list extra
  check_refusal 2 'takes one handle' describe a b
  check_refusal 1 'unknown handle' status local://"$(hostname)"/nothing-here
  "$elastrun" run --help | grep -q 'dist.ddp' || fail "run --help"
CASE

test_expect_success 'elastrun -- run: a program called run, not the verb' <<'CASE'
  mkdir -p bin
  printf '#!/bin/sh\necho "the program run, rank $RANK" >"%s/ran.txt"\n' "$out" >bin/run
  chmod +x bin/run
  PATH=$out/bin:$PATH "$elastrun" -- run >escape.txt 2>&1 || fail "elastrun -- run: $(cat escape.txt)"
  grep -q 'the program run, rank 0' ran.txt || fail "the program did not run: $(cat escape.txt)"
CASE

test_done
