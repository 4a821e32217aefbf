#!/usr/bin/env bash
# cmake --install into a DESTDIR: the plugin lands in the configured plugin dir and elastrun.conf
# (an `optional` line naming it) in the configured plugstack.conf.d.
set -euo pipefail
build=$1 plugin_dir=$2 conf_dir=$3
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
DESTDIR=$dest cmake --install "$build" --component spank >/dev/null
[[ -f $dest$plugin_dir/spank_elastrun.so ]] || { echo "FAIL: no $plugin_dir/spank_elastrun.so" >&2; find "$dest" >&2; exit 1; }
conf=$dest$conf_dir/elastrun.conf
[[ -f $conf ]] || { echo "FAIL: no $conf_dir/elastrun.conf" >&2; find "$dest" >&2; exit 1; }
grep -Eq "^optional $plugin_dir/spank_elastrun.so( |$)" "$conf" || { cat "$conf" >&2; echo "FAIL: no optional line" >&2; exit 1; }
echo "ok: $plugin_dir/spank_elastrun.so and $conf_dir/elastrun.conf:"
grep -v '^#' "$conf"
