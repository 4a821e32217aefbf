#!/usr/bin/env bash
# ctest driver: fixture writes a checkpoint, h5py/h5ls/h5dump read it from another cwd.
# (ctest runs it with `sh`; it runs itself again under bash, which tests/support/lib.sh needs.)
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@"
set -eu
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
fixture="$1"; script="$2"
sandbox
"$fixture" "$SANDBOX"
cd /
/usr/bin/python3 "$script" "$SANDBOX"
h5ls -r "$SANDBOX/ckpt/latest/index.h5" >/dev/null
h5dump -d /model/w "$SANDBOX/ckpt/latest/index.h5" >/dev/null
echo "h5ls and h5dump read the index"
