#!/usr/bin/env bash
# SPANK plugin on a private 2-node testbed (it rewrites plugstack.conf.d, so it never touches the
# shared cluster): usage: test_spank.sh CASE
#   help        srun --help lists --torch-env, --elastic, --elastic-nproc
#   ranks       srun -N2 -n4 --torch-env: consistent values; also --mpi=pmix, the SLURM_SPANK_*
#               environment form, --export=NONE, and stale RANK/MASTER_* from the submit shell
#   gloo        torch gloo all_reduce over env:// with 2 nodes x 2 tasks and only --torch-env; the
#               same for examples' libtorch `train` (when built: TRAIN)
#   python      the elastrun Python package with only --torch-env (tests/python/ranks.py): 4 ranks
#               on 2 nodes without a process group (the package's own store), a model + Adam saved
#               by 4 ranks through the group's store and loaded bit-exactly by 3
#   het         srun A : B and salloc A : B + srun --het-group=0,1: global ranks, one master
#   batch       sbatch/salloc --torch-env: every srun of the job gets it, the batch script does not;
#               sbatch/torch-env.sbatch runs 2 nodes x 2 tasks with a consistent torch environment
#   concurrent  two overlapping steps of one job get different MASTER_PORTs
#   errors      --elastic=5:2 / x / 2:4, --elastic-nproc=0, --torch-env=maybe fail before launch
#   site        plugstack.conf arguments: unknown key fails naming it; torch_env=yes default;
#               master_addr=hostname; optional + missing file: plain srun still works
#   elastic     (3 nodes) srun --elastic=2:3 -N3 --ntasks-per-node=1 [--elastic-nproc=2] worker:
#               one agent per node, workers get RANK/WORLD_SIZE/MASTER_ADDR... from it; the
#               environment form; more than one task per node and --elastic --torch-env refused
#   elastic_kill2, elastic_kill1
#               (3 nodes) srun --no-kill --elastic=2:3 --elastic-nproc=2 -N3 with sleeping
#               workers; kill-node n2 (resp. n1, the step's first node): the two survivors
#               re-form with WORLD_SIZE 4 and complete
# Every case ends by checking that no elastrun process, file or socket is left behind (for the
# elastic cases: no agent, worker or store process, no state directory, nothing in TMPDIR).
# Environment: ELASTRUN_TESTBED, TESTBED_ID (shared id; this test uses <id>-spank),
# SPANK_PLUGIN (the built spank_elastrun.so), TESTS_DIR (this directory), ELASTRUN_AGENT (the
# built elastrun), TEST_WORKER (the built launcher_test_worker).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
CASE=${1:?usage: test_spank.sh CASE}
PY=/usr/bin/python3
sandbox /tmp/spank-test.XXXXXX
out=$SANDBOX
stamp=$out/stamp
touch "$stamp"
# --elastic state: the plugin's tmpdir (site argument) and the tasks' TMPDIR, both private here
mkdir -p "$out/state"
show_on_failure 80 "$out/*.log"

leftovers() { # what the plugin could leave behind: processes with it loaded, files, sockets
  # (other components' /tmp/elastrun-* files are not ours; the plugin itself creates none)
  local p
  for p in /proc/[0-9]*; do
    grep -qs spank_elastrun "$p/maps" && echo "process ${p#/proc/} maps spank_elastrun.so: $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)"
  done
  find /tmp /dev/shm /run -xdev -maxdepth 2 -newer "$stamp" \( -iname '*spank*' -o -iname '*torch-env*' \) \
    ! -path "$out" ! -path "$out/*" 2>/dev/null | sed 's/^/file /'
  ss -xap 2>/dev/null | grep -i spank | sed 's/^/socket /' || true
  elastic_leftovers
}

elastic_leftovers() { # --elastic: agents, workers and store helpers are this build's binaries
  local p
  for p in /proc/[0-9]*; do
    case $(readlink "$p/exe" 2>/dev/null) in
    "${ELASTRUN_AGENT:-/nonexistent}" | "${TEST_WORKER:-/nonexistent}")
      # only this test's: started on this testbed (its cluster) or with this test's TMPDIR --
      # ctest runs other tests' agents from the same build at the same time
      grep -qszxF -e "SLURM_CLUSTER_NAME=${SPANK_CLUSTER:-/none}" -e "TMPDIR=$out/tmp" "$p/environ" || continue
      echo "process ${p#/proc/}: $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)" ;;
    esac
  done
  find "$out/state" "$out/tmp" -mindepth 1 2>/dev/null | sed 's/^/file /'
}

check_leftovers() { # at exit, once the testbed is down
  local left
  left=$(leftovers)
  if [[ -n $left ]]; then
    echo "FAIL: left behind after the test:" >&2
    echo "$left" >&2
    EXIT_RC=1
  fi
}

