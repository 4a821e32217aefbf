#!/bin/sh
# ctest driver for elastrun-ckpt: good checkpoints exit 0, bad paths and damage give one error
# line and a non-zero exit.
set -u
tool="$1"; fixture="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
"$fixture" "$work" || fail "fixture"
step="$work/ckpt/step-000000042"

"$tool" ls "$work/ckpt" > "$work/ls.out" || fail "ls exit"
grep -q "^42 .* 4  ok (latest)" "$work/ls.out" || fail "ls output: $(cat "$work/ls.out")"
"$tool" inspect "$step" > "$work/inspect.out" || fail "inspect exit"
grep -q "^model/emb  *bfloat16  *\[9,3\]  *sharded  *4" "$work/inspect.out" || fail "inspect output"
"$tool" verify "$work/ckpt" > /dev/null || fail "verify of a good checkpoint"
"$tool" export "$step" --to "$work/out.safetensors" > /dev/null || fail "export exit"
[ -s "$work/out.safetensors" ] || fail "export wrote nothing"

expect_one_error_line() {  # command... : must exit non-zero with exactly one stderr line
  if "$@" > /dev/null 2> "$work/err"; then fail "'$*' succeeded"; fi
  [ "$(wc -l < "$work/err")" -eq 1 ] || fail "'$*' stderr: $(cat "$work/err")"
  grep -q "^elastrun-ckpt: " "$work/err" || fail "'$*' stderr: $(cat "$work/err")"
}
expect_one_error_line "$tool" ls "$work/missing"
expect_one_error_line "$tool" inspect "$work/missing"
expect_one_error_line "$tool" inspect "$work/expected"
expect_one_error_line "$tool" verify /etc
expect_one_error_line "$tool" export "$work/missing" --to "$work/x.safetensors"

# Flip one byte of tensor data (located with h5py): verify must fail naming the file.
shard="$step/shard-00001-of-00004.h5"
/usr/bin/python3 - "$shard" <<'PY' || fail "corrupting the shard"
import sys
import h5py
path = sys.argv[1]
with h5py.File(path, "r") as f:
    offset = f["model/w"].id.get_offset()
with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ 0x01]))
PY
if "$tool" verify "$step" > /dev/null 2> "$work/err"; then fail "verify missed corruption"; fi
grep -q "shard-00001-of-00004.h5" "$work/err" || fail "verify message: $(cat "$work/err")"
echo "elastrun-ckpt CLI checks passed"
