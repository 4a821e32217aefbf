#!/usr/bin/env bash
# elastrun --preload=torch (docs/launcher.md, "Preloaded workers"): Python workers forked by one
# preloader per node that imported torch once, compared with the same workers started fresh.
# Usage: test_agent_preload.sh path/to/elastrun  (TEST_ONLY=WORDS: one case; exit 77 without torch)
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
elastrun=$1
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
script=$here/preload/preload_worker.py
export ELASTRUN_PYTHON=${ELASTRUN_TEST_PYTHON:-/usr/bin/python3}
"$ELASTRUN_PYTHON" -c 'import torch.distributed' 2>/dev/null || skip "$ELASTRUN_PYTHON has no torch"
ours="preload_worker|--preload=MODULES"  # a preloaded worker has the preloader's command line
worker_sandbox "$ours"
work=$SANDBOX
show_on_failure 40 "$work/stdout" "$work/stderr"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID OMP_NUM_THREADS
unset_env '^(SLURM_|PET_|PMI_|PMIX_|OMPI_)'
test_setup() {
  kill_recorded_pids "$work/out/pids" "$ours"
  rm -rf "${work:?}"/out/* "$work/stdout" "$work/stderr" "$work"/*.log
}
# run NAME ARGS...: elastrun --standalone --nproc-per-node 2 ARGS... preload_worker.py a b, as run NAME
run() {
  local name=$1
  shift
  PRELOAD_TEST_RUN=$name "$elastrun" --standalone --nproc-per-node 2 --monitor-interval 0.05 "$@" "$script" a b \
    >"$work/$name.log" 2>&1
}
preloader_pid() { sed -n 's/.*the preloader (pid \([0-9]*\)) imported.*/\1/p' "$1" | head -1; }

test_expect_success 'same: the workers see what fresh interpreters see (ranks, argv, sys.path[0], threads, RNGs)' <<'CASE'
run plain || fail "plain run exited $?: $(tail -5 "$work/plain.log")"
run preload --preload=torch || fail "preloaded run exited $?: $(tail -5 "$work/preload.log")"
pre=$(preloader_pid "$work/preload.log")
[[ -n $pre ]] || fail "no preloader line: $(cat "$work/preload.log")"
/usr/bin/python3 - "$work/out" "$script" "$pre" <<'PY' || fail "preloaded workers differ from fresh ones"
import glob, json, os, sys
out, script, pre = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(run):
    return {json.load(open(f))["env"]["RANK"]: json.load(open(f)) for f in glob.glob(f"{out}/preload.{run}.rank*.json")}
plain, preload = load("plain"), load("preload")
assert sorted(plain) == sorted(preload) == ["0", "1"], (plain.keys(), preload.keys())
for rank in ("0", "1"):
    a, b = plain[rank], preload[rank]
    assert a["env"] == b["env"], (a["env"], b["env"])
    assert a["env_keys"] == b["env_keys"], set(a["env_keys"]) ^ set(b["env_keys"])
    assert a["argv"] == b["argv"] == [script, "a", "b"], (a["argv"], b["argv"])
    assert a["path0"] == b["path0"] == os.path.dirname(os.path.realpath(script)), (a["path0"], b["path0"])
    assert a["helper"] == b["helper"] == 42
    assert a["torch_threads"] == b["torch_threads"] == 1, (a["torch_threads"], b["torch_threads"])  # OMP_NUM_THREADS=1
    assert b["pgid"] == b["pid"], "a preloaded worker leads its own process group"
    assert a["sig_blocked"] == b["sig_blocked"] == "0000000000000000", (a["sig_blocked"], b["sig_blocked"])
    assert a["sig_handlers"] == b["sig_handlers"], (a["sig_handlers"], b["sig_handlers"])
    assert b["store_waits"] and not a["store_waits"], "preloaded: the c10d store client waits for rank 0's store"
    assert b["ppid"] == pre, f"rank {rank}: parent {b['ppid']}, not the preloader {pre}"
# torch's default generator as fresh interpreters have it: one fixed seed (upstream builds) or a
# random one per process (Debian's)
fixed = plain["0"]["torch_seed"] == plain["1"]["torch_seed"]
assert (preload["0"]["torch_seed"] == preload["1"]["torch_seed"]) == fixed, (plain, preload)
if fixed:
    assert preload["0"]["torch_seed"] == plain["0"]["torch_seed"] and preload["0"]["torch_draw"] == plain["0"]["torch_draw"]
else:
    assert preload["0"]["torch_draw"] != preload["1"]["torch_draw"], "torch: the same draws on two ranks"
for run in (plain, preload):
    assert run["0"]["random_draw"] != run["1"]["random_draw"], "random: the same draws on two ranks"
    if run["0"]["numpy_draw"] is not None:
        assert run["0"]["numpy_draw"] != run["1"]["numpy_draw"], "numpy: the same draws on two ranks"
assert preload["0"]["numpy_draw"] != plain["0"]["numpy_draw"] or preload["0"]["numpy_draw"] is None
print("ok: the same ranks, environment, argv, sys.path[0], torch threads and seeds; distinct random/numpy draws")
PY
grep -q "all-reduce ok" "$work/preload.log" || fail "no all-reduce under --preload"
[[ -z $(alive_recorded_pids "$work/out/pids" "$ours") ]] || fail "workers left"
kill -0 "$pre" 2>/dev/null && fail "the preloader outlived the job"
echo "ok: preloaded workers match fresh ones"
CASE

test_expect_success 'module: -m preload_worker runs as under python -m (argv[0], sys.path[0], environment)' <<'CASE'
for kind in plain preload; do
  flags=()
  [[ $kind == preload ]] && flags=(--preload=torch)
  (cd "$here/preload" && PYTHONDONTWRITEBYTECODE=1 PRELOAD_TEST_RUN=m$kind "$elastrun" --standalone --nproc-per-node 2 \
    "${flags[@]}" -m preload_worker a b >"$work/m$kind.log" 2>&1) || fail "-m, $kind: exit $?: $(tail -5 "$work/m$kind.log")"
done
pre=$(preloader_pid "$work/mpreload.log")
[[ -n $pre ]] || fail "no preloader line: $(cat "$work/mpreload.log")"
/usr/bin/python3 - "$work/out" "$script" "$pre" <<'PY' || fail "-m under --preload differs from python -m"
import glob, json, os, sys
out, script, pre = sys.argv[1], sys.argv[2], int(sys.argv[3])
def load(run):
    return {json.load(open(f))["env"]["RANK"]: json.load(open(f)) for f in glob.glob(f"{out}/preload.{run}.rank*.json")}
plain, preload = load("mplain"), load("mpreload")
assert sorted(plain) == sorted(preload) == ["0", "1"], (plain.keys(), preload.keys())
for rank in ("0", "1"):
    a, b = plain[rank], preload[rank]
    assert a["env"] == b["env"], (a["env"], b["env"])
    assert a["argv"] == b["argv"] and a["argv"][1:] == ["a", "b"], (a["argv"], b["argv"])
    assert os.path.realpath(b["argv"][0]) == os.path.realpath(script), b["argv"]
    assert os.path.realpath(a["path0"]) == os.path.realpath(b["path0"]) == os.path.dirname(os.path.realpath(script)), (a["path0"], b["path0"])
    assert b["ppid"] == pre, f"rank {rank}: parent {b['ppid']}, not the preloader {pre}"
print("ok: -m: the same argv, sys.path[0] and environment, forked by the preloader")
PY
CASE

test_expect_success 'restart: rank 1 exits 3 once: both restart through the same preloader, RESTART_COUNT=1' <<'CASE'
PRELOAD_TEST_MODE=crash_once run crash --preload=torch --max-restarts 1 || fail "exit $?: $(tail -5 "$work/crash.log")"
pre=$(preloader_pid "$work/crash.log")
/usr/bin/python3 - "$work/out" "$pre" <<'PY' || fail "the restart"
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/preload.crash.rank*.json")]
second = [r for r in runs if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"]
assert sorted(r["env"]["RANK"] for r in second) == ["0", "1"], runs
assert {r["ppid"] for r in runs} == {int(sys.argv[2])}, "not every attempt was forked by the one preloader"
print("ok: the restart was forked by the same preloader")
PY
[[ $(grep -c "imported torch" "$work/crash.log") -eq 1 ]] || fail "torch imported more than once"
grep -q "state RESTART restart 1 of 1" "$work/crash.log" || fail "no RESTART"
CASE

test_expect_success 'spares: a restart after the workers ran a while is handed to forks made before it; none left after' <<'CASE'
PRELOAD_TEST_MODE=crash_late run late --preload=torch --max-restarts 1 || fail "exit $?: $(tail -5 "$work/late.log")"
pre=$(preloader_pid "$work/late.log")
/usr/bin/python3 - "$work/out" "$pre" <<'PY' || fail "the restart did not use the spares"
import glob, json, sys
runs = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/preload.late.rank*.json")]
first = [r for r in runs if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "0"]
second = [r for r in runs if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"]
assert sorted(r["env"]["RANK"] for r in second) == ["0", "1"], runs
assert {r["ppid"] for r in runs} == {int(sys.argv[2])}, "not every worker is the preloader's child"
assert all(r["age_s"] < 1.0 for r in first), [r["age_s"] for r in first]  # forked on the order
assert all(r["age_s"] >= 1.0 for r in second), [r["age_s"] for r in second]  # spares, forked before
assert second[0]["random_draw"] != second[1]["random_draw"], "two spares share random's state"
print(f"ok: the restarted workers were spares {[round(r['age_s'], 2) for r in second]} s old")
PY
left() {
  local p
  for p in $(pgrep -f -- '--preload=MODULES'); do
    tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "TEST_WORKER_OUT_DIR=$work/out" && echo "$p"
  done
  return 0
}
wait_for 10 eval '[[ -z $(left) ]]' || fail "processes of the preloader left after the agent ended: $(left)"
CASE

test_expect_success 'exits: sys.exit(7) and an uncaught exception end the run as under plain python' <<'CASE'
for mode in exit7 raise; do
  PRELOAD_TEST_MODE=$mode run "$mode-plain"
  rc_plain=$?
  PRELOAD_TEST_MODE=$mode run "$mode-preload" --preload=torch
  rc_pre=$?
  [[ $rc_plain -eq 1 && $rc_pre -eq 1 ]] || fail "$mode: agent exits $rc_plain (plain) / $rc_pre (preload), expected 1"
  want="exited with code 7"
  [[ $mode == raise ]] && want="exited with code 1"
  for log in "$work/$mode-plain.log" "$work/$mode-preload.log"; do
    grep -q "state FAILED rank 0 .*$want" "$log" || fail "$mode: no '$want' in $log: $(grep FAILED "$log")"
  done
  if [[ $mode == raise ]]; then
    for log in "$work/raise-plain.log" "$work/raise-preload.log"; do
      grep -q "^\[rank 0\].*ValueError: boom on purpose" "$log" || fail "no traceback in $log"
      grep -q "^\[rank 0\].*Traceback (most recent call last)" "$log" || fail "no traceback in $log"
    done
  fi
done
echo "ok: exit codes and tracebacks as under plain python"
CASE

test_expect_success 'kill -9 of the agent leaves no preloader and no worker (and Slurm'"'"'s step signals do not end the preloader)' <<'CASE'
PRELOAD_TEST_MODE=sleep PRELOAD_TEST_RUN=k "$elastrun" --standalone --nproc-per-node 2 --preload=torch "$script" \
  >"$work/k.log" 2>&1 &
agent=$!
track_pid "$agent"
wait_for -a "$agent" "the agent exited early" 60 have_files 2 "$work/out/preload.k.rank*.json" || fail "no workers"
pre=$(preloader_pid "$work/k.log")
[[ -n $pre ]] && kill -0 "$pre" || fail "no live preloader"
# Slurm's --signal, scancel and preemption signal every process of the step: the preloader too
for sig in USR1 USR2 TERM HUP INT; do kill -s "$sig" "$pre"; done
sleep 0.5
kill -0 "$pre" 2>/dev/null || fail "the preloader died of a step signal: $(tail -3 "$work/k.log")"
kill -9 "$agent"
await "$agent"
wait_for 10 eval '! kill -0 '"$pre"' 2>/dev/null' || fail "the preloader $pre survived the agent"
wait_for 10 eval '[[ -z $(alive_recorded_pids "$work/out/pids" "$ours") ]]' || fail "workers survived the agent"
echo "ok: nothing left after kill -9 of the agent"
CASE

test_expect_success 'preloader killed: started again once, then the workers are exec'"'"'d, with a warning each time' <<'CASE'
PRELOAD_TEST_MODE=sleep_twice PRELOAD_TEST_RUN=d "$elastrun" --standalone --nproc-per-node 2 --preload=torch \
  --max-restarts 3 --monitor-interval 0.05 "$script" >"$work/d.log" 2>&1 &
agent=$!
track_pid "$agent"
attempt_started() {  # ATTEMPT: both workers of that restart count wrote their record
  (($(grep -l "\"TORCHELASTIC_RESTART_COUNT\": \"$1\"" "$work"/out/preload.d.rank*.json 2>/dev/null | wc -l) == 2))
}
for attempt in 0 1; do
  wait_for -a "$agent" "the agent exited early: $(tail -3 "$work/d.log")" 120 attempt_started "$attempt" ||
    fail "attempt $attempt did not start: $(tail -5 "$work/d.log")"
  pre=$(grep -o 'the preloader (pid [0-9]*) imported' "$work/d.log" | tail -1 | grep -o '[0-9]*')
  kill -9 "$pre" || fail "no preloader $pre to kill"
done
await "$agent" || fail "the agent exited $?: $(tail -5 "$work/d.log")"
untrack_pid "$agent"
(($(grep -c 'imported torch' "$work/d.log") == 2)) || fail "not exactly one restart of the preloader"
grep -q 'ended (signal 9): starting another for the next workers' "$work/d.log" || fail "no warning for the first loss"
grep -q 'ended (signal 9): starting workers without it from now on' "$work/d.log" || fail "no warning for the second"
/usr/bin/python3 - "$work/out" "$agent" <<'PY' || fail "the third attempt was not exec'd by the agent"
import glob, json, sys
third = [json.load(open(f)) for f in glob.glob(sys.argv[1] + "/preload.d.rank*.json")]
third = [r for r in third if r["env"]["TORCHELASTIC_RESTART_COUNT"] == "2"]
assert len(third) == 2 and all(r["ppid"] == int(sys.argv[2]) for r in third), third
print("ok: the preloader was started again once; after its second loss the agent exec'd the workers")
PY
CASE

test_expect_success 'not python: --preload is ignored with a note for a program that is not a Python script' <<'CASE'
"$elastrun" --standalone --preload=torch /bin/true >"$work/stdout" 2>"$work/stderr" || fail "exit $?"
grep -q "note: --preload=torch applies to Python workers only" "$work/stderr" || fail "no note: $(cat "$work/stderr")"
CASE

test_done
