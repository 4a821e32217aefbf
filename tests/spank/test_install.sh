#!/usr/bin/env bash
# cmake --install into a DESTDIR: the plugin lands in the configured plugin dir and elastrun.conf
# (an `optional` line naming it) in the configured plugstack.conf.d.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
build=$1 plugin_dir=$2 conf_dir=$3
sandbox
dest=$SANDBOX/root
on_failure 'find "$dest" >&2'
DESTDIR=$dest cmake --install "$build" --component spank >/dev/null
[[ -f $dest$plugin_dir/spank_elastrun.so ]] || fail "no $plugin_dir/spank_elastrun.so"
conf=$dest$conf_dir/elastrun.conf
[[ -f $conf ]] || fail "no $conf_dir/elastrun.conf"
grep -Eq "^optional $plugin_dir/spank_elastrun.so( |$)" "$conf" || { cat "$conf" >&2; fail "no optional line"; }
echo "ok: $plugin_dir/spank_elastrun.so and $conf_dir/elastrun.conf:"
grep -v '^#' "$conf"
