# shellcheck shell=bash
# tests/support/lib.sh: what the bash tests share. Source it right after `set -euo pipefail` (or the
# script's own options; nothing here needs -e, and everything here is safe under -e, -u and pipefail):
#
#   source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
#
# Sourcing it sets one EXIT trap (do not set another: register with on_exit / on_failure instead).
# At exit, in this order:
#   1. every PID given to track_pid that still runs gets its signal (default KILL) and is waited for
#      (the last tracked first);
#   2. if the script failed (exit status neither 0 nor 77, the skip code): the files given to
#      show_on_failure are printed to stderr ("--- FILE" and its last lines), and the on_failure
#      hooks run, in registration order;
#   3. the on_exit hooks run, in registration order (the private testbed's `down` is one);
#   4. the sandbox directory is removed;
#   5. the script exits with EXIT_RC: its own exit status, unless a hook set EXIT_RC=1.
# Hooks are shell code, evaluated at exit (so they see variables as they are then), with errexit off;
# they must not call fail or exit (that would skip the rest): they report on stderr and set
# EXIT_RC=1 instead.
#
# Functions (each is described where it is defined):
#   failing      fail MSG..., skip MSG...
#   at exit      on_exit CODE, on_failure CODE, show_on_failure LINES FILE_OR_GLOB...
#   processes    track_pid [-s SIGNAL] PID..., untrack_pid PID..., await PID, stop_pid PID...,
#                exited PID..., alive_pids PID..., kill_recorded_pids DIR ERE,
#                alive_recorded_pids DIR ERE
#   cases        test_expect_success WHAT <<'CASE' ... CASE, test_done (one file per concern)
#   files        sandbox [--tmpdir] [TEMPLATE] (sets SANDBOX), worker_sandbox ERE
#   waiting      wait_for [-i INTERVAL] [-a PID MESSAGE] SECONDS CMD..., have_files N GLOB,
#                have_lines N PATTERN FILE...
#   testbed      TB, private_testbed [OPTIONS] [SUFFIX], testbed_up N [--shared-fs],
#                private_testbed_up [OPTIONS] N [SUFFIX], remember_shared_testbed, check_shared_testbed,
#                require_shared_fs [--machine]
#   environment  unset_env ERE [KEEP...], free_port, free_port_pair, json FILE EXPR
#   checkpoints  same_model TOOL REF RUN LOG STEP (sets MAX_DELTA)

[[ -n ${_ELASTRUN_TEST_LIB:-} ]] && return 0
_ELASTRUN_TEST_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# ---- failing --------------------------------------------------------------------------------------

# Prefix of fail's messages: "FAIL[$FAIL_TAG]: ..." when set (e.g. to the test's case), else "FAIL: ...".
FAIL_TAG=${FAIL_TAG:-}

# fail MSG...: prints "FAIL: MSG" on stderr and exits 1; the exit trap then dumps the logs registered
# with show_on_failure and runs the on_failure hooks.
fail() {
  printf 'FAIL%s: %s\n' "${FAIL_TAG:+[$FAIL_TAG]}" "$*" >&2
  exit 1
}

# skip MSG...: prints "skip: MSG" and exits 77, which the ctest entries declare as SKIP_RETURN_CODE.
skip() {
  echo "skip: $*"
  exit 77
}

# ---- cases (sharness style) ----------------------------------------------------------------------

# test_expect_success 'WHAT' <<'CASE' ... CASE: one case of a test file, named by what it checks.
# The body (stdin, quoted heredoc: written as in a script) runs in this shell after test_setup (if
# the file defines one), with FAIL_TAG=WHAT so that a `fail` names the case; it passes when it
# returns 0 ("ok N - WHAT"). The first failing case ends the file, cleaned up as any failed test.
# TEST_ONLY=WORDS runs only the cases whose WHAT contains WORDS.
TEST_COUNT=0
test_expect_success() {
  local what=$1 body rc
  body=$(cat)
  [[ -z ${TEST_ONLY:-} || $what == *"$TEST_ONLY"* ]] || return 0
  TEST_COUNT=$((TEST_COUNT + 1))
  FAIL_TAG=$what
  if [[ $(type -t test_setup) == function ]]; then test_setup; fi
  eval "$body"
  rc=$?
  ((rc == 0)) || fail "the case ended with status $rc"
  FAIL_TAG=
  echo "ok $TEST_COUNT - $what"
}

