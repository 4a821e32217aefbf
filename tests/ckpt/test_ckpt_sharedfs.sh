#!/usr/bin/env bash
# Checkpoints on the testbed's shared filesystem (GlusterFS, each node its own FUSE mount), both
# layouts (file-per-rank and the MPI-IO shared file), with sharedfs_fixture under srun --mpi=pmix:
#   1. 4 ranks on n1..n4 save steps 1-4 with keep_last 2; after each commit rank 3 (n4) sees at
#      once, through its own mount, `latest` naming the step rank 0 (n1) just committed, and
#      verifies every shard's hash;
#   2. retention and the background deletion: another node and the login node see exactly
#      step 3, step 4 and latest (nothing retired, nothing partial);
#   3. 3 ranks on n2..n4 restore step 4 into a sharding of their own, bit-exact;
#   4. SIGKILL during a save: rank 0 dies at the commit point of step 5 (every shard written and
#      voted); no step 5 appears, and 3 ranks on n1..n3 restore step 4 bit-exact;
#   5. the next save of step 5 clears the partial directory and commits; restore on n2..n4 gets it;
#   6. what the library must do on such a filesystem, checked rather than assumed: a save traced
#      with strace on rank 0 (n1) and rank 2 (n3) fsyncs each rank's own file in the temporary
#      directory, and rank 0 the index and that directory before renaming it into place, then the
#      root after each rename (the step, latest); and (file-per-rank) readers take no HDF5 file
#      lock: a restore succeeds while another node holds an exclusive flock on the index -- the
#      same restore with HDF5_USE_FILE_LOCKING=TRUE, the control, must fail.
# Usage: test_ckpt_sharedfs.sh FIXTURE (build/bin/sharedfs_fixture); the shared testbed's
# environment (ELASTRUN_TESTBED_ENV). Skips (77) without a shared filesystem, fails under CI=true.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
fixture=${1:?usage: test_ckpt_sharedfs.sh FIXTURE}
require_shared_fs
sandbox
root=$TESTBED_SHARED_FS/ckpt-sharedfs-$$-$RANDOM
mkdir "$root"
on_exit 'rm -rf "$root"'
echo "checkpoints under $root (GlusterFS, a mount per node)"

# (Open MPI: the testbed's nodes share one hostname, so shared-memory transport would be used
# between "nodes" and crash; TCP is what separate nodes use anyway.)
export OMPI_MCA_btl=self,tcp
# run_step NODELIST LOGNAME FIXTURE-ARGS...: the fixture, one rank per node; with --wrapped
# NODELIST LOGNAME CMD...: CMD instead (which runs the fixture)
run_step() {
  local cmd=("$fixture")
  [[ $1 == --wrapped ]] && cmd=() && shift
  local nodes=$1 log=$SANDBOX/$2.log
  shift 2
  local n
  n=$(awk -F, '{print NF}' <<<"$nodes")
  timeout 300 srun --oversubscribe --mpi=pmix --kill-on-bad-exit=1 -N"$n" -n"$n" -w "$nodes" "${cmd[@]}" "$@" >"$log" 2>&1
}
show() { sed 's/^/    /' "$SANDBOX/$1.log"; }
# the fixture's own error lines from a step's log (else its last lines), on one line
why() {
  local log=$SANDBOX/$1.log
  { grep -E '^\[rank [0-9]+\] .*error: ' "$log" || tail -n 3 "$log"; } | head -n 4 | tr '\n' ' '
}
show_on_failure 40 "$SANDBOX/*.log"

listing() { ls -A "$1" | tr '\n' ' '; }

