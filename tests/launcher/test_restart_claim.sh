#!/usr/bin/env bash
# One restart per round: two agents on one machine (shared --rdzv-endpoint), every worker of the
# first attempt fails at once on both nodes (as when one crash breaks the peers' collectives).
# Five times in a row: with --max-restarts=1 the job must restart exactly once (TORCHELASTIC_RESTART_COUNT=1 in the
# second attempt) and succeed: the agents must not each count the same round's failure.
# Usage: test_restart_claim.sh path/to/elastrun
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
unset_env '^(SLURM_|PET_|RANK$|WORLD_SIZE$|MASTER_|TORCHELASTIC_)'
sandbox
work=$SANDBOX
show_on_failure all "$work/*.err"
cat >"$work/worker.sh" <<EOF
#!/bin/sh
echo "\$RANK \$WORLD_SIZE \$TORCHELASTIC_RESTART_COUNT" > "$work/rank\$RANK.attempt\$TORCHELASTIC_RESTART_COUNT"
[ "\$TORCHELASTIC_RESTART_COUNT" = 0 ] && exit 3
exit 0
EOF
chmod 755 "$work/worker.sh"
port=$(free_port)
for round in 1 2 3 4 5; do
  rm -f "$work"/rank*
  common=(--nnodes=2 --nproc-per-node=2 --rdzv-endpoint=127.0.0.1:$port --rdzv-id=claim$round
          --rdzv-auth=none --max-restarts=1)
  pids=()
  "$elastrun" "${common[@]}" --rdzv-conf=is_host=1 --node-rank=0 "$work/worker.sh" >/dev/null 2>"$work/a.err" &
  pids+=($!)
  "$elastrun" "${common[@]}" --rdzv-conf=is_host=0 --node-rank=1 "$work/worker.sh" >/dev/null 2>"$work/b.err" &
  pids+=($!)
  track_pid "${pids[@]}"
  rc=()
  for p in "${pids[@]}"; do
    timeout 60 tail --pid="$p" -f /dev/null
    await "$p"
    rc+=($?)
  done
  [[ ${rc[*]} == "0 0" ]] || fail "round $round: agents exited ${rc[*]} (the one failed round was counted twice?)"
  for r in 0 1 2 3; do
    [[ $(cat "$work/rank$r.attempt1" 2>/dev/null) == "$r 4 1" ]] || fail "round $round: rank $r did not run again with RESTART_COUNT=1"
  done
  [[ $(cat "$work/a.err" "$work/b.err" | grep -c "state RESTART restart 1 of 1") -eq 1 ]] ||
    fail "round $round: expected exactly one counted restart"
  echo "ok $round: one restart counted; the other agent: $(cat "$work/a.err" "$work/b.err" | grep -ohE "not counted (again|against --max-restarts)")"
done
echo "ok: both nodes failed at once five times; one restart counted each time"
