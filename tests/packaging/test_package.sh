#!/usr/bin/env bash
# `cmake --install` (into a DESTDIR, touching nothing on this machine) and `cpack -G DEB` put the
# binaries, the SPANK plugin in Slurm's plugin dir and the plugstack.conf.d snippet in place.
# Usage: test_package.sh BUILD_DIR SLURM_PLUGIN_DIR
set -euo pipefail
build=$1
plugin_dir=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

DESTDIR="$tmp/root" cmake --install "$build" >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log"; fail "cmake --install failed"; }
for f in bin/elastrun bin/elastrun-ckpt; do
  found=$(find "$tmp/root" -path "*/$f" -type f | head -1)
  [[ -n $found && -x $found ]] || fail "cmake --install did not install $f"
done
# the Python package: where Debian's /usr/bin/python3 finds it under the build's prefix
if [[ -d $build/python/elastrun ]]; then
  for f in elastrun/_core.cpython-*.so elastrun/checkpoint.py elastrun/control.py elastrun_control.py; do
    found=$(find "$tmp/root" -path "*/lib/python3.*/dist-packages/$f" -type f | head -1)
    [[ -n $found ]] || fail "cmake --install did not put $f into lib/python3.X/dist-packages"
  done
fi
[[ -f "$tmp/root$plugin_dir/spank_elastrun.so" ]] || fail "plugin not installed into $plugin_dir"
snippet=$(find "$tmp/root" -path '*plugstack.conf.d/elastrun.conf' | head -1)
[[ -n $snippet ]] || fail "no plugstack.conf.d/elastrun.conf installed"
grep -Eq '^optional[[:space:]]+.*spank_elastrun\.so' "$snippet" || fail "snippet is not an 'optional' plugin line: $(cat "$snippet")"

(cd "$build" && cpack -G DEB -B "$tmp/deb" >"$tmp/cpack.log" 2>&1) || { tail -20 "$tmp/cpack.log"; fail "cpack -G DEB failed"; }
deb=$(ls "$tmp"/deb/*.deb 2>/dev/null | head -1)
[[ -n $deb ]] || fail "cpack produced no .deb"
contents=$(dpkg-deb -c "$deb")
for f in /bin/elastrun /bin/elastrun-ckpt "$plugin_dir/spank_elastrun.so" plugstack.conf.d/elastrun.conf \
         /lib/libelastrun_ckpt.a /include/elastrun/ckpt/checkpoint.hpp /lib/cmake/elastrun/elastrunConfig.cmake; do
  grep -q -- "$f\$" <<<"$contents" || fail ".deb lacks $f"
done
if [[ -d $build/python/elastrun ]]; then
  for f in /usr/lib/python3/dist-packages/elastrun/checkpoint.py /usr/lib/python3/dist-packages/elastrun_control.py; do
    grep -q -- "$f\$" <<<"$contents" || fail ".deb lacks $f (Debian's dist-packages)"
  done
  grep -Eq -- '/usr/lib/python3/dist-packages/elastrun/_core\.cpython-[0-9]+-[^/]*\.so$' <<<"$contents" \
    || fail ".deb lacks the extension module elastrun/_core in Debian's dist-packages"
fi
dpkg-deb -f "$deb" Depends | grep -q libslurm || fail ".deb does not depend on libslurm"
echo "ok: $(basename "$deb") with $(grep -c . <<<"$contents") entries"
