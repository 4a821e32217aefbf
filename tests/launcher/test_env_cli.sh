#!/usr/bin/env bash
# `elastrun env` on bad input: one clear stderr line naming the variable, non-zero exit;
# on good input: valid JSON. Usage: test_env_cli.sh path/to/elastrun
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
failures=0

expect_error() {  # expect_error NAME_IN_MESSAGE VAR=VALUE...
  local name=$1; shift
  local err rc
  err=$(env -i PATH="$PATH" "$@" "$elastrun" env --json 2>&1 >/dev/null); rc=$?
  if [[ $rc -eq 0 ]]; then echo "FAIL: accepted: $*"; ((failures++)); return; fi
  if [[ $(printf '%s\n' "$err" | wc -l) -ne 1 ]]; then echo "FAIL: not one line for $*: $err"; ((failures++)); fi
  if [[ $err != *"$name"* ]]; then echo "FAIL: error for $* does not name $name: $err"; ((failures++)); fi
}

expect_error SLURM_PROCID SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_PROCID=4 SLURM_NTASKS=4 SLURM_STEP_NODELIST='n[1-2]'
expect_error SLURM_NODEID SLURM_JOB_ID=7 SLURM_NODEID=0
expect_error SLURM_STEP_NODELIST SLURM_JOB_ID=7 SLURM_STEP_ID=0 SLURM_STEP_NODELIST='n[1-'
expect_error SLURM_JOB_ID SLURM_PROCID=0
expect_error WORLD_SIZE RANK=0

out=$(env -i PATH="$PATH" SLURM_JOB_ID=7 SLURM_STEP_ID=1 SLURM_PROCID=1 SLURM_NTASKS=2 \
      SLURM_STEP_NODELIST='n[1-2]' SLURM_NODEID=1 SLURM_STEP_TASKS_PER_NODE='1(x2)' "$elastrun" env --json)
if ! printf '%s' "$out" | /usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["rank"]==1 and d["node_rank"]==1 and d["rdzv_endpoint"]["host"]=="n1", d'; then
  echo "FAIL: good environment gave: $out"; ((failures++))
fi

"$elastrun" --no-such-flag >/dev/null 2>&1; rc=$?
[[ $rc -eq 2 ]] || { echo "FAIL: unknown command line exited $rc, expected 2"; ((failures++)); }

[[ $failures -eq 0 ]] && echo "ok: env CLI" || exit 1
