#!/usr/bin/env bash
# Partner copies of the memory tier (docs/launcher.md, "Partner copies"): three agents on this
# machine (--rdzv-endpoint, no Slurm), --nnodes=2, so the third waits as a spare; the Python
# trainer snapshots into the agents' memory every step, each agent sends its node's snapshots to its
# partner (the next member in round order). kill -9 of the second agent (node 1, ranks 2-3) with
# its workers: the spare takes ranks 2-3, fetches their snapshots from the first agent (which held
# them as the lost node's partner) and the job resumes from the agents' memory, not from the
# file tier:
#   - the resumed event says source "memory-partner", at most 2 steps before the newest step reached;
#   - while training, `elastrun node-status` of node 1 shows copies sent to and received from node 0;
#   - the spare's agent logs what it fetched, and from whom; the restore logs one line per rank;
#   - the final model equals a failure-free world-1 run (`elastrun-ckpt diff` exits 0);
#   - no memory segment is left behind (memfds: nothing in /dev/shm to look for; the agents exit).
# Then H (two agents, no spare): node 1's own copies of step 17 fail their checksum; after rank 2
# fails, each rank there restores from the partner's copy (the next source), not the file tier.
# Usage: test_memory_partner.sh path/to/elastrun path/to/elastrun-ckpt SOURCE_DIR
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1 tool=$2 source_dir=$3
train=$source_dir/examples/python/train.py
sandbox --tmpdir
out=$SANDBOX
show_on_failure 60 "$out/*.log"
export OMP_NUM_THREADS=1
unset_env '^(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_ADDR|MASTER_PORT|ELASTRUN_.*|TORCHELASTIC_.*|SLURM_.*|PET_.*)$'
export ELASTRUN_PYTHON=/usr/bin/python3
steps=(--steps 40 --ckpt-every 10 --keep-last 0)

# A: the failure-free reference, world 1, no agent
timeout 300 /usr/bin/python3 "$train" "${steps[@]}" --ckpt-dir "$out/a" >"$out/a.log" 2>&1 || fail "A exited $?"

