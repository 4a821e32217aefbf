#!/usr/bin/env bash
# find_package(elastrun) in a user's project: `cmake --install` (into a DESTDIR, under a prefix
# other than the configured one, touching nothing on this machine), then find_package_project/ —
# configured with nothing but CMAKE_PREFIX_PATH pointing there — builds, saves a checkpoint with
# elastrun::ckpt, restores and verifies it; the installed elastrun-ckpt verifies it too.
# Usage: test_find_package.sh BUILD_DIR [torch]   (torch: also elastrun::ckpt_torch)
set -euo pipefail
build=$1
with_torch=${2:-}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

prefix=/opt/elastrun-find-package-test
DESTDIR="$tmp/root" cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log"; fail "cmake --install failed"; }
installed="$tmp/root$prefix"
for f in include/elastrun/ckpt/checkpoint.hpp include/elastrun/control.hpp; do
  [[ -f $installed/$f ]] || fail "cmake --install did not install $f"
done
config=$(find "$installed" -path '*/cmake/elastrun/elastrunConfig.cmake' | head -1)
[[ -n $config ]] || fail "no cmake/elastrun/elastrunConfig.cmake installed"
[[ -n $(find "$installed" -name libelastrun_ckpt.a) ]] || fail "libelastrun_ckpt.a not installed"

# Only the installed package: no environment prefixes, no package registry, and the project
# checks that elastrun_DIR is under $installed.
unset CMAKE_PREFIX_PATH elastrun_DIR ELASTRUN_CONTROL_FILE ELASTRUN_CHECKPOINT_DIR
cmake -S "$here/find_package_project" -B "$tmp/project" -DCMAKE_PREFIX_PATH="$installed" \
  -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DEXPECTED_PREFIX="$installed" \
  -DWITH_TORCH="$([[ $with_torch == torch ]] && echo ON || echo OFF)" >"$tmp/configure.log" 2>&1 ||
  { cat "$tmp/configure.log"; fail "find_package(elastrun) project did not configure"; }
cmake --build "$tmp/project" >"$tmp/build.log" 2>&1 ||
  { tail -40 "$tmp/build.log"; fail "find_package(elastrun) project did not build"; }

check_run() {  # program checkpoint-dir
  "$tmp/project/$1" "$2" || fail "$1 exited with $?"
  [[ $(readlink "$2/latest") == step-000000020 ]] || fail "$1: latest is not step-000000020"
  [[ -f $2/step-000000020/index.h5 ]] || fail "$1: no committed step-000000020/index.h5"
  [[ ! -e $2/step-000000010 ]] || fail "$1: retention kept step-000000010"
  "$installed/bin/elastrun-ckpt" verify "$2" >/dev/null || fail "installed elastrun-ckpt: $1's checkpoint does not verify"
}
check_run save_and_load "$tmp/ckpt"
[[ $with_torch != torch ]] || check_run torch_save_and_load "$tmp/ckpt_torch"
echo "ok: find_package(elastrun) from $prefix: built, saved, restored and verified${with_torch:+ (with elastrun::ckpt_torch)}"