NODES=2
[[ $CASE == elastic* ]] && NODES=3
UP_OPTS=()
if [[ $CASE == gpus ]]; then
  for f in /dev/tty0 /dev/tty1 /dev/tty2 /dev/tty3; do [[ -c $f ]] || skip "no $f: the testbed's GPUs need /dev/tty0..3"; done
  UP_OPTS=(--gpus 4)
fi
private_testbed
on_exit check_leftovers
testbed_up $NODES "${UP_OPTS[@]}"
eval "$("$TB" env)"
DIR=$("$TB" dir)
SPANK_CLUSTER=$(sed -n 's/^ClusterName=//p' "$DIR/slurm.conf")
use_plugin() { printf '%s\n' "$*" >"$DIR/plugstack.conf.d/elastrun.conf"; }
use_plugin required "$SPANK_PLUGIN"
ELASTIC_PLUGIN=(required "$SPANK_PLUGIN" "agent=$ELASTRUN_AGENT" "tmpdir=$out/state")
if [[ $CASE == elastic* ]]; then
  # slurmd reads plugstack.conf only when it starts: restart every slurmd so that the job
  # epilog (slurm_spank_job_epilog) is active, not only srun's and slurmstepd's callbacks.
  use_plugin "${ELASTIC_PLUGIN[@]}"
  for ((i = 1; i <= NODES; i++)); do "$TB" kill-node "n$i" >/dev/null; "$TB" revive-node "n$i" >/dev/null; done
fi
export TMPDIR=$out/tmp

# Runs a step of torch_env_task.py, checks it with check_torch_env.py.
# check_step NTASKS NNODES MASTER_ADDR [checker flags] -- srun/salloc command...
check_step() {
  local ntasks=$1 nnodes=$2 addr=$3 flags=()
  shift 3
  while [[ $1 != -- ]]; do flags+=("$1"); shift; done
  shift
  "$@" >"$out/step.jsonl" 2>"$out/step.err" || { cat "$out/step.err" >&2; fail "step failed: $*"; }
  "$PY" "$TESTS_DIR/check_torch_env.py" "$out/step.jsonl" "$ntasks" "$nnodes" "$addr" "${flags[@]}" ||
    { cat "$out/step.jsonl" "$out/step.err" >&2; fail "inconsistent torch environment: $*"; }
}

# Expects a command to fail before launching anything, with an elastrun: line matching $1.
expect_refused() {
  local pattern=$1
  shift
  local start=$SECONDS rc=0
  "$@" >"$out/ref.out" 2>"$out/ref.err" || rc=$?
  ((rc != 0)) || fail "'$*' succeeded"
  grep -q LAUNCHED "$out/ref.out" && fail "'$*' launched its task"
  grep -q "srun: job .* queued\|allocated resources" "$out/ref.err" && fail "'$*' allocated a job"
  grep -Eq "elastrun: .*$pattern" "$out/ref.err" || { cat "$out/ref.err" >&2; fail "'$*': no 'elastrun: ...$pattern' message"; }
  echo "ok: refused in $((SECONDS - start)) s: $* -> $(grep -m1 'elastrun:' "$out/ref.err")"
}

TASK="$TESTS_DIR/torch_env_task.py"

no_leftovers() { [[ -z $(elastic_leftovers) ]]; }

