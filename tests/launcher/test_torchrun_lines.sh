#!/usr/bin/env bash
# torchrun drop-in, side by side (#16): launch lines from PyTorch's docs and tests run under
# torchrun 1.13 (Debian python3-torch: `python3 -m torch.distributed.run`, which needs
# `--redirects 9:0 --tee 9:0` to start here) and under elastrun with the same arguments; the
# workers' ranks and sizes and NCCL_ASYNC_ERROR_HANDLING (torchrun_lines_worker.py) and the exit
# codes must be the same.
#   standalone        --standalone --nproc_per_node=2
#   localhost         --nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=localhost:P
#   loopback          the same with 127.0.0.1:P
#   static            --nnodes=1 --nproc_per_node=2 --master_addr=localhost --master_port=P --node_rank=0
#                     (no --rdzv_id: both use the run id 'none')
#   two_agents        two launchers on this host, the same arguments, no --node_rank:
#                     --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=localhost:P
#                     --rdzv_id=two: ranks 0..3 once each, world 4
#   exit_code         rank 1 exits 3 (once rank 0 has printed): the launcher exits 1
#   quoted_conf       localhost + --rdzv_conf='join_timeout=5,last_call_timeout=1,timeout=5' with the
#                     quotes in the argument, as PyTorch's launcher tests pass it (torchrun ignores
#                     the keys it cannot read; elastrun strips the quotes)
# Usage: test_torchrun_lines.sh path/to/elastrun
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
here=$(cd "$(dirname "$0")" && pwd)
py=${ELASTRUN_TEST_PYTHON:-/usr/bin/python3}
"$py" -c 'import torch.distributed.run' 2>/dev/null || skip "$py has no torch.distributed.run"
unset_env '^(SLURM_|PET_|RANK$|WORLD_SIZE$|MASTER_|TORCHELASTIC_|NCCL_|TORCH_NCCL_)'
sandbox --tmpdir
work=$SANDBOX
script=$here/torchrun_lines_worker.py

# launch LAUNCHER OUT ARGS...: runs torchrun or elastrun (backgrounded when OUT ends in .bg)
launch() {
  local which=$1 out=$2
  shift 2
  local cmd
  if [[ $which == torchrun ]]; then
    cmd=("$py" -m torch.distributed.run --redirects 9:0 --tee 9:0 "$@" "$script")
  else
    cmd=(env ELASTRUN_PYTHON="$py" "$elastrun" "$@" "$script")
  fi
  timeout 120 "${cmd[@]}" >"$out" 2>&1
}

# ranks OUT...: the workers' variables, one sorted line per worker, run-dependent ones left out.
# Found anywhere in the output: torchrun's console relay may put two workers' lines on one.
ranks() {
  cat "$@" | "$py" -c '
import json, re, sys
rows = []
for found in re.findall(r"TRLINE (\{[^{}]*\})", sys.stdin.read()):
    d = json.loads(found)
    for k in ("TORCHELASTIC_RUN_ID",) if d.get("TORCHELASTIC_RUN_ID") not in ("none",) else ():
        d.pop(k)
    rows.append(json.dumps(d, sort_keys=True))
print("\n".join(sorted(rows)))'
}

# same NAME RC_T RC_E: compares exit codes and ranks of the two runs
same() {
  local name=$1 rc_t=$2 rc_e=$3
  [[ $rc_t == "$rc_e" ]] || fail "$name: torchrun exited $rc_t, elastrun $rc_e: $(tail -5 "$work/$name.e")"
  ranks "$work/$name.t"* >"$work/$name.t.ranks"
  ranks "$work/$name.e"* >"$work/$name.e.ranks"
  [[ -s $work/$name.t.ranks ]] || fail "$name: torchrun's workers printed nothing: $(tail -5 "$work/$name.t")"
  diff "$work/$name.t.ranks" "$work/$name.e.ranks" >"$work/$name.diff" ||
    fail "$name: the workers differ (< torchrun, > elastrun): $(cat "$work/$name.diff")"
  echo "ok: $name: $(wc -l <"$work/$name.t.ranks") workers with the same variables, exit $rc_t"
}

one_line() { # one_line NAME ARGS...: the same single-launcher line under both
  local name=$1 rc_t=0 rc_e=0
  shift
  launch torchrun "$work/$name.t" "$@" || rc_t=$?
  launch elastrun "$work/$name.e" "$@" || rc_e=$?
  same "$name" "$rc_t" "$rc_e"
}

one_line standalone --standalone --nproc_per_node=2
port=$(free_port_pair)
one_line localhost --nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=localhost:"$port"
port=$(free_port_pair)
one_line loopback --nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:"$port"
port=$(free_port_pair)
one_line static --nnodes=1 --nproc_per_node=2 --master_addr=localhost --master_port="$port" --node_rank=0
mkdir -p "$work/sync"
TR_SYNC_DIR=$work/sync TR_EXIT_RANK1=3 one_line exit_code --standalone --nproc_per_node=2
port=$(free_port_pair)
one_line quoted_conf --nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=localhost:"$port" \
  "--rdzv_conf='join_timeout=5,last_call_timeout=1,timeout=5'"

# two launchers with the same line, started together
for which in torchrun elastrun; do
  port=$(free_port_pair)
  args=(--nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=localhost:"$port" --rdzv_id=two)
  launch "$which" "$work/two_agents.${which:0:1}1" "${args[@]}" &
  first=$!
  track_pid "$first"
  launch "$which" "$work/two_agents.${which:0:1}2" "${args[@]}"
  rc2=$?
  await "$first"
  rc1=$?
  [[ $rc1 -eq 0 && $rc2 -eq 0 ]] || fail "two_agents: $which exited $rc1/$rc2: $(tail -3 "$work/two_agents.${which:0:1}1" "$work/two_agents.${which:0:1}2")"
done
same two_agents 0 0
[[ $(grep -o '"RANK": "[0-9]*"' "$work/two_agents.e.ranks" | sort -u | wc -l) -eq 4 &&
  $(grep -c '"WORLD_SIZE": "4"' "$work/two_agents.e.ranks") -eq 4 ]] ||
  fail "two_agents: elastrun's ranks are not 0..3 once each: $(cat "$work/two_agents.e.ranks")"
echo "ok: every launch line ran as under torchrun 1.13"