# test_done: the end of a file of cases: "# passed all N case(s)", exit 0.
test_done() {
  echo "# passed all $TEST_COUNT case(s)${TEST_ONLY:+ matching '$TEST_ONLY'}"
  exit 0
}

# ---- at exit --------------------------------------------------------------------------------------

EXIT_RC=0
_LIB_MAIN_PID=$BASHPID
_LIB_PIDS=()          # "PID SIGNAL", see track_pid
_LIB_ON_FAILURE=()
_LIB_ON_EXIT=()
SANDBOX=

# on_exit CODE: evaluate CODE when the script exits (after the on_failure hooks).
on_exit() { _LIB_ON_EXIT+=("$1"); }

# on_failure CODE: evaluate CODE when the script fails (exits neither 0 nor 77), before on_exit hooks.
on_failure() { _LIB_ON_FAILURE+=("$1"); }

# show_on_failure LINES FILE_OR_GLOB...: when the script fails, print "--- FILE" and the last LINES
# lines (LINES "all": the whole file) of every existing file matching each pattern (expanded at exit),
# on stderr.
show_on_failure() {
  local lines=$1 pattern
  shift
  for pattern in "$@"; do
    on_failure "_lib_show $lines $(printf '%q' "$pattern")"
  done
}

_lib_show() {
  local lines=$1 f
  while IFS= read -r f; do
    [[ -e $f ]] || continue
    echo "--- $f" >&2
    if [[ $lines == all ]]; then cat "$f" >&2; else tail -n "$lines" "$f" >&2; fi
  done < <(compgen -G "$2" || true)
}