# Checks the workers' JSON records of an --elastic run: check_elastic DIR WORLD NPROC NODES...
# (the steps pin their nodes with -w: Slurm may place an unpinned 2-node step on n1,n3)
# (the workers with WORLD_SIZE=WORLD: ranks 0..WORLD-1 in node order, one master and run id)
check_elastic() {
  /usr/bin/python3 - "$@" <<'PY'
import glob, json, sys
d, world, nproc, nodes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
runs = [json.load(open(f)) for f in glob.glob(d + "/rank*.json")]
runs = [r for r in runs if r["WORLD_SIZE"] == str(world)]
assert len(runs) == world, f"{len(runs)} workers with WORLD_SIZE {world}: {runs}"
assert sorted(int(r["RANK"]) for r in runs) == list(range(world)), runs
for r in runs:
    rank = int(r["RANK"])
    assert r["ELASTRUN_NODE"] == nodes[rank // nproc], (r, nodes)
    assert int(r["LOCAL_RANK"]) == rank % nproc and r["LOCAL_WORLD_SIZE"] == str(nproc), r
    assert int(r["GROUP_RANK"]) == rank // nproc and r["GROUP_WORLD_SIZE"] == str(len(nodes)), r
    assert r["MASTER_ADDR"] and int(r["MASTER_PORT"]) > 0, r
    assert r["TORCHELASTIC_ERROR_FILE"].startswith(sys.argv[1].rsplit("/", 1)[0] + "/state/elastrun-spank."), r
keys = {(r["MASTER_ADDR"], r["MASTER_PORT"], r["TORCHELASTIC_RUN_ID"], r["ELASTRUN_GENERATION"]) for r in runs}
assert len(keys) == 1, keys
print(f"ok: {world} workers on {' '.join(nodes)}, ranks in node order, master {runs[0]['MASTER_ADDR']}:{runs[0]['MASTER_PORT']}, run {runs[0]['TORCHELASTIC_RUN_ID']}")
PY
}

# The kill-node cases: 3 agents x 2 workers sleep in the 6-rank round; kill-node $1; the two
# survivors ($2 $3) re-form with WORLD_SIZE 4 and finish; srun ends; nothing is left behind.
elastic_kill() {
  local victim=$1 survivors=("$2" "$3") killed
  mkdir -p "$out/kill"
  TEST_WORKER_OUT_DIR=$out/kill TEST_WORKER_SLEEP=300 TEST_WORKER_SLEEP_WORLD_SIZE=6 \
    srun --no-kill -N3 -w 'n[1-3]' --ntasks-per-node=1 --elastic=2:3 --elastic-nproc=2 "$TEST_WORKER" \
    >"$out/kill.log" 2>&1 &
  srun_pid=$!
  track_pid "$srun_pid"
  wait_for -a "$srun_pid" "srun ended early" 180 have_files 6 "$out/kill/rank*.json" || fail "6 workers did not start"
  check_elastic "$out/kill" 6 2 n1 n2 n3
  # the store is srun's child (`elastrun store-serve`), on no compute node
  local p store=
  for p in /proc/[0-9]*; do
    [[ $(readlink "$p/exe" 2>/dev/null) == "$ELASTRUN_AGENT" ]] && tr '\0' ' ' <"$p/cmdline" | grep -q '^[^ ]* store-serve ' &&
      store+="${p#/proc/}:$(awk '{print $4}' "$p/stat") "
  done
  [[ -n $store ]] || fail "no elastrun store-serve process while the step runs"
  [[ " $store" == *":$srun_pid "* ]] || fail "the store helper ($store) is not srun's ($srun_pid) child"
  echo "store helper (pid:parent pid) $store; srun pid $srun_pid"
  "$TB" kill-node "$victim"
  killed=$SECONDS
  wait_for 240 have_lines 2 "done; exiting 0" "$out/kill.log" || fail "the two survivors did not finish after kill-node $victim"
  echo "kill-node $victim -> survivors finished in $((SECONDS - killed)) s"
  wait_for 120 exited "$srun_pid" || fail "srun did not end after the survivors finished"
  await "$srun_pid" || true # srun reports the lost node's task as failed
  check_elastic "$out/kill" 4 2 "${survivors[@]}"
  grep -q "state MEMBERSHIP_CHANGED member lost" "$out/kill.log" || fail "no MEMBERSHIP_CHANGED (member lost)"
  # the killed node's state directory goes with the job epilog of the survivors (shared tmpdir here)
  wait_for 90 no_leftovers || fail "left behind after kill-node $victim: $(elastic_leftovers)"
  echo "ok: kill-node $victim: a 2-node job completed; no process, state dir or temp file left"
}

case $CASE in
help)
  srun --help >"$out/help" 2>&1 || true
  for opt in --torch-env --elastic --elastic-nproc; do
    grep -q -- "$opt" "$out/help" || { cat "$out/help" >&2; fail "srun --help does not list $opt"; }
  done
  echo "ok: srun --help lists --torch-env, --elastic, --elastic-nproc"
  ;;
ranks)
  check_step 4 2 127.0.0.1 -- srun -N2 -n4 --torch-env "$PY" "$TASK"
  check_step 4 2 127.0.0.1 -- srun --mpi=pmix -N2 -n4 --torch-env "$PY" "$TASK"
  check_step 3 2 127.0.0.1 -- env SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_torch_env=yes \
    srun -N2 -n3 "$PY" "$TASK"
  check_step 2 2 127.0.0.1 -- srun --export=NONE -N2 -n2 --torch-env "$PY" "$TASK"
  check_step 4 2 127.0.0.1 -- env RANK=7 WORLD_SIZE=9 LOCAL_RANK=3 MASTER_ADDR=bogus MASTER_PORT=1 \
    TORCHELASTIC_RUN_ID=stale OMPI_COMM_WORLD_RANK=5 OMPI_COMM_WORLD_SIZE=6 \
    srun -N2 -n4 --torch-env "$PY" "$TASK"
  # --torch-env=no (and no option at all): nothing is set
  srun -N1 -n1 --torch-env=no "$PY" "$TASK" | grep -q '"RANK": null' || fail "--torch-env=no set RANK"
  srun -N1 -n1 "$PY" "$TASK" | grep -q '"RANK": null' || fail "a plain srun got RANK"
  echo "ok: --torch-env=no and plain srun leave the environment alone"
  ;;
