#!/usr/bin/env bash
# tools/elastrun-timeline on a canned event log of a node loss (tests/tools/node_loss_events.jsonl):
# the timeline names the rounds, the loss and how it was detected, the re-form, the checkpoint,
# the resume and the end; --png writes a PNG; bad input is one error line and exit 1.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tool="$here/../../tools/elastrun-timeline"
sandbox
if ! /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  [[ ${CI:-} == true ]] && fail "no python3-matplotlib (scripts/setup installs it)"
  skip "no python3-matplotlib"
fi
/usr/bin/python3 "$tool" --png "$SANDBOX/t.png" "$here/node_loss_events.jsonl" >"$SANDBOX/out" ||
  fail "the tool failed: $(cat "$SANDBOX/out")"
cat "$SANDBOX/out"
for want in "round 1 of run 7.r0: world size 8 on n1,n2,n3,n4" \
  "node n3 lost (holder disconnected, detected 412 ms after its last heartbeat)" \
  "round 2 of run 7.r0: world size 6 on n1,n2,n4 (formed in 1000 ms, re-formed 1100 ms after the loss was seen)" \
  "checkpoint step 5: 2.0 KiB per rank, training blocked 2 ms, durable after 15 ms" \
  "resumed from checkpoint step 5 at world size 6" "training done at step 12: final loss 0.41" \
  "3 of 3 agent runs exited 0"; do
  grep -qF -- "$want" "$SANDBOX/out" || fail "timeline lacks '$want'"
done
[[ $(grep -c "node n3 lost" "$SANDBOX/out") == 1 ]] || fail "the loss seen by two agents is listed twice"
[[ $(head -c 8 "$SANDBOX/t.png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || fail "no PNG written"
# bad input: one line, exit 1
printf 'not json\n' >"$SANDBOX/bad.jsonl"
rc=0
/usr/bin/python3 "$tool" "$SANDBOX/bad.jsonl" "$SANDBOX/missing.jsonl" 2>"$SANDBOX/err" || rc=$?
((rc == 1)) || fail "exit $rc for a missing file"
grep -q "cannot read .*missing.jsonl" "$SANDBOX/err" || fail "no error naming the missing file: $(cat "$SANDBOX/err")"
echo "ok: timeline and plot of a node loss; bad input refused"
