#!/usr/bin/env bash
# A minority never makes progress (#29 section 2), for the rendezvous, on one private 4-node
# testbed with network cuts (testbed partition/isolate/heal; slurmctld stays reachable, so Slurm
# says every node is up). Four rendezvous members (one srun step, zero flags, --confirm-slurm as
# the agent under Slurm) form a round of 4, then, healing between scenarios:
#   (1) partition n1,n2,n3 / n4 (the store on the majority side): n1..n3 form a round of 3, n4
#       reports no quorum and forms nothing; heal -> a round of 4 again (n4 rejoins).
#   (2) isolate n1 (the store's host): n2..n4 fail over to a standby and form a round of 3; n1
#       (alone with the first store) reports no quorum; heal -> n1 finds the job and rejoins: 4.
#   (3) partition n1,n2 / n3,n4 (a symmetric split): both halves report no quorum and no round
#       of 2 forms; heal -> a round of 4.
#   (4) partition n1,n2 / n3,n4, then `scontrol update state=down` for n3,n4: Slurm's word lets
#       n1,n2 go on as a round of 2 (n3,n4 still without quorum).
# Every round is checked: never two rounds of the same generation with different members, and
# no round without a majority of the round before it unless Slurm had the missing nodes down.
# Environment: ELASTRUN_TESTBED, TESTBED_ID (this test uses <id>-rpart), ELASTRUN_BIN.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
sandbox
out=$SANDBOX
show_on_failure all "$out/members.jsonl"
show_on_failure 40 "$out/members.err"
private_testbed_up 4 rpart

srun --no-kill -N4 --ntasks-per-node=1 "$ELASTRUN_BIN/rdzv_member" --slurm --confirm-slurm --min 1 --max 4 \
  --hb-ms 2000 --last-call-ms 2000 --join-timeout-ms 300000 >"$out/members.jsonl" 2>"$out/members.err" &
srun_pid=$!
track_pid "$srun_pid"

# lines EVENT [SIZE]: event lines so far (rounds of SIZE members)
lines() {
  if [[ -n ${2:-} ]]; then grep -c "\"event\":\"$1\".*\"group_world_size\":$2," "$out/members.jsonl" || true
  else grep -c "\"event\":\"$1\"" "$out/members.jsonl" || true; fi
}
# await DESCRIPTION SECONDS EVENT SIZE COUNT: until COUNT such lines in all
at_least() { [[ $(lines "$1" "${2:-}") -ge $3 ]]; }
await() { wait_for -a "$srun_pid" "srun ended early" "$2" at_least "$3" "$4" "$5" || fail "$1"; }
no_quorum_of() { grep "\"event\":\"no_quorum\"" "$out/members.jsonl" | grep -c "\"node\":\"$1\"" || true; }

await "four members did not form a round" 120 round 4 4

# ---- (1) 3 | 1, the store with the majority --------------------------------------------------------
nq=$(no_quorum_of n4)
"$TB" partition n1,n2,n3 / n4
await "(1) n1..n3 did not form a round of 3" 60 round 3 3
wait_for 60 eval '[[ $(no_quorum_of n4) -gt $nq ]]' || fail "(1) n4 did not report no quorum"
[[ $(lines round 1) -eq 0 ]] || fail "(1) n4 formed a round of its own"
"$TB" heal
await "(1) no round of 4 after heal" 90 round 4 8
echo "ok: (1) 3 | 1: the majority went on at 3, n4 waited without quorum and rejoined after heal"

# ---- (2) 3 | 1, the store's host cut off -------------------------------------------------------------
nq=$(no_quorum_of n1)
"$TB" isolate n1
await "(2) n2..n4 did not fail over and form a round of 3" 90 round 3 6
wait_for 60 eval '[[ $(no_quorum_of n1) -gt $nq ]]' || fail "(2) n1 did not report no quorum"
[[ $(lines round 1) -eq 0 ]] || fail "(2) n1 formed a round of its own"
"$TB" heal
await "(2) n1 did not rejoin the job after heal" 90 round 4 12
echo "ok: (2) the store's host isolated: the majority failed over and went on, n1 rejoined after heal"

# ---- (3) 2 | 2, Slurm says every node is up ---------------------------------------------------------
before=$(lines no_quorum)
"$TB" partition n1,n2 / n3,n4
wait_for 60 eval '[[ $(lines no_quorum) -ge $((before + 4)) ]]' || fail "(3) not every node reported no quorum"
sleep 5  # a side with a round of 2 would have formed it by now (heartbeat 2 s, last call 2 s)
[[ $(lines round 2) -eq 0 ]] || fail "(3) a half of a symmetric split formed a round"
"$TB" heal
await "(3) no round of 4 after heal" 90 round 4 16
echo "ok: (3) 2 | 2: neither half formed a round; after heal the four did"

# ---- (4) 2 | 2, Slurm has n3 and n4 down --------------------------------------------------------------
"$TB" partition n1,n2 / n3,n4
scontrol update nodename=n3,n4 state=down reason=partition-test
await "(4) n1,n2 did not go on with Slurm's word on n3,n4" 90 round 2 2
scontrol update nodename=n3,n4 state=resume || true
"$TB" heal
echo "ok: (4) 2 | 2 with n3,n4 down in Slurm: n1,n2 went on as a round of 2"

/usr/bin/python3 - "$out/members.jsonl" <<'PY'
import collections, sys
import elastrun.events as ev
rounds = [e for e in ev.read([sys.argv[1]]) if e["event"] == "round"]  # schema v1
by_gen = collections.defaultdict(set)
for r in rounds:
    by_gen[r["gen"]].add(tuple(r["members"]))
split = {g: m for g, m in by_gen.items() if len(m) > 1}
assert not split, f"two rounds with one generation (split brain): {split}"
sizes = [len(next(iter(by_gen[g]))) for g in sorted(by_gen)]
print("ok: one round per generation; sizes in order:", sizes)
PY