gloo)
  check_step 4 2 127.0.0.1 --allreduce -- srun -N2 -n4 --torch-env "$PY" "$TASK" --allreduce
  # the libtorch example (c10d TCPStore + Gloo from the same variables), no launcher either
  if [[ -x ${TRAIN:-} ]]; then
    srun -N2 -n4 --torch-env "$TRAIN" --steps 20 --ckpt-dir "$out/ck" >"$out/train.log" 2>&1 ||
      fail "srun --torch-env train exited $?: $(tail -5 "$out/train.log")"
    grep -q "^\[rank 0\] done: 20 steps" "$out/train.log" || fail "train did not finish: $(tail -5 "$out/train.log")"
    [[ $(grep -c "done: 20 steps" "$out/train.log") -eq 4 ]] || fail "not all 4 ranks of train finished"
    [[ -d $out/ck/step-000000020 ]] || fail "train wrote no checkpoint of step 20"
    echo "ok: examples' libtorch train (Gloo, 2 nodes x 2 tasks) with only --torch-env"
  fi
  ;;
het)
  # components pinned (-w): the placement below is asserted, Slurm must not choose it
  check_step 3 2 127.0.0.1 -- srun --torch-env -N1 -n1 -w n1 : -N1 -n2 -w n2 "$PY" "$TASK"
  check_step 3 2 127.0.0.1 -- salloc -Q -N1 -n1 -w n1 : -N1 -n2 -w n2 \
    srun --het-group=0,1 --torch-env "$PY" "$TASK"
  # the first component's first node is the master: n1 here, with ranks 0.. on it
  grep '"RANK": "0"' "$out/step.jsonl" | grep -q '"SLURMD_NODENAME": "n1"' || fail "rank 0 is not on n1"
  ;;
batch)
  sbatch --wait -Q -N2 -o "$out/batch.out" --torch-env --wrap \
    "echo script RANK=\${RANK-unset}; srun -N2 -n2 bash -c 'echo step RANK=\$RANK WORLD_SIZE=\$WORLD_SIZE'" ||
    { cat "$out/batch.out" >&2; fail "sbatch --torch-env job failed"; }
  cat "$out/batch.out"
  grep -qx 'script RANK=unset' "$out/batch.out" || fail "the batch script got RANK"
  [[ $(grep -c '^step RANK=[01] WORLD_SIZE=2$' "$out/batch.out") == 2 ]] || fail "sbatch --torch-env: srun steps lack the torch environment"
  salloc -Q -N2 --torch-env srun -N2 -n2 bash -c 'echo step RANK=$RANK' >"$out/salloc.out"
  [[ $(grep -c '^step RANK=[01]$' "$out/salloc.out") == 2 ]] || { cat "$out/salloc.out"; fail "salloc --torch-env: srun steps lack the torch environment"; }
  salloc -Q -N1 --torch-env srun -N1 -n1 --torch-env=no bash -c 'echo "[${RANK-unset}]"' | grep -q '\[unset\]' ||
    fail "srun --torch-env=no does not override salloc --torch-env"
  # sbatch/torch-env.sbatch: 2 nodes x 2 tasks, each with a consistent torch environment
  sbatch --wait -Q -o "$out/torch-env.out" "$TESTS_DIR/../../sbatch/torch-env.sbatch" "$PY" "$TASK" ||
    { cat "$out/torch-env.out" >&2; fail "sbatch/torch-env.sbatch failed"; }
  "$PY" "$TESTS_DIR/check_torch_env.py" "$out/torch-env.out" 4 2 127.0.0.1 ||
    { cat "$out/torch-env.out" >&2; fail "sbatch/torch-env.sbatch: inconsistent torch environment"; }
  echo "ok: sbatch/salloc --torch-env apply to the job's srun steps, not to the batch script; sbatch/torch-env.sbatch gives 4 ranks"
  ;;
concurrent)
  salloc -Q -N2 bash -c "
    srun --overlap -N2 -n2 --torch-env bash -c 'echo \$SLURM_STEP_ID \$MASTER_PORT \$TORCHELASTIC_RUN_ID; sleep 3' >$out/a &
    srun --overlap -N2 -n2 --torch-env bash -c 'echo \$SLURM_STEP_ID \$MASTER_PORT \$TORCHELASTIC_RUN_ID; sleep 3' >$out/b &
    wait" 2>"$out/c.err" || { cat "$out/c.err" >&2; fail "concurrent steps failed"; }
  cat "$out/a" "$out/b"
  [[ $(sort -u "$out/a" | wc -l) == 1 && $(sort -u "$out/b" | wc -l) == 1 ]] || fail "a step is inconsistent"
  read -r step_a port_a rid_a <"$out/a"
  read -r step_b port_b rid_b <"$out/b"
  [[ $step_a != "$step_b" ]] || fail "the two steps have the same id"
  [[ $port_a != "$port_b" ]] || fail "two concurrent steps got the same MASTER_PORT $port_a"
  [[ $rid_a != "$rid_b" ]] || fail "two concurrent steps got the same TORCHELASTIC_RUN_ID"
  echo "ok: concurrent steps $step_a/$step_b got MASTER_PORT $port_a/$port_b"
  ;;