port=$(free_port)
agent() {  # agent NAME NODE_RANK: one agent in the background (pid in pid_NAME)
  local name=$1 node_rank=$2
  "$elastrun" --nnodes=2 --nproc-per-node=2 --rdzv-endpoint=127.0.0.1:$port --rdzv-id=partner \
    --rdzv-conf=is_host=$((node_rank == 0 ? 1 : 0)),last_call_timeout=1 --node-rank="$node_rank" \
    --max-restarts=1 --memory-checkpoints=16M --monitor-interval=0.1 --events "$out/$name.events" \
    "$train" "${steps[@]}" --memory-every 1 --step-ms 150 --ckpt-dir "$out/p" >"$out/$name.log" 2>&1 &
  printf -v "pid_$name" '%s' "$!"
  track_pid "$!"
}
agent n0 0
agent n1 1
wait_for -i 0.2 60 grep -q "round 1 formed" "$out/n0.log" || fail "no round formed"
agent spare 2
reached() { /usr/bin/python3 -c '
import sys, elastrun.events
steps = [e["step"] for e in elastrun.events.read([sys.argv[1]]) if e["event"] == "step"]
sys.exit(0 if steps and max(steps) >= 17 else 1)' "$out/n0.events"; }
wait_for -i 0.2 -a "$pid_n0" "agent n0 exited early" 120 reached || fail "training did not reach step 17"
grep -q "partner copies served on 127.0.0.1:" "$out/n1.log" || fail "agent n1 serves no partner copies"
address=@$(sed -n 's/.*node endpoint @\([^ ]*\).*/\1/p' "$out/n1.log" | head -1)
"$elastrun" node-status "$address" >"$out/n1.status" 2>&1 || fail "node-status of n1: $(cat "$out/n1.status")"
/usr/bin/python3 - "$out/n1.status" <<'PY' || fail "n1's status does not show partner copies both ways: $(cat "$out/n1.status")"
import json, sys
copies = json.load(open(sys.argv[1]))["memory_checkpoints"]["partner_copies"]
assert copies["sent"] > 0 and copies["received"] > 0 and copies["send_failures"] == 0, copies
PY
kill -9 "$pid_n1"
await "$pid_n1" || true
rc=0
wait_for 180 exited "$pid_n0" "$pid_spare" || fail "the job did not finish after the loss"
await "$pid_n0" || rc=$?
((rc == 0)) || fail "agent n0 exited $rc"
await "$pid_spare" || rc=$?
((rc == 0)) || fail "the spare's agent exited $rc"

grep -Eq "memory checkpoints: step [0-9]+ \(world 4\) for this node's ranks: rank 2 from 127\.0\.0\.1:[0-9]+, rank 3 from 127\.0\.0\.1:[0-9]+" \
  "$out/spare.log" || fail "the spare did not fetch ranks 2 and 3 from a peer"
for r in 0 1; do
  grep -Eq "\[rank $r\] elastrun\.checkpoint: rank $r restored step [0-9]+ from the agents' memory: rank $r's snapshot, written on this node" \
    "$out/n0.log" || fail "rank $r: no line saying where its snapshot came from"
done
for r in 2 3; do
  grep -Eq "\[rank $r\] elastrun\.checkpoint: rank $r restored step [0-9]+ from the agents' memory: rank $r's snapshot, copied from a peer agent" \
    "$out/spare.log" || fail "rank $r: not restored from a copy fetched from a peer"
done
/usr/bin/python3 - "$out/n0.events" <<'PY' || fail "the events"
import sys
import elastrun.events
events = elastrun.events.read([sys.argv[1]])
resumed = [i for i, e in enumerate(events) if e["event"] == "resumed"]
assert len(resumed) == 1, [events[i] for i in resumed]
r = events[resumed[0]]
assert r["source"] == "memory-partner" and r["world_size"] == 4 and r["saved_world_size"] == 4, r
reached = max(e["step"] for e in events[:resumed[0]] if e["event"] == "step")
assert reached - r["step"] <= 2, f"resumed at step {r['step']}, {reached} reached: more than 2 steps lost"
print(f"resumed from step {r['step']} in the agents' memory (partner copies); {reached} reached: "
      f"{reached - r['step']} step(s) lost")
PY
same_model "$tool" "$out/a" "$out/p" "$out/diff.log" 40
echo "ok: node 1 lost -> the spare fetched ranks 2-3 from its partner's copies; resumed from memory; $MAX_DELTA" \
  "vs the failure-free run"

# H: a copy that fails its checksum -- the next source is the partner's copy. Two agents; node 1's
# agent flips a byte of each of its own snapshots of step 17 once they are sent to its partner
# (ELASTRUN_TEST_FLIP_MEMORY_STEP, tests only); rank 2 fails after step 17: the restart finds node
# 1's copies bad and restores step 17 from node 0's copies, not from the file tier (step 10)
port=$(free_port)
for n in 0 1; do
  flip=()
  ((n == 0)) || flip=(ELASTRUN_TEST_FLIP_MEMORY_STEP=17)
  env "${flip[@]}" "$elastrun" --nnodes=2 --nproc-per-node=2 \
    --rdzv-endpoint=127.0.0.1:$port --rdzv-id=hash --rdzv-conf=is_host=$((1 - n)) --node-rank=$n --max-restarts=1 \
    --memory-checkpoints=16M --events "$out/h$n.events" "$train" "${steps[@]}" --memory-every 1 --ckpt-dir "$out/h" \
    --fail-at-step 17:2 >"$out/h$n.log" 2>&1 &
  printf -v "pid_h$n" '%s' "$!"
  track_pid "$!"
done
rc=0
await "$pid_h0" || rc=$?
await "$pid_h1" || rc=$((rc + $?))
((rc == 0)) || fail "H: the agents exited $rc"
grep -q "flipped a byte of step 17 rank 2 here" "$out/h1.log" || fail "H: node 1 did not flip its copy of step 17"
for r in 2 3; do
  grep -q "\[rank $r\] elastrun.checkpoint: rank $r: the memory snapshot of step 17 rank $r fails its checksum: asking a peer agent" \
    "$out/h1.log" || fail "H: rank $r did not find its copy bad"
  grep -q "memory checkpoints: step 17 rank $r held here failed its checksum: fetched again from 127.0.0.1:" "$out/h1.log" ||
    fail "H: node 1's agent did not fetch rank $r's copy again"
done
/usr/bin/python3 - "$out/h0.events" <<'PY' || fail "H's events"
import sys
import elastrun.events
resumed = [e for e in elastrun.events.read([sys.argv[1]]) if e["event"] == "resumed"]
assert [(e["step"], e["source"]) for e in resumed] == [(17, "memory-partner")], resumed
PY
same_model "$tool" "$out/a" "$out/h" "$out/diff-h.log" 40
echo "ok: copies that failed their checksum were replaced by the partner's: resumed from step 17 in memory;" \
  "$MAX_DELTA vs the failure-free run"
