#!/usr/bin/env bash
# Scale-up on a private 5-node testbed (docs/launcher.md, "Adding nodes"):
#  1. salloc --no-kill -N4; step 0: srun --no-kill -N4 elastrun --nnodes=2:4 --nproc-per-node=2
#     (zero rendezvous flags) -> 8 workers;
#  2. kill-node n3 -> the survivors n1 n2 n4 re-form: WORLD_SIZE 6 (no restart counted);
#     slurmctld removes n3 from the job: after revive-node n3, a step on n3 is refused;
#  3. a late agent on the revived n3, started in an allocation of its own (a new job, `srun -N1
#     -w n3 elastrun ... --rdzv-endpoint=<step 0's endpoint> --rdzv-id=<step 0's run id>
#     --node-rank=4`), waits in the wait list; the running agents re-form a 4-node round:
#     WORLD_SIZE 8 on n1 n2 n4 n3 (n3 last, by its --node-rank), then everybody finishes (exit 0);
#  4. spare from the start: srun --no-kill -N5 elastrun --nnodes=2:4 (zero flags): four agents run,
#     the fifth waits; kill-node of a running node -> the spare takes its place (WORLD_SIZE 8 again).
# Workers (launcher_test_worker) record their environment, then wait for a release file that
# the test creates only once the final 8-worker round runs.
# Usage: test_scaleup_slurm.sh path/to/launcher_test_worker
# Environment: ELASTRUN_TESTBED, TESTBED_ID (the shared id; this test uses <id>-scaleup),
# ELASTRUN_BIN (build/bin).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
worker=$1

