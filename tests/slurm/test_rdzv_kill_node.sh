#!/usr/bin/env bash
# On a private 4-node testbed: four rendezvous members started by one srun step (zero flags:
# identity, store endpoint and addresses all come from Slurm) form a 4-member round; after
# `kill-node n3` the three survivors form a 3-member round without n3, in node order; after
# `kill-node n1` (the node hosting the store) the two survivors fail over to a standby store
# and form a 2-member round: no node is a single point of failure.
# Environment: ELASTRUN_TESTBED, TESTBED_ID (the shared id; this test uses <id>-rdzv),
# ELASTRUN_BIN (build/bin).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
sandbox
out=$SANDBOX
show_on_failure all "$out/members.jsonl"
show_on_failure 20 "$out/members.err"
private_testbed_up 4 rdzv

srun --no-kill -N4 --ntasks-per-node=1 "$ELASTRUN_BIN/rdzv_member" --slurm --min 2 --max 4 \
  --hb-ms 2000 --last-call-ms 500 >"$out/members.jsonl" 2>"$out/members.err" &
srun_pid=$!
track_pid "$srun_pid"

# formed N: at least N round events with group_world_size N
formed() { have_lines "$1" "\"event\":\"round\".*\"group_world_size\":$1," "$out/members.jsonl"; }
members_form() { wait_for -a "$srun_pid" "srun ended early" 120 formed "$1"; } # members_form N: within 120 s

members_form 4 || fail "four members did not form a round"
grep -q '"members":\["n1","n2","n3","n4"\]' "$out/members.jsonl" || fail "round order is not n1..n4"

"$TB" kill-node n3
members_form 3 || fail "the three survivors did not re-form after kill-node n3"

/usr/bin/python3 - "$out/members.jsonl" <<'PY'
import sys
import elastrun.events as ev
rounds = [e for e in ev.read([sys.argv[1]]) if e["event"] == "round"]  # schema v1
three = [r for r in rounds if r["group_world_size"] == 3]
assert sorted(r["node"] for r in three) == ["n1", "n2", "n4"], three
for r in three:
    assert r["members"] == ["n1", "n2", "n4"], r
    assert r["group_rank"] == ["n1", "n2", "n4"].index(r["node"]), r
    assert r["master"] == three[0]["master"], r
assert len({r["gen"] for r in three}) == 1, three
print("ok: survivors re-formed:", three[0]["members"], "generation", three[0]["gen"])
PY

"$TB" kill-node n1   # the store's host
members_form 2 || fail "the two survivors did not re-form after the store host n1 died"
/usr/bin/python3 - "$out/members.jsonl" <<'PY'
import sys
import elastrun.events as ev
rounds = [e for e in ev.read([sys.argv[1]]) if e["event"] == "round"]  # schema v1
two = [r for r in rounds if r["group_world_size"] == 2]
assert sorted(r["node"] for r in two) == ["n2", "n4"], two
assert all(r["members"] == ["n2", "n4"] for r in two), two
assert min(r["gen"] for r in two) > max(r["gen"] for r in rounds if r["group_world_size"] == 3), rounds
print("ok: survived the store host:", two[0]["members"], "generation", two[0]["gen"])
PY