errors)
  expect_refused "MIN \(5\) is greater than MAX \(2\)" srun -N1 -n1 --elastic=5:2 echo LAUNCHED
  expect_refused "--elastic='x' is not MIN:MAX" srun -N1 -n1 --elastic=x echo LAUNCHED
  expect_refused "--elastic-nproc='0'" srun -N1 -n1 --elastic-nproc=0 echo LAUNCHED
  expect_refused "--elastic and --torch-env exclude each other" srun -N1 -n1 --elastic --torch-env echo LAUNCHED
  expect_refused "--elastic and --torch-env exclude each other" srun -N1 -n1 --torch-env --elastic-nproc=2 echo LAUNCHED
  expect_refused "applies to a job step" sbatch --elastic=2:3 --wrap "echo LAUNCHED"
  expect_refused "--torch-env='maybe'" srun -N1 -n1 --torch-env=maybe echo LAUNCHED
  printf '0 echo LAUNCHED\n' >"$out/multi-prog.conf"
  expect_refused "does not support --multi-prog" srun -N1 -n1 --elastic --multi-prog "$out/multi-prog.conf"
  expect_refused "MIN \(3\) is greater" env SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_elastic=3:1 \
    srun -N1 -n1 echo LAUNCHED
  expect_refused "MIN \(5\) is greater" sbatch --elastic=5:2 --wrap "echo LAUNCHED"
  # A step whose environment is inconsistent (a stale PMIX_RANK) must not start its tasks, whether
  # the plugin is required or optional (Slurm ignores an optional plugin's errors).
  for kind in required optional; do
    use_plugin "$kind" "$SPANK_PLUGIN"
    PMIX_RANK=5 srun -N1 -n2 --torch-env echo LAUNCHED >"$out/t.out" 2>"$out/t.err" || true
    grep -q LAUNCHED "$out/t.out" && { cat "$out/t.err" >&2; fail "$kind: a task with an inconsistent environment ran"; }
    grep -q "elastrun: .*PMIX_RANK=5 but SLURM_PROCID=0" "$out/t.err" || { cat "$out/t.err" >&2; fail "$kind: no error line"; }
    echo "ok: $kind plugin, inconsistent step environment: tasks not run -> $(grep -m1 'elastrun' "$out/t.err")"
  done
  use_plugin required "$SPANK_PLUGIN"
  expect_refused "MIN \(5\) is greater" salloc --elastic=5:2 echo LAUNCHED
  ;;
site)
  use_plugin required "$SPANK_PLUGIN" bogus_key=1
  rc=0
  srun -N1 -n1 --torch-env true >"$out/s.out" 2>"$out/s.err" || rc=$?
  ((rc != 0)) || fail "an unknown site argument was accepted"
  grep -q "elastrun: unknown site argument 'bogus_key'" "$out/s.err" ||
    { cat "$out/s.err" >&2; fail "the unknown site argument is not named"; }
  echo "ok: unknown site argument -> $(grep -m1 'elastrun:' "$out/s.err")"
  use_plugin required "$SPANK_PLUGIN" torch_env=yes run_id=job
  srun -N2 -n2 bash -c 'echo $RANK $TORCHELASTIC_RUN_ID $SLURM_JOB_ID' >"$out/d" 2>&1
  sort "$out/d" | awk '{ if ($1 != NR-1 || $2 != $3 ".r0") exit 1 }' || { cat "$out/d"; fail "torch_env=yes run_id=job"; }
  srun -N1 -n1 --torch-env=no bash -c 'echo "[${RANK-unset}]"' | grep -q '\[unset\]' || fail "--torch-env=no does not override torch_env=yes"
  echo "ok: site default torch_env=yes (run_id=job), overridden by --torch-env=no"
  use_plugin required "$SPANK_PLUGIN" master_addr=hostname
  [[ $(srun -N2 -n2 --torch-env bash -c 'echo $MASTER_ADDR' | sort -u) == n1 ]] || fail "master_addr=hostname"
  echo "ok: master_addr=hostname gives MASTER_ADDR=n1"
  use_plugin optional "$SPANK_PLUGIN" bogus_key=1
  srun -N1 -n1 --torch-env true 2>"$out/s.err" && fail "--torch-env worked with a bad optional plugstack line"
  grep -q "unknown site argument 'bogus_key'" "$out/s.err" || { cat "$out/s.err" >&2; fail "bad optional line: key not named"; }
  [[ $(srun -N1 -n1 echo plain 2>/dev/null) == plain ]] || fail "plain srun fails with a bad optional plugstack line"
  echo "ok: optional + unknown site argument: error names the key, --torch-env unavailable, plain srun works"
  use_plugin optional "$out/missing/spank_elastrun.so"
  [[ $(srun -N2 -n2 hostname | wc -l) == 2 ]] || fail "plain srun fails with a missing optional plugin"
  echo "ok: optional + missing plugin file: plain srun works"
  ;;