for layout in file_per_rank shared_file; do
  FAIL_TAG=$layout
  dir=$root/$layout
  mkdir "$dir"
  echo "== $layout"
  # 1.
  run_step n1,n2,n3,n4 "$layout-save" save "$dir" 1 4 "$layout" --keep-last 2 ||
    fail "save of steps 1-4 on n1..n4 failed: $(why $layout-save)"
  [[ $(grep -c 'sees latest -> .* at once, every shard verified' "$SANDBOX/$layout-save.log") == 4 ]] ||
    fail "rank 3 did not confirm latest after each of the 4 commits"
  grep -q '^\[rank 3\] n4: sees latest' "$SANDBOX/$layout-save.log" || fail "rank 3 did not run on n4"
  show "$layout-save" | grep 'rank 3'
  # 2.
  want="latest step-000000003 step-000000004 "
  [[ $(listing "$dir") == "$want" ]] || fail "the login node sees '$(listing "$dir")' after keep_last 2, expected '$want'"
  seen=$(timeout 120 srun -N1 -n1 -w n3 ls -A "$dir" | tr '\n' ' ')
  [[ $seen == "$want" ]] || fail "n3 sees '$seen' after keep_last 2, expected '$want'"
  # 3.
  run_step n2,n3,n4 "$layout-restore4" restore "$dir" 4 ||
    fail "restore of step 4 on n2..n4 failed: $(why $layout-restore4)"
  [[ $(grep -c 'restored step 4 at world 3: .* bit-exact' "$SANDBOX/$layout-restore4.log") == 3 ]] ||
    fail "not every rank restored step 4 bit-exact"
  show "$layout-restore4"
  # 4.
  if run_step n1,n2,n3,n4 "$layout-crash" save "$dir" 5 5 "$layout" --keep-last 2 --crash-before-publish; then
    fail "the save that SIGKILLs rank 0 succeeded"
  fi
  grep -q '^\[rank 0\] n1: SIGKILL at the commit point of step 5' "$SANDBOX/$layout-crash.log" ||
    fail "rank 0 never reached the commit point of step 5: $(why $layout-crash)"
  [[ ! -e $dir/step-000000005 && $(readlink "$dir/latest") == step-000000004 ]] ||
    fail "after the killed save: $(listing "$dir") (latest -> $(readlink "$dir/latest"))"
  echo "  after SIGKILL at the commit point: $(listing "$dir")"
  run_step n1,n2,n3 "$layout-restore-after-crash" restore "$dir" 4 ||
    fail "restore after the killed save failed: $(why $layout-restore-after-crash)"
  [[ $(grep -c 'restored step 4 at world 3: .* bit-exact' "$SANDBOX/$layout-restore-after-crash.log") == 3 ]] ||
    fail "not every rank restored step 4 bit-exact after the killed save"
  # 5.
  run_step n1,n2,n3,n4 "$layout-save5" save "$dir" 5 5 "$layout" --keep-last 2 ||
    fail "the save after the crash failed: $(why $layout-save5)"
  want="latest step-000000004 step-000000005 "
  [[ $(listing "$dir") == "$want" ]] || fail "after the new save of step 5: '$(listing "$dir")', expected '$want'"
  run_step n2,n3,n4 "$layout-restore5" restore "$dir" 5 ||
    fail "restore of step 5 failed: $(why $layout-restore5)"
  [[ $(grep -c 'restored step 5 at world 3: .* bit-exact' "$SANDBOX/$layout-restore5.log") == 3 ]] ||
    fail "not every rank restored step 5 bit-exact"
  # 6.
  trace_dir=$root/$layout-traced
  mkdir "$trace_dir"
  # shellcheck disable=SC2016 # expanded by the task
  run_step --wrapped n1,n2,n3,n4 "$layout-traced" bash -c 'if [[ $SLURM_PROCID == [02] ]]; then
      exec strace -f -y -qq -e trace=fsync,fdatasync,rename,renameat,renameat2 -o "$0.$SLURM_PROCID" "$@"
    else exec "$@"; fi' "$SANDBOX/$layout.strace" "$fixture" save "$trace_dir" 1 1 "$layout" ||
    fail "the traced save failed: $(why $layout-traced)"
  /usr/bin/python3 - "$SANDBOX/$layout.strace" "$trace_dir" "$layout" <<'PY' || fail "the save's fsync/rename order is wrong (above)"
