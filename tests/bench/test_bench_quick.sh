#!/usr/bin/env bash
# bench.quick: `bench/run.py --quick` (what `scripts/bench --quick` runs after building) writes its
# three outputs under the build tree -- latest.json, report.md, charts -- and the JSON is well-formed
# with every figure paired with its anchor (bench/check_results.py), for every group (the testbed
# group brings up a private 4-node testbed of its own). With a shared
# filesystem possible here (always under CI=true), the checkpoint figures on it must be there too.
# Never asserts a timing. Leaves the source tree clean (nothing under bench/results changes).
# Usage: test_bench_quick.sh BIN_DIR OUT_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
bin=${1:?usage: test_bench_quick.sh BIN_DIR OUT_DIR}
out=${2:?usage: test_bench_quick.sh BIN_DIR OUT_DIR}
src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rm -rf "$out"
before=$(git -C "$src" status --porcelain -- bench/results 2>/dev/null || true)
export ELASTRUN_BENCH_TESTBED_ID=${TESTBED_ID:-bench}-bench
/usr/bin/python3 "$src/bench/run.py" --quick --bin "$bin" --out "$out" >"$out.log" 2>&1 ||
  fail "bench/run.py --quick failed: $(tail -5 "$out.log")"
show_on_failure 60 "$out.log"
cat "$out.log"
for f in latest.json report.md; do [[ -s $out/$f ]] || fail "no $out/$f"; done
compgen -G "$out/*.png" >/dev/null || fail "no chart (*.png) in $out"
/usr/bin/python3 "$src/bench/check_results.py" "$out/latest.json" --groups storage,ckpt,memory,launcher,testbed,rdzv ||
  fail "latest.json does not hold every figure with its anchor (above)"
shared=$(/usr/bin/python3 -c '
import json, sys
figs = json.load(open(sys.argv[1]))["figures"]
print(sum(1 for f in figs if f["id"].startswith("ckpt.shared.") and "not_measured" not in f))' "$out/latest.json")
if "$TB" check-shared-fs >/dev/null 2>&1; then
  ((shared > 0)) || fail "a shared filesystem is possible here, but latest.json has no measured ckpt.shared.* figure"
elif [[ ${CI:-} == true ]]; then
  fail "CI=true: the shared filesystem figures need GlusterFS/FUSE: $("$TB" check-shared-fs 2>&1)"
fi
# the Python package's figures (#18), measured whenever the package is built
python_figures=$(/usr/bin/python3 -c '
import json, sys
figs = json.load(open(sys.argv[1]))["figures"]
print(sum(1 for f in figs if f["id"].startswith("ckpt.local.python_") and "not_measured" not in f))' "$out/latest.json")
if [[ -d $bin/../python/elastrun ]]; then
  ((python_figures >= 6)) || fail "the Python package is built, but latest.json has $python_figures measured ckpt.local.python_* figures"
fi
for f in $(grep -o '([a-z0-9-]*\.png)' "$out/report.md" | tr -d '()'); do
  [[ -s $out/$f ]] || fail "report.md shows $f, which is missing"
done
[[ $(git -C "$src" status --porcelain -- bench/results 2>/dev/null || true) == "$before" ]] ||
  fail "the quick run changed the committed bench/results"
echo "PASS: bench --quick wrote latest.json, report.md and charts; $shared checkpoint figures on the shared filesystem," \
  "$python_figures of the Python package"
