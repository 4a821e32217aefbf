#!/bin/sh
# ctest driver: fixture writes a checkpoint, h5py/h5ls/h5dump read it from another cwd.
set -eu
fixture="$1"; script="$2"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$fixture" "$work"
cd /
/usr/bin/python3 "$script" "$work"
h5ls -r "$work/ckpt/latest/index.h5" >/dev/null
h5dump -d /model/w "$work/ckpt/latest/index.h5" >/dev/null
echo "h5ls and h5dump read the index"