_lib_exit() {
  EXIT_RC=$?
  # only the script's own shell cleans up (never a subshell that happens to run this trap)
  [[ $BASHPID == "$_LIB_MAIN_PID" ]] || return 0
  set +e
  local i entry
  for ((i = ${#_LIB_PIDS[@]} - 1; i >= 0; i--)); do
    entry=${_LIB_PIDS[i]}
    _lib_stop "${entry% *}" "${entry#* }"
  done
  _LIB_PIDS=()
  if _lib_failed; then
    for entry in "${_LIB_ON_FAILURE[@]}"; do eval "$entry" || true; done
  fi
  for entry in "${_LIB_ON_EXIT[@]}"; do eval "$entry" || true; done
  if [[ -n $SANDBOX ]]; then
    # ELASTRUN_TEST_KEEP_SANDBOX=1: a failed test leaves its files (logs, checkpoints) for a post-mortem
    if _lib_failed && [[ -n ${ELASTRUN_TEST_KEEP_SANDBOX:-} ]]; then
      echo "kept the sandbox of the failed test: $SANDBOX" >&2
    else
      rm -rf "$SANDBOX"
    fi
  fi
  exit "$EXIT_RC"
}
trap _lib_exit EXIT

_lib_failed() { ((EXIT_RC != 0 && EXIT_RC != 77)); } # at exit: the test failed (77: skipped)

# ---- processes ------------------------------------------------------------------------------------

# track_pid [-s SIGNAL] PID...: at exit, each PID that still runs gets SIGNAL (default KILL), and is
# waited for. Forget a PID (untrack_pid, await, stop_pid) once it has been waited for: its number may
# be reused.
track_pid() {
  local sig=KILL p
  if [[ $1 == -s ]]; then sig=$2; shift 2; fi
  for p in "$@"; do _LIB_PIDS+=("$p $sig"); done
  return 0
}

# untrack_pid PID...: forget PIDs given to track_pid.
untrack_pid() {
  local keep=() entry p drop
  for entry in "${_LIB_PIDS[@]}"; do
    drop=
    for p in "$@"; do [[ ${entry% *} == "$p" ]] && drop=1; done
    [[ -n $drop ]] || keep+=("$entry")
  done
  _LIB_PIDS=("${keep[@]}")
}

# await PID: wait for the background job PID and forget it; returns its exit status.
await() {
  local rc=0
  wait "$1" || rc=$?
  untrack_pid "$1"
  return "$rc"
}

# stop_pid PID...: SIGKILL each PID that still runs, wait for it, forget it. Always succeeds.
stop_pid() {
  local p
  for p in "$@"; do
    [[ -n $p ]] || continue
    _lib_stop "$p" KILL
    untrack_pid "$p"
  done
}

_lib_stop() { # PID SIGNAL
  if kill -0 "$1" 2>/dev/null; then kill -"$2" "$1" 2>/dev/null || true; fi
  wait "$1" 2>/dev/null || true
}

# exited PID...: true when none of the PIDs runs any more (a child of this shell counts as exited once
# bash has reaped it, which it does as soon as it ends).
exited() {
  local p
  for p in "$@"; do
    if kill -0 "$p" 2>/dev/null; then return 1; fi
  done
  return 0
}

# alive_pids PID...: prints (one per line) those PIDs that exist and are not zombies.
alive_pids() {
  local p st
  for p in "$@"; do
    # the state is the field after "(comm)", and comm may contain spaces and parentheses
    st=$(awk '{ s = $0; sub(/^.*\) /, "", s); split(s, f, " "); print f[1] }' "/proc/$p/stat" 2>/dev/null) ||
      continue
    [[ -z $st || $st == Z ]] || echo "$p"
  done
  return 0
}

# Processes that record themselves as files named by their PID in DIR (the launcher's test worker
# writes DIR=$TEST_WORKER_OUT_DIR/pids/<pid>); ERE is matched against the command line, so that a
# PID reused by an unrelated process is never touched.
# alive_recorded_pids DIR ERE: prints the recorded PIDs that still run that command (not zombies).
alive_recorded_pids() {
  local p
  for p in $(_lib_recorded "$1" "$2"); do
    [[ -z $(alive_pids "$p") ]] || echo "$p"
  done
  return 0
}

# kill_recorded_pids DIR ERE: SIGKILL every recorded PID that still runs that command.
kill_recorded_pids() {
  local p
  for p in $(_lib_recorded "$1" "$2"); do kill -KILL "$p" 2>/dev/null || true; done
  return 0
}

_lib_recorded() { # DIR ERE: recorded PIDs whose command line matches ERE
  local f p
  for f in "$1"/*; do
    [[ -e $f ]] || continue
    p=${f##*/}
    if [[ -r /proc/$p/cmdline ]] && tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -qE -- "$2"; then
      echo "$p"
    fi
  done
  return 0
}

# ---- files ----------------------------------------------------------------------------------------

# sandbox [--tmpdir] [TEMPLATE]: creates the test's private directory (mktemp -d [TEMPLATE], mode
# 755 so that Slurm tasks may write into it) with an empty tmp/ inside, sets SANDBOX to it and
# removes it at exit (kept when the test fails and ELASTRUN_TEST_KEEP_SANDBOX is set). --tmpdir also exports TMPDIR=$SANDBOX/tmp, so that what the agents and other
# programs keep in TMPDIR (srun passes it on to the tasks) goes with the sandbox.
sandbox() {
  local tmpdir=
  if [[ ${1:-} == --tmpdir ]]; then tmpdir=1; shift; fi
  SANDBOX=$(mktemp -d "$@")
  chmod 755 "$SANDBOX"
  mkdir -p "$SANDBOX/tmp"
  if [[ -n $tmpdir ]]; then export TMPDIR=$SANDBOX/tmp; fi
  # the agents' job directories and their per-user index stay in the sandbox (a test's Slurm job
  # ids restart at 1 on every testbed; ~/.elastrun is the user's)
  export ELASTRUN_JOB_DIR=$SANDBOX/jobs/%j ELASTRUN_INDEX_DIR=$SANDBOX/index
  return 0
}

# worker_sandbox ERE: sandbox --tmpdir for the agent's tests with launcher_test_worker (no Slurm): the
# workers write their environment into TEST_WORKER_OUT_DIR=$SANDBOX/out (exported) and record their
# PIDs in out/pids; at exit, each recorded PID that still runs a command matching ERE is killed.
worker_sandbox() {
  sandbox --tmpdir
  mkdir -p "$SANDBOX/out"
  export TEST_WORKER_OUT_DIR=$SANDBOX/out
  on_exit "kill_recorded_pids $(printf '%q' "$SANDBOX/out/pids") $(printf '%q' "$1")"
}

# ---- waiting --------------------------------------------------------------------------------------

# wait_for [-i INTERVAL] [-a PID MESSAGE] SECONDS CMD...: runs CMD every INTERVAL seconds (default
# 0.5) until it succeeds (returns 0) or SECONDS have passed (returns 1). With -a: fails with MESSAGE
# as soon as PID no longer runs.
wait_for() {
  local interval=0.5 pid='' message='' deadline
  while :; do
    case $1 in
    -i) interval=$2; shift 2 ;;
    -a) pid=$2 message=$3; shift 3 ;;
    *) break ;;
    esac
  done
  deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    if [[ -n $pid ]] && ! kill -0 "$pid" 2>/dev/null; then fail "$message"; fi
    sleep "$interval"
  done
}

