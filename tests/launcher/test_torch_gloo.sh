#!/usr/bin/env bash
# An unmodified torch.distributed gloo program (gloo_allreduce.py) under
# `elastrun --standalone --nproc-per-node 2`, with Debian's python3-torch (/usr/bin/python3);
# then rank 1 dies on the first attempt while rank 0 is in the all-reduce: the agent stops rank 0
# at once (no gloo timeout), restarts both, and the second attempt succeeds; last, torchrun's static
# form with init_method="tcp://localhost:--master-port" (the port stays free for the workers); a
# hung worker under --hang-timeout (stacks, restart); torch's FileTimer protocol (expired -> kill).
# Exit 77 (skipped) when that interpreter has no torch. Usage: test_torch_gloo.sh path/to/elastrun
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
here=$(cd "$(dirname "$0")" && pwd)
py=${ELASTRUN_TEST_PYTHON:-/usr/bin/python3}
"$py" -c 'import torch.distributed' 2>/dev/null || skip "$py has no torch"
unset_env '^(SLURM_|PET_|RANK$|WORLD_SIZE$|MASTER_)'
sandbox
log=$SANDBOX/log
marker=$SANDBOX/marker
ELASTRUN_PYTHON=$py timeout 150 "$elastrun" --standalone --nproc-per-node 2 "$here/gloo_allreduce.py" >"$log" 2>&1
rc=$?
cat "$log"
[[ $rc -eq 0 ]] || fail "exit $rc"
for r in 0 1; do
  grep -q "^\[rank $r\] allreduce ok rank $r of 2: 3.0 restart 0" "$log" || fail "rank $r did not all-reduce"
done
start=$SECONDS
GLOO_TEST_CRASH_ONCE=$marker ELASTRUN_PYTHON=$py timeout 150 "$elastrun" --standalone --nproc-per-node 2 --max-restarts 1 \
  "$here/gloo_allreduce.py" >"$log" 2>&1
rc=$?
cat "$log"
[[ $rc -eq 0 ]] || fail "crash-once run exited $rc"
grep -q "state FAILED rank 1 .*exited with code 9" "$log" || fail "no FAILED line for rank 1"
for r in 0 1; do
  grep -q "^\[rank $r\] allreduce ok rank $r of 2: 3.0 restart 1" "$log" || fail "rank $r did not all-reduce after the restart"
done
echo "ok: crash during a collective -> restart -> success in $((SECONDS - start)) s"
# torchrun's static form with init_method="tcp://localhost:P" on the --master-port: the workers'
# c10d store must get port P (ours moves to P+1), as a script written for torchrun expects
port=$(free_port_pair)
GLOO_TEST_INIT_METHOD=tcp://localhost:$port ELASTRUN_PYTHON=$py timeout 150 "$elastrun" --nnodes=1 --nproc-per-node=2 \
  --master-addr=localhost --master-port="$port" --node-rank=0 "$here/gloo_allreduce.py" >"$log" 2>&1
rc=$?
cat "$log"
[[ $rc -eq 0 ]] || fail "static form with tcp:// init exited $rc"
grep -q "store localhost:$((port + 1))" "$log" || fail "the agents' store is not on --master-port + 1"
for r in 0 1; do
  grep -q "^\[rank $r\] allreduce ok rank $r of 2: 3.0 restart 0" "$log" || fail "rank $r did not all-reduce (tcp:// init)"
done
echo "ok: static form, init_method=tcp://localhost:--master-port"
# a hung worker (#16): rank 1 stops progressing, rank 0 waits in the all-reduce; --hang-timeout
# dumps the stuck worker's stacks (gdb and faulthandler) into the log and the failure report,
# and the restarted group finishes
rm -f "$marker"
start=$SECONDS
GLOO_TEST_HANG_ONCE=$marker PYTHONPATH=$here/../../worker/python ELASTRUN_PYTHON=$py timeout 150 \
  "$elastrun" --standalone --nproc-per-node 2 --max-restarts 1 --hang-timeout 4 --log-dir "$SANDBOX/logs" \
  --rdzv-id hang "$here/gloo_allreduce.py" >"$log" 2>&1
rc=$?
cat "$log"
[[ $rc -eq 0 ]] || fail "hang run exited $rc"
grep -q "made no progress for [0-9]* s (--hang-timeout): dumping its stacks" "$log" || fail "no hang line"
grep -q "stacks\] .*all_reduce" "$log" || fail "the stacks in the log do not show the all_reduce"
grep -q "by the agent: no progress for" "$log" || fail "the failure does not say the agent killed it"
for r in 0 1; do
  grep -q "^\[rank $r\] allreduce ok rank $r of 2: 3.0 restart 1" "$log" || fail "rank $r did not finish after the restart"
done
ls "$SANDBOX"/logs/hang/attempt_0/*/stacks.txt >/dev/null || fail "no stacks.txt"
echo "ok: hung worker -> stacks -> restart -> success in $((SECONDS - start)) s"
# torch's FileTimer protocol: rank 1 overruns `with timer.expires(after=2)`; the agent serves the
# FIFO (TORCHELASTIC_ENABLE_FILE_TIMER=1), SIGKILLs it, and the restarted group finishes
rm -f "$marker"
GLOO_TEST_TIMER_HANG_ONCE=$marker TORCHELASTIC_ENABLE_FILE_TIMER=1 ELASTRUN_PYTHON=$py timeout 150 \
  "$elastrun" --standalone --nproc-per-node 2 --max-restarts 1 "$here/gloo_allreduce.py" >"$log" 2>&1
rc=$?
cat "$log"
[[ $rc -eq 0 ]] || fail "file timer run exited $rc"
grep -q "FileTimer 'stuck_step' expired: sending it SIGKILL" "$log" || fail "no expired-timer line"
grep -q "by the agent: its torch FileTimer 'stuck_step' expired" "$log" || fail "the failure does not name the timer"
for r in 0 1; do
  grep -q "^\[rank $r\] allreduce ok rank $r of 2: 3.0 restart 1" "$log" || fail "rank $r did not finish after the timer kill"
done
echo "ok: torch FileTimer served: expired timer -> SIGKILL -> restart -> success"
echo "ok: gloo all-reduce under elastrun --standalone"
