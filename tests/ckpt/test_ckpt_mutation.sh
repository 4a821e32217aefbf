#!/usr/bin/env bash
# ckpt.mutation: damage of every kind (bytes, truncation, deletion, permissions, manifest fields
# of the wrong type, size, depth or encoding; mutate_checkpoint.py lists them), and damage of the
# `latest` pointer, applied to the newer of two steps. For each:
#   - elastrun-ckpt verify STEP exits 1 with one line "elastrun-ckpt: ..." naming the damaged
#     file (and the tensor, when the damage is one tensor's);
#   - elastrun-ckpt inspect/ls do not crash (no signal);
#   - a resharding restore (3 ranks, ckpt_mutation_fixture) falls back to the older step and gets
#     exactly its bytes, without crashing.
# Usage: test_ckpt_mutation.sh ELASTRUN_CKPT MUTATION_FIXTURE
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@"
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
tool=$1 fixture=$2
mutate=$(dirname "${BASH_SOURCE[0]}")/mutate_checkpoint.py
/usr/bin/python3 -c 'import h5py, numpy' 2>/dev/null || skip "no h5py for /usr/bin/python3 (python3-h5py)"
sandbox
work=$SANDBOX

# Root ignores file permissions: the readers then run as nobody, so that an unreadable file is one.
reader=()
if ((EUID == 0)); then
  command -v setpriv >/dev/null || skip "running as root without setpriv (util-linux)"
  reader=(setpriv --reuid=65534 --regid=65534 --clear-groups)
fi
read_as() { (cd / && "${reader[@]}" "$@"); }

"$fixture" write "$work/pristine" || fail "the fixture could not write two steps"
chmod -R a+rX "$work/pristine"
step2=step-000000002

# no_crash NAME RC: the process exited (any code), it was not killed by a signal
no_crash() { (($2 < 128)) || fail "$1 crashed (exit $2)"; }

# restore_falls_back CASE EXPECTED_STEP
restore_falls_back() {
  local rc=0
  read_as "$fixture" restore "$work/case" >"$work/restore.out" 2>"$work/restore.err" || rc=$?
  no_crash "restore ($1)" "$rc"
  [[ $rc -eq 0 ]] || fail "$1: restore exit $rc: $(cat "$work/restore.err" "$work/restore.out")"
  [[ $(json "$work/restore.out" 'd["step"]') == "$2" ]] ||
    fail "$1: restored $(cat "$work/restore.out"), expected step $2"
}

# tools_survive CASE: inspect and ls exit (0 or an error), never by a signal
tools_survive() {
  local rc sub
  for sub in "inspect $work/case/$step2" "ls $work/case"; do
    rc=0
    # shellcheck disable=SC2086 # sub is two words
    read_as "$tool" $sub >/dev/null 2>"$work/survive.err" || rc=$?
    no_crash "elastrun-ckpt $sub ($1)" "$rc"
  done
}

cases=0
while read -r kind; do
  rm -rf "$work/case"
  cp -a "$work/pristine" "$work/case"
  read -r file tensor < <(/usr/bin/python3 "$mutate" "$kind" "$work/case/$step2") ||
    fail "$kind: could not apply the damage"
  rc=0
  read_as "$tool" verify "$work/case/$step2" >"$work/verify.out" 2>"$work/verify.err" || rc=$?
  no_crash "verify ($kind)" "$rc"
  [[ $rc -eq 1 ]] || fail "$kind: verify exit $rc, expected 1: $(cat "$work/verify.err" "$work/verify.out")"
  [[ $(wc -l <"$work/verify.err") -eq 1 ]] || fail "$kind: verify printed not one line: $(cat "$work/verify.err")"
  grep -q "^elastrun-ckpt: .*$step2/$file" "$work/verify.err" ||
    fail "$kind: verify does not name $step2/$file: $(cat "$work/verify.err")"
  if [[ $tensor != - ]] && ! grep -qF "'$tensor'" "$work/verify.err"; then
    fail "$kind: verify does not name tensor '$tensor': $(cat "$work/verify.err")"
  fi
  tools_survive "$kind"
  restore_falls_back "$kind" 1
  echo "ok: $kind: $(cut -c1-150 "$work/verify.err")"
  cases=$((cases + 1))
done < <(/usr/bin/python3 "$mutate" list)

# Pointer damage: `latest` is only a convenience for people and tools; restore lists the steps
# itself, so it still gets the newest valid step (2). Tools given the root name the pointer.
for pointer in dangling garbage_file loop; do
  rm -rf "$work/case"
  cp -a "$work/pristine" "$work/case"
  rm -f "$work/case/latest"
  case $pointer in
  dangling) ln -s step-000000009 "$work/case/latest" ;;
  garbage_file) printf 'step-\xff\n' >"$work/case/latest" ;;
  loop) ln -s latest "$work/case/latest" ;;
  esac
  rc=0
  read_as "$tool" inspect "$work/case" >/dev/null 2>"$work/tool.err" || rc=$?
  no_crash "inspect (latest $pointer)" "$rc"
  [[ $rc -ne 0 && $(wc -l <"$work/tool.err") -eq 1 ]] && grep -q "latest" "$work/tool.err" ||
    fail "latest $pointer: inspect exit $rc: $(cat "$work/tool.err")"
  tools_survive "latest $pointer"
  restore_falls_back "latest $pointer" 2
  echo "ok: latest $pointer: $(cat "$work/tool.err")"
  cases=$((cases + 1))
done
echo "ok: $cases kinds of damage: one error line each, restore fell back, nothing crashed"