# have_files N GLOB: true when at least N files match GLOB.
have_files() { (($(compgen -G "$2" | wc -l) >= $1)); }

# have_lines N PATTERN FILE...: true when at least N lines of the FILEs together match the grep
# (basic) regular expression PATTERN; missing files count as empty.
have_lines() {
  local n=$1 pattern=$2
  shift 2
  (($(cat -- "$@" 2>/dev/null | grep -c -- "$pattern") >= n))
}

# ---- the Slurm testbed (tests/cluster/testbed) ----------------------------------------------------

# TB: the testbed script (ELASTRUN_TESTBED as ctest sets it, else the one in this tree).
TB=${ELASTRUN_TESTBED:-$_ELASTRUN_TEST_LIB/../cluster/testbed}

# private_testbed [--given-id] [--keep-on-failure] [SUFFIX]: the test runs a testbed of its own (it
# kills nodes or changes the cluster's configuration), never the shared one of the ctest fixture.
# Exports TESTBED_ID=<shared TESTBED_ID>-SUFFIX (SUFFIX: by default the script's name without
# "test_", "_slurm" and ".sh", e.g. test_scaleup_slurm.sh -> scaleup) and runs `testbed down` at exit
# (a failed `down` fails the test). --given-id: TESTBED_ID (from ctest) already names the private
# testbed; it must be set and differ from ELASTRUN_SHARED_TESTBED_ID. --keep-on-failure: when the
# test fails, print `testbed status` and keep the state dir (logs) with TESTBED_KEEP=1.
private_testbed() {
  local given='' suffix
  _LIB_TESTBED_KEEP=
  while :; do
    case ${1:-} in
    --given-id) given=1; shift ;;
    --keep-on-failure) _LIB_TESTBED_KEEP=1; shift ;;
    *) break ;;
    esac
  done
  if [[ -n $given ]]; then
    [[ -n ${TESTBED_ID:-} && ${TESTBED_ID} != "${ELASTRUN_SHARED_TESTBED_ID:-}" ]] ||
      fail "set TESTBED_ID to a private id (not the shared testbed's)"
  else
    suffix=${1:-$(basename "$0" .sh)}
    suffix=${suffix#test_}
    suffix=${suffix%_slurm}
    export TESTBED_ID="${TESTBED_ID}-$suffix"
  fi
  on_exit _lib_testbed_down
}

_lib_testbed_down() {
  if _lib_failed && [[ -n $_LIB_TESTBED_KEEP ]]; then
    "$TB" status >&2 || true
    TESTBED_KEEP=1 "$TB" down || true # keep the logs of a failed run
  else
    "$TB" down >/dev/null || EXIT_RC=1
  fi
}

# testbed_up N [--shared-fs]: `testbed up N` (TESTBED_ID chosen by private_testbed), after a `down`
# that removes the leftovers of an aborted earlier run.
testbed_up() {
  "$TB" down >/dev/null 2>&1 || true
  "$TB" up "$@"
}

# private_testbed_up [--given-id] [--keep-on-failure] [--shared-fs] N [SUFFIX]: private_testbed,
# testbed_up N, and the testbed's environment (SLURM_CONF, TESTBED_ID, TESTBED_SHARED_FS) exported,
# so that srun, sbatch, sinfo... use it. --shared-fs: with a GlusterFS volume every node mounts
# (require_shared_fs decides first whether the test can run).
private_testbed_up() {
  local opts=() up_opts=()
  while [[ ${1:-} == --* ]]; do
    if [[ $1 == --shared-fs ]]; then
      require_shared_fs --machine
      up_opts+=("$1")
    else
      opts+=("$1")
    fi
    shift
  done
  local n=$1
  shift
  private_testbed "${opts[@]}" "$@"
  testbed_up "$n" "${up_opts[@]}"
  eval "$("$TB" env)"
}