elastic)
  mkdir -p "$out/ok" "$out/ok2" "$out/env"
  TEST_WORKER_OUT_DIR=$out/ok timeout 300 srun -N3 -w 'n[1-3]' --ntasks-per-node=1 --elastic=2:3 \
    "$TEST_WORKER" a1 --nnodes 7 >"$out/ok.log" 2>&1 || fail "srun --elastic=2:3 exited $?"
  check_elastic "$out/ok" 3 1 n1 n2 n3
  [[ $(grep -c "done; exiting 0" "$out/ok.log") -eq 3 ]] || fail "not 3 agents exited 0"
  grep -q '"args":\["a1","--nnodes","7"\]' "$out/ok.log" || fail "the program's arguments did not reach the workers untouched"
  grep -q "nodes 2:3, 1 worker(s) per node" "$out/ok.log" || fail "the agents did not get --nnodes=2:3"
  grep -q "store 127.0.0.1:" "$out/ok.log" || fail "the agents do not use srun's store (SLURM_LAUNCH_NODE_IPADDR)"
  grep -q "(hosted here)" "$out/ok.log" && fail "an agent hosts the store; srun's helper should"
  wait_for 60 no_leftovers || fail "left behind after the --elastic step: $(elastic_leftovers)"
  echo "ok: srun --elastic=2:3 -N3: one agent per node, 3 workers, arguments untouched, nothing left"
  # --elastic-nproc=2 alone (implies --elastic with the step's node count), the environment form
  TEST_WORKER_OUT_DIR=$out/ok2 SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_elastic_nproc=2 timeout 300 \
    srun -N3 -w 'n[1-3]' --ntasks-per-node=1 "$TEST_WORKER" >"$out/ok2.log" 2>&1 || fail "srun (elastic_nproc=2 by environment) exited $?"
  check_elastic "$out/ok2" 6 2 n1 n2 n3
  grep -q "nodes 3:3, 2 worker(s) per node" "$out/ok2.log" || fail "the agents did not default to the step's 3 nodes"
  # --export=VAR (only VAR and SLURM_* pass, like --export=NONE): SLURM_ELASTRUN_* reach the tasks
  mkdir -p "$out/none"
  env TEST_WORKER_OUT_DIR=$out/none timeout 300 srun --export=TEST_WORKER_OUT_DIR -N2 -w 'n[1-2]' --ntasks-per-node=1 \
    --elastic "$TEST_WORKER" >"$out/none.log" 2>&1 || fail "srun --export=TEST_WORKER_OUT_DIR --elastic exited $?"
  check_elastic "$out/none" 2 1 n1 n2
  wait_for 60 no_leftovers || fail "left behind after the --elastic-nproc step: $(elastic_leftovers)"
  echo "ok: --elastic-nproc=2 (environment form): 6 workers, nodes 3:3, nothing left"
  # inside an `sbatch --torch-env` job (option inherited), --torch-env=no makes --elastic possible
  SLURM_SPANK__SLURM_SPANK_OPTION_elastrun_torch_env='(null)' timeout 300 \
    srun -N1 --elastic --torch-env=no "$TEST_WORKER" >"$out/tn.log" 2>&1 || fail "srun --elastic --torch-env=no (inherited --torch-env) exited $?"
  grep -q '"WORLD_SIZE":"1"' "$out/tn.log" || fail "--elastic --torch-env=no: no worker under the agent"
  # an agent path from the environment that is not executable: the tasks do not start
  ELASTRUN_SPANK_AGENT=$out/missing-elastrun srun -N1 --elastic true >"$out/na.out" 2>"$out/na.err" && fail "a missing agent was accepted"
  grep -q "elastrun: .*missing-elastrun" "$out/na.err" || { cat "$out/na.err" >&2; fail "no error naming the missing agent"; }
  echo "ok: missing agent -> $(grep -m1 'elastrun: ' "$out/na.err")"
  # more than one task per node: refused before launch (srun) and, if that is ignored, by the task
  expect_refused "one elastrun agent per node, but step .* has 4 tasks on 2 nodes" srun -N2 -n4 --elastic echo LAUNCHED
  use_plugin optional "$SPANK_PLUGIN" "agent=$ELASTRUN_AGENT" "tmpdir=$out/state"
  srun -N2 -n4 --elastic echo LAUNCHED >"$out/t.out" 2>"$out/t.err" || true
  grep -q LAUNCHED "$out/t.out" && { cat "$out/t.err" >&2; fail "optional plugin: tasks ran with 2 tasks per node"; }
  grep -q "elastrun: .*this node has 2 tasks of the step" "$out/t.err" || { cat "$out/t.err" >&2; fail "optional plugin: no error line for 2 tasks per node"; }
  echo "ok: optional plugin, 2 tasks per node: tasks not run -> $(grep -m1 'elastrun: .*tasks of the step' "$out/t.err")"
  use_plugin "${ELASTIC_PLUGIN[@]}"
  wait_for 60 no_leftovers || fail "left behind: $(elastic_leftovers)"
  # srun killed with SIGKILL (no exit callback): the store helper exits on its own (lifeline
  # pipe); scancel then ends the agents, and the job epilog removes the state directories.
  mkdir -p "$out/k9"
  TEST_WORKER_OUT_DIR=$out/k9 TEST_WORKER_SLEEP=300 srun -N2 --ntasks-per-node=1 --elastic \
    "$TEST_WORKER" >"$out/k9.log" 2>&1 &
  srun_pid=$!
  track_pid "$srun_pid"
  wait_for 120 have_files 2 "$out/k9/rank*.json" || fail "2 workers did not start"
  job=$(squeue -h -o %i | head -1)
  store_gone() { # no store helper of this test (its TMPDIR): other tests' agents may run meanwhile
    local p
    for p in $(pgrep -f "^$ELASTRUN_AGENT store-serve "); do
      grep -qszxF "TMPDIR=$out/tmp" "/proc/$p/environ" && return 1
    done
    return 0
  }
  store_gone && fail "no store helper while the step runs"
  stop_pid "$srun_pid"
  wait_for 15 store_gone || fail "the store helper outlived srun (kill -9)"
  scancel "$job"
  wait_for 90 no_leftovers || fail "left behind after kill -9 of srun + scancel: $(elastic_leftovers)"
  echo "ok: srun killed with SIGKILL: the store helper exited by itself; after scancel nothing is left"
  ;;
