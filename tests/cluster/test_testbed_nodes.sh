#!/usr/bin/env bash
# shellcheck disable=SC2016 # $VARS in single quotes are expanded by the remote task
# kill-node / wait-node / revive-node on a private 2-node testbed (TESTBED_ID must not be the shared
# one): the killed node's slurmd, slurmstepd and tasks vanish at once, the other node's task survives
# (srun --no-kill), the node goes DOWN within the SlurmdTimeout window, comes back after revive-node
# and runs work again. If ELASTRUN_SHARED_TESTBED_ID names a running testbed, it must be unaffected.
# Environment: ELASTRUN_TESTBED (testbed script), TESTBED_ID (private id), optional
# ELASTRUN_SHARED_TESTBED_ID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
private_testbed --given-id --keep-on-failure

# PIDs of processes running as tasks on node $1 of this testbed, with command name $2
task_pids() {
  local p comm
  while read -r p; do
    grep -qzxF "SLURM_CONF=$SLURM_CONF" "/proc/$p/environ" 2>/dev/null || continue
    comm=$(cat "/proc/$p/comm" 2>/dev/null) || continue
    [[ $comm == "$2" ]] && echo "$p"
  done < <(grep -lzxF "SLURMD_NODENAME=$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  return 0
}

gone() { [[ -z $(alive_pids "$@") ]]; } # every PID in $@ is gone or a zombie
sleeping_on_both() { [[ -n $(task_pids n1 sleep) && -n $(task_pids n2 sleep) ]]; }

remember_shared_testbed
t0=$SECONDS
testbed_up 2
echo "up took $((SECONDS - t0)) s"
eval "$("$TB" env)"

# a step on both nodes that survives node failure
srun -N2 -n2 --no-kill sleep 600 &
SRUN_PID=$!
track_pid "$SRUN_PID"
wait_for -a "$SRUN_PID" "srun exited early" 60 sleeping_on_both ||
  fail "srun -N2 sleep did not start tasks on n1 and n2 within 60 s"
mapfile -t n2_tasks < <(task_pids n2 sleep)
mapfile -t n1_tasks < <(task_pids n1 sleep)
mapfile -t n2_all < <("$TB" pids n2)
slurmd_n2=$(pgrep -x -f "slurmd -D -N n2 -f $SLURM_CONF") || fail "cannot find n2's slurmd"
echo "n2: slurmd $slurmd_n2, tasks ${n2_tasks[*]}, all ${n2_all[*]}; n1 tasks ${n1_tasks[*]}"
[[ " ${n2_all[*]} " == *" $slurmd_n2 "* ]] || fail "'testbed pids n2' misses slurmd $slurmd_n2"
for p in "${n2_tasks[@]}"; do
  [[ " ${n2_all[*]} " == *" $p "* ]] || fail "'testbed pids n2' misses task $p"
done
for p in "${n1_tasks[@]}"; do
  [[ " ${n2_all[*]} " != *" $p "* ]] || fail "'testbed pids n2' contains n1's task $p"
done

t0=$SECONDS
"$TB" kill-node n2
gone "${n2_all[@]}" || fail "kill-node n2 left processes: $(for p in "${n2_all[@]}"; do gone "$p" || echo "$p"; done)"
gone "${n1_tasks[@]}" && fail "kill-node n2 killed n1's task too"
"$TB" wait-node n2 down 60 || fail "n2 not DOWN 60 s after kill-node"
echo "n2 DOWN after $((SECONDS - t0)) s"
[[ $(sinfo -h -n n1 -o %T) != down* ]] || fail "n1 went down too"
gone "${n1_tasks[@]}" && fail "n1's task died (srun --no-kill should keep it)"

t0=$SECONDS
"$TB" revive-node n2
echo "n2 back after $((SECONDS - t0)) s"
st=$(sinfo -h -n n2 -o %T)
[[ $st =~ ^(idle|mixed|allocated)$ ]] || fail "n2 is '$st' after revive-node"
out=$(timeout 120 srun -N1 -n1 -w n2 bash -c 'echo "$SLURMD_NODENAME"') || fail "srun on revived n2 failed"
[[ $out == n2 ]] || fail "srun -w n2 ran on '$out'"

check_shared_testbed

stop_pid "$SRUN_PID"
echo "PASS: kill-node/revive-node on testbed '$TESTBED_ID'"
