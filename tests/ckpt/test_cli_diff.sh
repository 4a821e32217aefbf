#!/usr/bin/env bash
# ctest driver for `elastrun-ckpt diff` (ckpt.cli_diff): max |Δ| per tensor of two checkpoints;
# exit 0 if every tensor is within --tol, 1 if not (or tensors missing/extra/of another
# dtype/shape, one stderr line each), 2 for usage errors and unreadable checkpoints.
# Usage: test_cli_diff.sh path/to/elastrun-ckpt path/to/ckpt_diff_fixture
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
tool=$1 fixture=$2
sandbox
w=$SANDBOX
"$fixture" "$w" || fail "fixture"
show_on_failure 40 "$w/out" "$w/err"

diff_rc() {  # diff_rc A B [ARGS...]: runs diff into $w/out and $w/err, prints its exit status
  local rc=0
  "$tool" diff "$@" >"$w/out" 2>"$w/err" || rc=$?
  echo "$rc"
}
expect() {  # expect RC A B [ARGS...]
  local want=$1 rc
  shift
  rc=$(diff_rc "$@")
  [[ $rc == "$want" ]] || fail "diff $* exited $rc, expected $want: $(cat "$w/out" "$w/err")"
}

# Same values saved by 1 and 3 ranks: every tensor compared, exactly 0; roots resolve to latest.
expect 0 "$w/base" "$w/resharded"
grep -q "^a: $w/base/latest (step 10, world size 1)$" "$w/out" || fail "header: $(cat "$w/out")"
grep -q "^b: $w/resharded/latest (step 10, world size 3)$" "$w/out" || fail "header: $(cat "$w/out")"
for t in model/w model/h model/b optim/step mask empty d; do
  grep -q "^$t 0.000000e+00$" "$w/out" || fail "no line for $t: $(cat "$w/out")"
done
grep -q "^max |Δ| = 0.000000e+00 over 7 tensors (tol 0.0001)$" "$w/out" || fail "summary: $(cat "$w/out")"
[[ ! -s $w/err ]] || fail "stderr for equal checkpoints: $(cat "$w/err")"
expect 0 "$w/base/step-000000010" "$w/resharded/step-000000010" --tol 0

# An older step of the same root: w[0] -2.0 vs -3.0.
expect 1 "$w/base/step-000000005" "$w/base"
grep -q "^model/w 1.000000e+00  ABOVE TOLERANCE$" "$w/out" || fail "step 5 vs 10: $(cat "$w/out")"

# A small difference (float32 w[7] off by ~5e-5): within the default 1e-4, not within 1e-5.
expect 0 "$w/base" "$w/near"
grep -Eq "^model/w (4\.99|5\.00)[0-9]*e-05$" "$w/out" || fail "near: $(cat "$w/out")"
grep -Eq "^max \|Δ\| = (4\.99|5\.00)[0-9]*e-05 over 7 tensors \(tol 0.0001\)$" "$w/out" || fail "near summary: $(cat "$w/out")"
expect 1 "$w/base" "$w/near" --tol 1e-5
grep -Eq "^model/w (4\.99|5\.00)[0-9]*e-05  ABOVE TOLERANCE$" "$w/out" || fail "near, tol 1e-5: $(cat "$w/out")"
grep -q "(tol 1e-05)$" "$w/out" || fail "near tol: $(cat "$w/out")"

# float16 1.0 -> 1.5.
expect 1 "$w/base" "$w/far"
grep -q "^model/h 5.000000e-01  ABOVE TOLERANCE$" "$w/out" || fail "far: $(cat "$w/out")"
grep -q "^model/w 0.000000e+00$" "$w/out" || fail "far, other tensors: $(cat "$w/out")"

expect_mismatch() {  # expect_mismatch A B LINE-ERE: exit 1 with exactly one stderr line
  expect 1 "$1" "$2"
  [[ $(wc -l <"$w/err") -eq 1 ]] || fail "diff $1 $2 stderr: $(cat "$w/err")"
  grep -Eq "$3" "$w/err" || fail "diff $1 $2 stderr: $(cat "$w/err")"
}
expect_mismatch "$w/base" "$w/extra" "^elastrun-ckpt: tensor 'model/x' is only in b \($w/extra/latest\)$"
grep -q "over 7 tensors (tol 0.0001); 1 tensor(s) not comparable$" "$w/out" || fail "extra summary: $(cat "$w/out")"
expect_mismatch "$w/base" "$w/missing" "^elastrun-ckpt: tensor 'mask' is only in a \($w/base/latest\)$"
expect_mismatch "$w/base" "$w/reshaped" "^elastrun-ckpt: tensor 'model/w' differs in type: float32 \[6,5\] in a, float32 \[5,6\] in b$"
expect_mismatch "$w/base" "$w/retyped" "^elastrun-ckpt: tensor 'model/w' differs in type: float32 \[6,5\] in a, float64 \[6,5\] in b$"

# NaN at the same place on both sides is equal; against a number it is infinitely far.
expect 0 "$w/nan_a" "$w/nan_b"
expect 1 "$w/base" "$w/nan_a"
grep -q "^d inf  ABOVE TOLERANCE$" "$w/out" || fail "nan: $(cat "$w/out")"

# Usage errors and unreadable checkpoints: 2.
expect 2 "$w/base"
expect 2 "$w/base" "$w/near" --tol -1
expect 2 "$w/base" "$w/near" --tol x
expect 2 "$w/base" "$w/missing-dir"
[[ $(wc -l <"$w/err") -eq 1 ]] && grep -q "^elastrun-ckpt: .*missing-dir" "$w/err" || fail "missing dir: $(cat "$w/err")"
cp -r "$w/resharded" "$w/damaged"
shard=$(readlink -f "$w/damaged/latest")/shard-00001-of-00003.h5
truncate -s -8 "$shard"
expect 2 "$w/base" "$w/damaged"
[[ $(wc -l <"$w/err") -eq 1 ]] && grep -q "^elastrun-ckpt: .*shard-00001-of-00003.h5" "$w/err" || fail "damaged: $(cat "$w/err")"
echo "ok: diff exit 0/1/2, per-tensor lines, summary, mismatches named"