elastic_kill2) elastic_kill n2 n1 n3 ;;
elastic_kill1) elastic_kill n1 n2 n3 ;;
python)
  [[ -d ${PYTHON_PACKAGE:-} ]] || skip "the elastrun Python package is not built (PYTHON_PACKAGE)"
  ranks=$TESTS_DIR/../python/ranks.py
  export PYTHONPATH=$PYTHON_PACKAGE PYTHONDONTWRITEBYTECODE=1
  srun -N2 -n4 --torch-env "$PY" "$ranks" own_store "$out/py-own" >"$out/py-own.log" 2>&1 ||
    fail "own store: srun exited $?: $(tail -5 "$out/py-own.log")"
  [[ $(grep -c 'own store ok' "$out/py-own.log") -eq 4 ]] || fail "own store: not all 4 ranks finished"
  srun -N2 -n4 --torch-env "$PY" "$ranks" save "$out/py/ckpt" 3 >"$out/py-save.log" 2>&1 ||
    fail "save at world 4: srun exited $?: $(tail -5 "$out/py-save.log")"
  srun -N2 -n3 --torch-env "$PY" "$ranks" load "$out/py/ckpt" 3 >"$out/py-load.log" 2>&1 ||
    fail "load at world 3: srun exited $?: $(tail -5 "$out/py-load.log")"
  [[ $(grep -c 'loaded step 3 at world 3' "$out/py-load.log") -eq 3 ]] || fail "load: not all 3 ranks loaded"
  echo "ok: elastrun.checkpoint under srun --torch-env: own store (2 nodes x 2), world 4 -> 3 through the group's store"
  ;;
