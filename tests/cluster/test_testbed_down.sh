#!/usr/bin/env bash
# `testbed down` leaves nothing behind: on a private 2-node testbed with an srun step (tasks with
# children), a batch job and an salloc running, `down` must end every daemon, slurmstepd, task and
# client of that testbed, free its ports and remove its state dir; a second `down` is a no-op. If
# ELASTRUN_SHARED_TESTBED_ID names a running testbed, it must be unaffected.
# Environment: ELASTRUN_TESTBED (testbed script), TESTBED_ID (private id), optional
# ELASTRUN_SHARED_TESTBED_ID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
private_testbed --given-id --keep-on-failure
DIR=$("$TB" dir)
CONF=$DIR/slurm.conf
BG=()

# Processes that mention this testbed: environment or command line contains the state dir path.
# ($$ and our children do not: SLURM_CONF is never exported in this shell.)
mentions() {
  local p
  while read -r p; do
    [[ $p == "$$" ]] || echo "$p"
  done < <(grep -lzF -- "$DIR" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
  pgrep -f -- "$DIR" || true
}

remember_shared_testbed
testbed_up 2
read -r -a ports <"$DIR/ports" || true
((${#ports[@]} == 3)) || fail "expected 3 ports in $DIR/ports, got '${ports[*]}'"
cluster=$(awk -F= '$1 == "ClusterName" { print $2 }' "$CONF")

# work of every kind: a step whose tasks fork, a batch job with a step, an salloc with a local command
SLURM_CONF=$CONF srun -N2 -n2 bash -c 'sleep 600 & sleep 600; wait' >/dev/null 2>&1 &
BG+=($!)
track_pid $!
disown # no "Killed" job notices when down kills it
# The 2-node step first: if the 1-node jobs were placed first they could both land on n1, fill
# its 2 CPUs and leave the step pending for ever (seen on a loaded machine).
step_running() { SLURM_CONF=$CONF squeue -h -t R -o %D | grep -qx 2; }
wait_for -i 0.3 60 step_running || fail "the 2-node srun step did not start within 60 s"
SLURM_CONF=$CONF salloc -N1 -n1 sleep 600 >/dev/null 2>&1 &
BG+=($!)
track_pid $!
disown
SLURM_CONF=$CONF sbatch -N1 -n1 -o /dev/null --wrap 'srun sleep 600' >/dev/null || fail "sbatch failed"

# 2 step tasks (+2 children) + batch script, its srun and step task + salloc's command
jobs_running() {
  running=$( (grep -lzxF "SLURM_CLUSTER_NAME=$cluster" /proc/[0-9]*/environ 2>/dev/null || true) | wc -l)
  ((running >= 8))
}
wait_for 60 jobs_running || fail "jobs did not start within 60 s ($running tagged processes)"
mapfile -t before < <(mentions | sort -un)
echo "before down: ${#before[@]} processes mention $DIR; $running tagged with cluster $cluster"
((${#before[@]} >= 12)) || fail "expected the daemons and jobs to mention $DIR, found ${#before[@]}"

t0=$SECONDS
"$TB" down || fail "testbed down failed"
echo "down took $((SECONDS - t0)) s"

left=$(alive_pids "${before[@]}")
[[ -z $left ]] || fail "still alive after down: $(ps -o pid,args -p "${left//$'\n'/,}")"
mapfile -t after < <(mentions | sort -un)
left=$(alive_pids "${after[@]}")
[[ -z $left ]] || fail "processes still mention $DIR: $(ps -o pid,args -p "${left//$'\n'/,}")"
mapfile -t after < <(grep -lzxF "SLURM_CLUSTER_NAME=$cluster" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3)
left=$(alive_pids "${after[@]}")
[[ -z $left ]] || fail "processes of cluster $cluster still alive: $left"
for p in "${BG[@]}"; do
  [[ -z $(alive_pids "$p") ]] || fail "client $p (srun/salloc) still alive"
done
[[ ! -e $DIR ]] || fail "state dir $DIR still exists"
listening=" $(ss -Htln | awk '{ n = split($4, a, ":"); print a[n] }' | tr '\n' ' ') "
for port in "${ports[@]}"; do
  [[ $listening != *" $port "* ]] || fail "port $port still listening"
done

"$TB" down || fail "second down (nothing up) failed"

check_shared_testbed
echo "PASS: down leaves nothing behind (testbed '$TESTBED_ID')"
