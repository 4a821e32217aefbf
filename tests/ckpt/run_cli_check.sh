#!/usr/bin/env bash
# ctest driver for elastrun-ckpt: good checkpoints exit 0, bad paths and damage give one error
# line and a non-zero exit.
# (ctest runs it with `sh`; it runs itself again under bash, which tests/support/lib.sh needs.)
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@"
set -u
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
tool="$1"; fixture="$2"
sandbox
work=$SANDBOX
"$fixture" "$work" || fail "fixture"
step="$work/ckpt/step-000000042"

"$tool" ls "$work/ckpt" > "$work/ls.out" || fail "ls exit"
grep -q "^42 .* 4  ok (latest)" "$work/ls.out" || fail "ls output: $(cat "$work/ls.out")"
# A step committed under an agent names the round that committed it (its fence token).
echo '{"fence_token": "000001.000000000003"}' > "$step/committed-by.json"
"$tool" ls "$work/ckpt" > "$work/ls.out" || fail "ls exit with a commit record"
grep -q "^42 .* ok (latest) (committed by rendezvous round 3, requeue 1)$" "$work/ls.out" ||
  fail "ls does not show the committing round: $(cat "$work/ls.out")"
rm "$step/committed-by.json"
# Leftovers are listed for what they are: a retired step being deleted, an interrupted save.
mkdir "$work/ckpt/step-000000007.deleting-0123abcd" "$work/ckpt/step-000000043.tmp-4567ef01"
"$tool" ls "$work/ckpt" > "$work/ls.out" || fail "ls exit with leftovers"
grep -q "^step-000000007.deleting-0123abcd .* retired (being deleted" "$work/ls.out" || fail "ls retired: $(cat "$work/ls.out")"
grep -q "^step-000000043.tmp-4567ef01 .* partial (interrupted save" "$work/ls.out" || fail "ls partial: $(cat "$work/ls.out")"
rmdir "$work/ckpt/step-000000007.deleting-0123abcd" "$work/ckpt/step-000000043.tmp-4567ef01"
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
# an export never writes into a checkpoint (it once overwrote the index it read)
cp "$step/index.h5" "$work/index-before.h5"
expect_one_error_line "$tool" export "$step" --to "$step/index.h5"
cmp -s "$step/index.h5" "$work/index-before.h5" || fail "export --to STEP/index.h5 changed the index"
expect_one_error_line "$tool" export "$step" --to "$work/ckpt/out.safetensors"
# an empty directory is an error, not an empty table; a dangling 'latest' is named as such
mkdir "$work/empty"
expect_one_error_line "$tool" ls "$work/empty"
grep -q "no checkpoint steps" "$work/err" || fail "empty ls: $(cat "$work/err")"
mkdir "$work/dangling" && ln -s step-000000099 "$work/dangling/latest"
expect_one_error_line "$tool" inspect "$work/dangling"
grep -q "latest points to 'step-000000099', which does not exist" "$work/err" || fail "dangling latest: $(cat "$work/err")"
# ls says that it checks sizes only
"$tool" ls "$work/ckpt" | head -1 | grep -q "'verify' checks contents" || fail "ls does not say it checks sizes only"

# ls lists every step even when some are damaged: each bad one is INVALID with its reason.
cp -r "$step" "$work/ckpt/step-000000043"
printf 'not an hdf5 file' > "$work/ckpt/step-000000043/index.h5"
cp -r "$step" "$work/ckpt/step-000000044"
/usr/bin/python3 - "$work/ckpt/step-000000044/index.h5" <<'PY' || fail "rewriting a manifest"
import json, sys
import h5py, numpy
with h5py.File(sys.argv[1], "r+") as f:
    manifest = json.loads(f["_elastrun/manifest"][()].decode())
    manifest["world_size"] = "four"
    del f["_elastrun/manifest"]
    f["_elastrun/manifest"] = numpy.bytes_(json.dumps(manifest))
PY
mkdir "$work/ckpt/step-000000045"
cp -r "$step" "$work/ckpt/step-000000046"
rm "$work/ckpt/step-000000046/shard-00002-of-00004.h5"
"$tool" ls "$work/ckpt" > "$work/ls2.out" 2> "$work/err" || fail "ls of damaged steps exit: $(cat "$work/err")"
[ "$(wc -l < "$work/ls2.out")" -eq 6 ] || fail "ls of damaged steps: $(cat "$work/ls2.out")"
grep -q "^42 .* 4  ok (latest)" "$work/ls2.out" || fail "ls2 42: $(cat "$work/ls2.out")"
grep -q "^43 .*INVALID: .*index.h5" "$work/ls2.out" || fail "ls2 43: $(cat "$work/ls2.out")"
grep -q "^44 .*INVALID: .*world_size" "$work/ls2.out" || fail "ls2 44: $(cat "$work/ls2.out")"
grep -q "^45 .*INVALID: .*index.h5.*missing" "$work/ls2.out" || fail "ls2 45: $(cat "$work/ls2.out")"
grep -q "^46 .*INVALID: .*shard-00002-of-00004.h5.*missing" "$work/ls2.out" || fail "ls2 46: $(cat "$work/ls2.out")"
expect_one_error_line "$tool" inspect "$work/ckpt/step-000000044"
expect_one_error_line "$tool" verify "$work/ckpt/step-000000043"

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