# require_shared_fs [--machine]: the test needs a testbed with a shared filesystem (testbed up
# --shared-fs): the testbed in use (SLURM_CONF's) must have one (TESTBED_SHARED_FS is exported
# then); --machine: only that this machine can provide one. Otherwise the test is skipped with the
# reason -- but under CI (CI=true) that fails it, so that CI cannot pass without these tests.
require_shared_fs() {
  local why
  if why=$("$TB" check-shared-fs 2>&1); then
    [[ ${1:-} == --machine ]] && return 0
    eval "$("$TB" env 2>/dev/null)"
    [[ -n ${TESTBED_SHARED_FS:-} ]] && return 0
    why="testbed $TESTBED_ID runs without --shared-fs"
  fi
  [[ ${CI:-} == true ]] && fail "needs a shared filesystem (CI=true: a missing prerequisite fails): $why"
  skip "needs a shared filesystem: $why"
}

# remember_shared_testbed / check_shared_testbed: a test of a private testbed makes sure that the
# shared one (ELASTRUN_SHARED_TESTBED_ID, when set) keeps its daemons (the same PIDs) throughout.
remember_shared_testbed() {
  _LIB_SHARED_BEFORE=
  if [[ -n ${ELASTRUN_SHARED_TESTBED_ID:-} ]]; then _LIB_SHARED_BEFORE=$(_lib_shared_pids); fi
  return 0
}

check_shared_testbed() {
  if [[ -n ${_LIB_SHARED_BEFORE:-} ]]; then
    [[ $(_lib_shared_pids) == "$_LIB_SHARED_BEFORE" ]] || fail "shared testbed $ELASTRUN_SHARED_TESTBED_ID" \
      "changed: before '$_LIB_SHARED_BEFORE' after '$(_lib_shared_pids)'"
  fi
  return 0
}

_lib_shared_pids() { # the shared testbed's daemons, from `testbed status`
  TESTBED_ID=$ELASTRUN_SHARED_TESTBED_ID "$TB" status 2>/dev/null | awk '$1 ~ /^(ctld|munged|slurmd)$/'
}

# ---- environment ----------------------------------------------------------------------------------

# unset_env ERE [KEEP...]: unsets every exported variable whose name matches the extended regular
# expression (e.g. '^(SLURM_|PET_|RANK$)'), except those named KEEP, so that the caller's job or
# launcher does not leak into the test.
unset_env() {
  local v k keep
  for v in $(compgen -e | grep -E -- "$1"); do
    keep=
    for k in "${@:2}"; do if [[ $v == "$k" ]]; then keep=1; fi; done
    [[ -n $keep ]] || unset "$v"
  done
  return 0
}

# free_port: prints a TCP port on 127.0.0.1 that is free now.
free_port() {
  /usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# free_port_pair: a port P with P+1 free too (torchrun's static form: the agents' store goes on
# --master-port + 1).
free_port_pair() {
  /usr/bin/python3 -c '
import socket
for _ in range(100):
    a, b = socket.socket(), socket.socket()
    a.bind(("127.0.0.1", 0))
    p = a.getsockname()[1]
    try:
        b.bind(("127.0.0.1", p + 1))
    except OSError:
        continue
    print(p)
    break'
}

# json FILE EXPR: prints the Python expression EXPR evaluated on the JSON object `d` read from FILE.
json() {
  /usr/bin/python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}

# ---- checkpoints ----------------------------------------------------------------------------------

# same_model TOOL REF RUN LOG STEP: `TOOL diff REF RUN` (elastrun-ckpt) into LOG must exit 0 and
# compare REF's step STEP; sets MAX_DELTA to the "max |Δ| = X" it reports (for the test's ok line).
# Call it directly, not in $(...): its fail must end the test, not a subshell.
same_model() {
  local tool=$1 ref=$2 run=$3 log=$4 step=$5 rc=0
  "$tool" diff "$ref" "$run" >"$log" 2>&1 || rc=$?
  ((rc == 0)) || fail "diff $ref $run exited $rc: $(cat "$log")"
  grep -q "^a: .* (step $step, world size " "$log" || fail "diff $ref $run did not compare step $step: $(cat "$log")"
  MAX_DELTA=$(sed -n 's/^\(max |Δ| = [^ ]*\) over .*/\1/p' "$log")
}
