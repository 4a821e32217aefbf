#!/usr/bin/env bash
# The plugin exports only what Slurm's loader looks up, and links neither libslurm nor libtorch.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
so=$1
exported=$(nm -D --defined-only "$so" | awk '{print $3}' | sort)
echo "$exported"
bad=$(grep -Ev '^(slurm_spank_[a-z_]+|plugin_(name|type|version)|spank_plugin_version)$' <<<"$exported" || true)
[[ -z $bad ]] || fail "unexpected exported symbols: $bad"
for sym in plugin_name plugin_type plugin_version slurm_spank_init slurm_spank_task_init; do
  grep -qx "$sym" <<<"$exported" || fail "$sym is not exported"
done
if readelf -d "$so" | grep -E 'NEEDED.*(libslurm|libtorch|libc10)'; then
  fail "the plugin links libslurm or libtorch (it must take Slurm's symbols from its host process)"
fi
echo "ok: exports and dependencies"