gpus)
  # Slurm's GPU options on a testbed with 4 GPUs per node (GRES on /dev/tty0..3, no
  # ConstrainDevices: global indices, as on clusters that do not constrain devices). Every task's
  # (or worker's) environment is read: the GPU it would use -- its CUDA_VISIBLE_DEVICES entry at
  # ELASTRUN_DEVICE -- and NCCL's defaults.
  probe='printf "{\"node\":\"%s\",\"local\":%s,\"cvd\":\"%s\",\"cvd_set\":%s,\"device\":\"%s\",\"async\":\"%s\",\"torch_async\":\"%s\"}\n" "$SLURMD_NODENAME" "${LOCAL_RANK:-$SLURM_LOCALID}" "${CUDA_VISIBLE_DEVICES-}" "$([ -n "${CUDA_VISIBLE_DEVICES+x}" ] && echo true || echo false)" "${ELASTRUN_DEVICE-}" "${NCCL_ASYNC_ERROR_HANDLING-}" "${TORCH_NCCL_ASYNC_ERROR_HANDLING-}"'
  gpu_case() {  # NAME EXPECTED_GPUS(node/local=gpu,... or "none") [ENV=V] -- srun/elastrun command...
    local name=$1 want=$2
    shift 2
    "$@" >"$out/$name.jsonl" 2>"$out/$name.err" || { cat "$out/$name.err" >&2; fail "$name: $* exited $?"; }
    "$PY" - "$out/$name.jsonl" "$want" "$name" <<'PY' || { cat "$out/$name.jsonl" "$out/$name.err" >&2; fail "$name: wrong GPU or NCCL environment"; }
import json, sys
rows = [json.loads(l[l.index("{"):]) for l in open(sys.argv[1]) if "{" in l]  # after a [rank N] prefix, if any
want, name = sys.argv[2], sys.argv[3]
got = {}
for r in rows:
    if want == "none":
        assert r["device"] == "", r  # no GPUs: no device
        continue
    device = int(r["device"])
    if r["cvd_set"]:
        visible = [v for v in r["cvd"].split(",") if v]
        assert 0 <= device < len(visible), r  # set_device(ELASTRUN_DEVICE) works in this process
        got[f'{r["node"]}/{r["local"]}'] = visible[device]
    else:
        got[f'{r["node"]}/{r["local"]}'] = str(device)  # every GPU of the node visible
if want != "none":
    expected = dict(kv.split("=") for kv in want.split(","))
    assert got == expected, (got, expected)
user = "NCCL_ASYNC_ERROR_HANDLING=0" in name
for r in rows:
    assert r["async"] == ("0" if user else "1") and r["torch_async"] == "1", r
print(f"ok: {name}: " + (" ".join(f"{k}->GPU {v}" for k, v in sorted(got.items())) or "no GPUs, no ELASTRUN_DEVICE"))
PY
  }
  te=(srun --torch-env -w n1)
  gpu_case per-task n1/0=0,n1/1=1,n1/2=2,n1/3=3 "${te[@]}" -N1 -n4 --gpus-per-task=1 sh -c "$probe"
  gpu_case per-node n1/0=0,n1/1=1,n1/2=2,n1/3=3 "${te[@]}" -N1 -n4 --gpus-per-node=4 sh -c "$probe"
  gpu_case tasks-per-gpu n1/0=0,n1/1=0,n1/2=1,n1/3=1 "${te[@]}" -N1 -n4 --ntasks-per-gpu=2 sh -c "$probe"
  gpu_case two-per-task n1/0=0,n1/1=2 "${te[@]}" -N1 -n2 --gpus-per-task=2 sh -c "$probe"
  gpu_case map-gpu n1/0=3,n1/1=2,n1/2=1,n1/3=0 "${te[@]}" -N1 -n4 --gpus=4 --gpu-bind=map_gpu:3,2,1,0 sh -c "$probe"
  gpu_case bind-none n1/0=0,n1/1=1,n1/2=2,n1/3=3 "${te[@]}" -N1 -n4 --gpus-per-task=1 --gpu-bind=none sh -c "$probe"
  gpu_case two-nodes n1/0=0,n1/1=1,n2/0=0,n2/1=1 srun --torch-env -N2 -n4 --ntasks-per-node=2 --gpus-per-task=1 sh -c "$probe"
  gpu_case no-gpus none "${te[@]}" -N1 -n2 sh -c "$probe"
  gpu_case NCCL_ASYNC_ERROR_HANDLING=0 n1/0=0,n1/1=1 env NCCL_ASYNC_ERROR_HANDLING=0 "${te[@]}" -N1 -n2 --gpus-per-task=1 sh -c "$probe"
  # the agent: --nproc-per-node=gpu counts the step's GPUs; --gpus-per-worker narrows each worker's list
  # (its job directory, kept after the job by design, goes to a TMPDIR of its own)
  mkdir -p "$out/agent-tmp"
  gpu_case agent-gpu n1/0=0,n1/1=1,n1/2=2,n1/3=3,n2/0=0,n2/1=1,n2/2=2,n2/3=3 env TMPDIR="$out/agent-tmp" srun -N2 --ntasks-per-node=1 --gpus-per-node=4 \
    "$ELASTRUN_AGENT" --nproc-per-node=gpu sh -c "$probe"
  gpu_case agent-two-per-worker n1/0=0,n1/1=2 env TMPDIR="$out/agent-tmp" srun -w n1 -N1 --gpus-per-node=4 \
    "$ELASTRUN_AGENT" --nproc-per-node=gpu --gpus-per-worker=2 sh -c "$probe"
  ;;
*) fail "unknown case $CASE" ;;
esac
