#!/usr/bin/env bash
# SPANK plugin on a private 2-node testbed (it rewrites plugstack.conf.d, so it never touches the
# shared cluster): usage: test_spank.sh CASE
#   help        srun --help lists --torch-env, --elastic, --elastic-nproc
#   ranks       srun -N2 -n4 --torch-env: consistent values; also --mpi=pmix, the SLURM_SPANK_*
#               environment form, --export=NONE, and stale RANK/MASTER_* from the submit shell
#   gloo        torch gloo all_reduce over env:// with 2 nodes x 2 tasks and only --torch-env
#   het         srun A : B and salloc A : B + srun --het-group=0,1: global ranks, one master
#   batch       sbatch/salloc --torch-env: every srun of the job gets it, the batch script does not
#   concurrent  two overlapping steps of one job get different MASTER_PORTs
#   errors      --elastic=5:2 / x / 2:4, --elastic-nproc=0, --torch-env=maybe fail before launch
#   site        plugstack.conf arguments: unknown key fails naming it; torch_env=yes default;
#               master_addr=hostname; optional + missing file: plain srun still works
# Every case ends by checking that no elastrun process, file or socket is left behind.
# Environment: ELASTRUN_TESTBED, TESTBED_ID (shared id; this test uses <id>-spank),
# SPANK_PLUGIN (the built spank_elastrun.so), TESTS_DIR (this directory).
set -euo pipefail
CASE=${1:?usage: test_spank.sh CASE}
TB=$ELASTRUN_TESTBED
export TESTBED_ID="${TESTBED_ID}-spank"
PY=/usr/bin/python3
out=$(mktemp -d /tmp/spank-test.XXXXXX)
stamp=$out/stamp
touch "$stamp"

leftovers() { # what the plugin could leave behind: processes with it loaded, files, sockets
  # (other components' /tmp/elastrun-* files are not ours; the plugin itself creates none)
  local p
  for p in /proc/[0-9]*; do
    grep -qs spank_elastrun "$p/maps" && echo "process ${p#/proc/} maps spank_elastrun.so: $(tr '\0' ' ' <"$p/cmdline" 2>/dev/null)"
  done
  find /tmp /dev/shm /run -xdev -maxdepth 2 -newer "$stamp" \( -iname '*spank*' -o -iname '*torch-env*' \) \
    ! -path "$out" ! -path "$out/*" 2>/dev/null | sed 's/^/file /'
  ss -xap 2>/dev/null | grep -i spank | sed 's/^/socket /' || true
}

cleanup() {
  local rc=$?
  "$TB" down >/dev/null 2>&1 || rc=1
  local left
  left=$(leftovers)
  if [[ -n $left ]]; then
    echo "FAIL: left behind after the test:" >&2
    echo "$left" >&2
    rc=1
  fi
  rm -rf "$out"
  exit "$rc"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$TB" down >/dev/null 2>&1 || true
"$TB" up 2
eval "$("$TB" env)"
DIR=$("$TB" dir)
use_plugin() { printf '%s\n' "$*" >"$DIR/plugstack.conf.d/elastrun.conf"; }
use_plugin required "$SPANK_PLUGIN"

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
  ;;
het)
  check_step 3 2 127.0.0.1 -- srun --torch-env -N1 -n1 : -N1 -n2 "$PY" "$TASK"
  check_step 3 2 127.0.0.1 -- salloc -Q -N1 -n1 : -N1 -n2 \
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
  echo "ok: sbatch/salloc --torch-env apply to the job's srun steps, not to the batch script"
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
  expect_refused "not available in this build yet" srun -N1 -n1 --elastic=2:4 echo LAUNCHED
  expect_refused "not available in this build yet" srun -N1 -n1 --elastic echo LAUNCHED
  expect_refused "--elastic-nproc='0'" srun -N1 -n1 --elastic-nproc=0 echo LAUNCHED
  expect_refused "not available in this build yet" srun -N1 -n1 --elastic-nproc=2 echo LAUNCHED
  expect_refused "--torch-env='maybe'" srun -N1 -n1 --torch-env=maybe echo LAUNCHED
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
*) fail "unknown case $CASE" ;;
esac