import re, sys
prefix, root, layout = sys.argv[1], sys.argv[2], sys.argv[3]
def calls(rank):
    out = []
    for line in open(f"{prefix}.{rank}"):
        m = re.match(r"\d+\s+(\w+)\((.*)\) += (-?\d+)", line)
        if m:
            assert m.group(3) == "0", f"rank {rank}: failed call: {line.strip()}"
            name, args = m.group(1), m.group(2)
            if name.startswith("f"):
                out.append(("fsync", re.match(r"\d+<(.*)>$", args).group(1)))
            else:
                paths = re.findall(r'"([^"]*)"', args)
                out.append(("rename", paths[0], paths[1]))
    return out
def index_of(seq, pred, what):
    for i, c in enumerate(seq):
        if pred(c):
            return i
    raise AssertionError(f"{what}: not found in {seq}")
for rank in (0, 2):
    own = "data.h5" if layout == "shared_file" else f"shard-{rank:05d}-of-00004.h5"
    seq = calls(rank)
    index_of(seq, lambda c: c[0] == "fsync" and re.fullmatch(re.escape(root) + r"/step-000000001\.tmp-[0-9a-f]+/" + own, c[1]),
             f"rank {rank}: fsync of its {own} in the temporary directory")
seq = calls(0)
tmp = index_of(seq, lambda c: c[0] == "rename" and c[2] == f"{root}/step-000000001", "rank 0: rename of the step into place")
tmpdir = seq[tmp][1]
order = [
    index_of(seq, lambda c: c == ("fsync", f"{tmpdir}/{'data.h5' if layout == 'shared_file' else 'shard-00000-of-00004.h5'}"), "fsync of rank 0's file"),
    index_of(seq, lambda c: c == ("fsync", f"{tmpdir}/index.h5"), "fsync of index.h5"),
    index_of(seq, lambda c: c == ("fsync", tmpdir), "fsync of the temporary directory"),
    tmp,
    index_of(seq[tmp:], lambda c: c == ("fsync", root), "fsync of the root after the rename") + tmp,
]
assert order == sorted(order), f"rank 0 calls out of order: {[seq[i] for i in order]}"
latest = index_of(seq, lambda c: c[0] == "rename" and c[2] == f"{root}/latest", "rank 0: rename of latest")
assert ("fsync", root) in seq[latest + 1:], "no fsync of the root after latest was replaced"
print(f"  {layout}: traced fsyncs and renames in order on ranks 0 and 2")
PY
  if [[ $layout == file_per_rank ]]; then
    index=$dir/step-000000005/index.h5
    timeout 120 srun -N1 -n1 -w n1 flock -x "$index" sleep 60 &
    locker=$!
    track_pid "$locker"
    holds_lock() { ! flock -n -s "$index" true; } # (through the login node's mount)
    wait_for -a "$locker" "the flock holder on n1 exited" 60 holds_lock || fail "n1 did not get its flock of $index"
    run_step n2,n3,n4 "$layout-restore-locked" restore "$dir" 5 ||
      fail "restore while n1 holds a flock on the index failed: $(why $layout-restore-locked)"
    if HDF5_USE_FILE_LOCKING=TRUE run_step n2,n3,n4 "$layout-restore-locking-control" restore "$dir" 5; then
      fail "control: a restore with HDF5 file locking on succeeded although n1 holds a flock on the index"
    fi
    kill -TERM "$locker" 2>/dev/null || true # srun ends its step (and the lock) on SIGTERM
    wait "$locker" 2>/dev/null || true
    untrack_pid "$locker"
    echo "  readers take no HDF5 file lock: restore ok while n1 holds a flock on index.h5 (with locking on: fails)"
  fi
  echo "ok: $layout: saved on n1..n4, latest seen at once from n4, retention seen from n3 and the login node," \
    "restored at world 3 on other node sets, a SIGKILL at the commit point changed nothing"
done
echo "PASS: checkpoints across the nodes' own mounts of the shared filesystem"
