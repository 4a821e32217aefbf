#!/usr/bin/env bash
# The memory checkpoint tier in the agent (--memory-checkpoints): a worker's snapshot outlives the
# worker and comes back to its restart; the segments go with the agent, kill -9 included.
# Usage: test_agent_memory.sh path/to/elastrun  (TEST_ONLY=WORDS: one case)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
python=${ELASTRUN_PYTHON:-/usr/bin/python3}
worker_sandbox memory_worker
work=$SANDBOX
show_on_failure 40 "$work/stdout" "$work/stderr"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
unset_env '^(SLURM_|PET_|PMI_|PMIX_|OMPI_)'
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH}  # elastrun.memory is pure Python
test_setup() {
  kill_recorded_pids "$work/out/pids" memory_worker
  rm -rf "${work:?}"/out/* "$work/stdout" "$work/stderr"
}
# memfds named elastrun-mem-<step>-* that some process still holds
memfds_of_step() { find /proc/[0-9]*/fd -lname "/memfd:elastrun-mem-$1-*" 2>/dev/null; }

test_expect_success 'restart: rank 1 crashes after step 3: both ranks get step 3 back from the agent, intact' <<'CASE'
MEMORY_WORKER_MODE=crash "$elastrun" --standalone --nproc-per-node 2 --memory-checkpoints=64M --max-restarts 1 \
  --monitor-interval 0.05 "$python" "$root/tests/launcher/memory_worker.py" >"$work/stdout" 2>"$work/stderr"
rc=$?
[[ $rc -eq 0 ]] || fail "exit $rc"
grep -q "memory checkpoints: up to 64.0 MiB" "$work/stderr" || fail "no budget line"
for r in 0 1; do
  f=$work/out/restored.$r.json
  [[ -f $f ]] || fail "rank $r restored nothing"
  [[ $(json "$f" 'd["step"]') == 3 ]] || fail "rank $r: $(cat "$f")"
  [[ $(json "$f" 'd["intact"]') == True ]] || fail "rank $r: snapshot damaged: $(cat "$f")"
  [[ $(json "$f" 'd["older"]') == True ]] || fail "rank $r: step 2 not kept beside step 3"
done
[[ $(json "$work/out/restored.0.json" 'len(d["list"]["segments"])') == 4 ]] || fail "not 2 steps x 2 ranks kept"
[[ $(json "$work/out/restored.0.json" 'd["forgot_after_2"], d["steps_left"]') == "(2, [2])" ]] ||
  fail "mem_forget after step 2 did not drop exactly step 3 of both ranks: $(cat "$work/out/restored.0.json")"
echo "ok: a crashed group restored its newest snapshots from the agent's memory"
CASE

test_expect_success 'kill -9: the agent and its workers hold the only descriptors: nothing left, /dev/shm untouched' <<'CASE'
shm_before=$(ls /dev/shm | sort)
MEMORY_WORKER_MODE=hold "$elastrun" --standalone --nproc-per-node 2 --memory-checkpoints=128M \
  "$python" "$root/tests/launcher/memory_worker.py" >"$work/stdout" 2>"$work/stderr" &
agent=$!
track_pid "$agent"
wait_for -a "$agent" "the agent exited early" 30 have_files 2 "$work/out/held.*" || fail "no snapshot held"
[[ -n $(memfds_of_step 424242) ]] || fail "no process holds the segments"
kill -9 "$agent"
await "$agent"
wait_for 10 eval '[[ -z $(memfds_of_step 424242) ]]' || fail "segments still held: $(memfds_of_step 424242)"
wait_for 10 eval '[[ -z $(alive_recorded_pids "$work/out/pids" memory_worker) ]]' || fail "workers left"
[[ $(ls /dev/shm | sort) == "$shm_before" ]] || fail "/dev/shm changed: $(ls /dev/shm)"
echo "ok: kill -9 of the agent freed its memory checkpoints"
CASE

test_done