if [[ ${2:-} == --in-allocation ]]; then
  # ---- inside `salloc --no-kill -N4` (SLURM_JOB_NODELIST=n[1-4] for every step) ---------------
  out=$3
  wrapper=$out/worker.sh
  # the recorded port of step 0 (zero flags): 24000 + (job id * 32 + step id 0) mod 8000
  port=$((24000 + (SLURM_JOB_ID * 32) % 8000))
  common=(--nnodes=2:4 --nproc-per-node=2 --rdzv-conf heartbeat_timeout=2)
  srun --no-kill -N4 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" "${common[@]}" "$wrapper" \
    >"$out/step0.log" 2>&1 &
  step0=$!
  track_pid "$step0"
  step0_waits() {  # step0_waits WHAT SECONDS COMMAND...: fails with WHAT after SECONDS or if step 0 ends
    local what=$1
    shift
    wait_for -i 0.3 -a "$step0" "step 0 ended early ($what)" "$@" || fail "$what"
  }
  ge() { have_files "$2" "$out/rank*.$1.json"; } # ge w6 6: at least 6 workers saw WORLD_SIZE 6
  step0_waits "8 workers did not start" 120 ge w8 8
  grep -q "hosting the rendezvous store on port $port" "$out/step0.log" ||
    fail "step 0's store is not on the documented port $port: $(grep -m1 'hosting' "$out/step0.log")"
  echo "8 workers on n1..n4; store on n1:$port"

  "$TB" kill-node n3
  step0_waits "the survivors did not re-form with WORLD_SIZE 6" 120 ge w6 6
  echo "kill-node n3 -> 6 workers on n1 n2 n4"

  # Once Slurm has marked n3 down it removes n3 from the job (--no-kill keeps the job); a revived
  # n3 is then idle and outside the allocation: a step on it is refused.
  "$TB" wait-node n3 down 90
  n3_dropped() { [[ $(scontrol show job "$SLURM_JOB_ID" | grep -o ' NodeList=[^ ]*') == " NodeList=n[1-2,4]" ]]; }
  wait_for 60 n3_dropped ||
    fail "slurmctld did not drop n3 from the job: $(scontrol show job "$SLURM_JOB_ID" | grep ' NodeList=')"
  "$TB" revive-node n3
  if timeout 20 srun --no-kill -N1 -w n3 true >"$out/n3.log" 2>&1; then
    fail "a step on the revived n3 was accepted: the job should no longer own n3"
  fi
  echo "n3 revived; a step on it is refused: $(grep -m1 error "$out/n3.log" || head -1 "$out/n3.log")"

  # The late agent on the revived n3, in a job of its own: no SLURM_* of this allocation may
  # leak into that srun (it would make it a step of this job), except the testbed's SLURM_CONF.
  # Its Slurm node index (0 in its own job) says nothing here: --node-rank=4 places it last.
  run_id="$SLURM_JOB_ID.r${SLURM_RESTART_COUNT:-0}"
  six_gen=$(ls "$out"/rank*.w6.json | sed 's/.*\.gen\([0-9]*\)\.w6\.json/\1/' | sort -n | tail -1)
  (
    unset_env '^SLURM_' SLURM_CONF
    exec srun --no-kill -N1 -w n3 -J late-agent "$ELASTRUN_BIN/elastrun" "${common[@]}" \
      --rdzv-endpoint="n1:$port" --rdzv-id="$run_id" --node-rank=4 "$wrapper"
  ) >"$out/late.log" 2>&1 &
  late=$!
  track_pid "$late"
  # a complete 8-worker round after the 6-worker one, n3 in it
  final_gen=
  final8() {
    local g
    for f in "$out"/rank*.w8.json; do
      [[ -e $f ]] || continue
      g=${f##*.gen}; g=${g%%.*}
      ((g > six_gen)) || continue
      (($(ls "$out"/rank*.gen"$g".w8.json | wc -l) >= 8)) || continue
      grep -l '"ELASTRUN_NODE":"n3"' "$out"/rank*.gen"$g".w8.json | grep -q . || continue
      final_gen=$g
      return 0
    done
    return 1
  }
  step0_waits "the late agent on the revived n3 was not admitted into an 8-worker round" 120 final8
  late_job=$(squeue -h -n late-agent -o %i | head -1)
  [[ -n $late_job && $late_job != "$SLURM_JOB_ID" ]] || fail "the late agent is not in a job of its own ('$late_job')"
  echo "late agent on the revived n3 (job $late_job) admitted: generation $final_gen has 8 workers"
  touch "$out/release"

  wait_for -i 0.3 120 have_lines 4 "done; exiting 0" "$out/step0.log" "$out/late.log" || fail "the 4 agents did not all finish"
  await "$late" || fail "the late agent's job exited $?"
  await "$step0" || true  # srun reports the lost n3's task as failed
  exit 0
fi

# ---- outside: a private testbed with 5 nodes ------------------------------------------------
sandbox --tmpdir  # TMPDIR: the agents' per-run files
out=$SANDBOX
show_on_failure 60 "$out/*.log" "$out/spare/*.log"
private_testbed_up 5
export ELASTRUN_TESTBED=$TB

# each worker records its environment (file name also tagged with its world size), then waits
# for the release file; srun passes TEST_WORKER_OUT_DIR on
cat >"$out/worker.sh" <<EOF
#!/bin/sh
d=\$TEST_WORKER_OUT_DIR
"$worker" >/dev/null || exit 1
cp "\$d/rank\$RANK.gen\$ELASTRUN_GENERATION.json" "\$d/rank\$RANK.gen\$ELASTRUN_GENERATION.w\$WORLD_SIZE.json"
while [ ! -e "\$d/release" ]; do sleep 0.2; done
EOF
chmod 755 "$out/worker.sh"
export TEST_WORKER_OUT_DIR=$out

start=$SECONDS
timeout 500 salloc --no-kill -N4 -w 'n[1-4]' "$0" "$worker" --in-allocation "$out" >"$out/salloc.log" 2>&1 &
track_pid $!
await $! || { cat "$out/salloc.log" >&2; fail "the allocation's driver failed"; }
cat "$out/salloc.log"
echo "scale-up scenario: $((SECONDS - start)) s"

/usr/bin/python3 - "$out" <<'PY'
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.w*.json")]
by_gen = {}
for r in runs:
    by_gen.setdefault(int(r["ELASTRUN_GENERATION"]), []).append(r)
gens = sorted(by_gen)
def check(rs, size, order):
    assert sorted(int(r["RANK"]) for r in rs) == list(range(size)), rs
    for r in rs:
        assert r["WORLD_SIZE"] == str(size) and r["ELASTRUN_NODE"] == order[int(r["RANK"]) // 2], r
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0", r  # membership changes cost no restart
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"], r["TORCHELASTIC_RUN_ID"]) for r in rs}) == 1, rs
first, last = by_gen[gens[0]], by_gen[gens[-1]]
check(first, 8, ["n1", "n2", "n3", "n4"])
six = [g for g in gens if all(r["WORLD_SIZE"] == "6" for r in by_gen[g]) and len(by_gen[g]) == 6]
assert six, f"no complete 6-worker round: {gens}"
check(by_gen[six[-1]], 6, ["n1", "n2", "n4"])
check(last, 8, ["n1", "n2", "n4", "n3"])
assert gens[0] < six[-1] < gens[-1], gens
print(f"ok: generation {gens[0]}: 8 workers n1-n4; {six[-1]}: 6 workers n1 n2 n4; "
      f"{gens[-1]}: 8 workers n1 n2 n4 n3 (late agent, own job); one run id {last[0]['TORCHELASTIC_RUN_ID']}")
PY
grep -q "state MEMBERSHIP_CHANGED member lost" "$out/step0.log" || fail "no MEMBERSHIP_CHANGED (member lost)"
grep -q "state MEMBERSHIP_CHANGED member waiting" "$out/step0.log" || fail "no MEMBERSHIP_CHANGED (member waiting)"
grep -q "waiting for the next round" "$out/late.log" || fail "the late agent did not go through the wait list"
[[ $(grep -c "done; exiting 0" "$out/step0.log") -eq 3 ]] || fail "not every survivor exited 0"
grep -q "done; exiting 0" "$out/late.log" || fail "the late agent did not exit 0"
grep -hE "state (MEMBERSHIP_CHANGED|RENDEZVOUS round)|waiting for the next round|done; exiting" \
  "$out/step0.log" "$out/late.log" || true

# ---- spare agent from the start: srun -N5 elastrun --nnodes=2:4 (zero flags) ----------------
# Four agents form the round, the last to arrive waits; kill-node of a running node (not n1, the
# store's host) -> the spare takes its place at once: 8 workers again.
spare=$out/spare
mkdir -p "$spare"
export TEST_WORKER_OUT_DIR=$spare
srun --no-kill -N5 --ntasks-per-node=1 "$ELASTRUN_BIN/elastrun" --nnodes=2:4 --nproc-per-node=2 \
  --rdzv-conf heartbeat_timeout=2 "$out/worker.sh" >"$spare/spare.log" 2>&1 &
srun_pid=$!
track_pid "$srun_pid"
one_waits() { have_files 8 "$spare/rank*.w8.json" && grep -q "waiting for the next round" "$spare/spare.log"; }
wait_for -i 0.3 -a "$srun_pid" "srun -N5 ended early" 120 one_waits || fail "5 agents: no 8-worker round with one agent waiting"
waiting=$(grep -m1 "waiting for the next round" "$spare/spare.log" | sed 's/^\[elastrun node \([^]]*\)\].*/\1/')
victim=$(/usr/bin/python3 -c 'import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/rank*.w8.json")]
print(max(runs, key=lambda r: int(r["RANK"]))["ELASTRUN_NODE"])' "$spare")
echo "5 agents: 8 workers, $waiting waits; kill-node $victim"
"$TB" kill-node "$victim"
replaced() { grep -ls "\"ELASTRUN_NODE\":\"$waiting\"" "$spare"/rank*.w8.json >/dev/null 2>&1 && have_files 16 "$spare/rank*.w8.json"; }
wait_for -i 0.3 120 replaced || fail "the spare $waiting did not replace $victim"
touch "$spare/release"
wait_for -i 0.3 120 have_lines 4 "done; exiting 0" "$spare/spare.log" || fail "the 4 agents (with the spare) did not finish"
await "$srun_pid" || true  # the lost node's task counts as failed
/usr/bin/python3 - "$spare" "$waiting" "$victim" <<'PY'
import glob, json, sys
d, waiting, victim = sys.argv[1:]
runs = [json.load(open(f)) for f in glob.glob(d + "/rank*.w8.json")]
gens = sorted({int(r["ELASTRUN_GENERATION"]) for r in runs})
assert len(gens) == 2, gens
first = [r for r in runs if int(r["ELASTRUN_GENERATION"]) == gens[0]]
last = [r for r in runs if int(r["ELASTRUN_GENERATION"]) == gens[1]]
nodes = sorted(f"n{i}" for i in range(1, 6))
for rs, order in ((first, [n for n in nodes if n != waiting]), (last, [n for n in nodes if n != victim])):
    assert sorted(int(r["RANK"]) for r in rs) == list(range(8)), rs
    for r in rs:
        assert r["ELASTRUN_NODE"] == order[int(r["RANK"]) // 2] and r["TORCHELASTIC_RESTART_COUNT"] == "0", r
print(f"ok: spare {waiting} replaced {victim}: generation {gens[1]} has 8 workers on {' '.join(nodes[i] for i in range(5) if nodes[i] != victim)}")
PY
echo "ok: slurm.launcher_scaleup"
