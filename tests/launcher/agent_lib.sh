# What every test_agent_*.sh shares: the agent in standalone mode (no Slurm) with real worker
# processes (tests/launcher/test_worker.cpp, which writes its environment to $work/out/rank<R>.gen<G>.json
# and its pid to $work/out/pids/). Sourced after tests/support/lib.sh; the file's arguments are
# path/to/elastrun path/to/launcher_test_worker. test_setup (before each case) ends the workers
# an earlier case left and empties $work/out.
elastrun=$1
worker=$2
# Agents keep per-run files under $TMPDIR (the agents' error-file dirs); an agent killed with -9
# cannot remove them. No test leaves a worker behind: at exit, whatever recorded pid is still one of
# ours (checked) is killed.
worker_sandbox launcher_test_worker
work=$SANDBOX
show_on_failure 40 "$work/stdout" "$work/stderr"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
unset_env '^(SLURM_|PET_|PMI_|PMIX_|OMPI_)'

alive_workers() { alive_recorded_pids "$work/out/pids" launcher_test_worker; } # workers that still run
no_alive_workers() { [[ -z $(alive_workers) ]]; }
# agent_pair ARGS_A... -- ARGS_B...: agent a in the background and agent b, output in $work/a.out,
# a.err, b.out, b.err; sets rc_a and rc_b once both exited; $work/stderr gets both stderrs (for fail)
agent_pair() {
  local args_a=() pid
  while [[ $1 != -- ]]; do args_a+=("$1"); shift; done
  shift
  "$elastrun" "${args_a[@]}" >"$work/a.out" 2>"$work/a.err" &
  pid=$!
  track_pid "$pid"
  "$elastrun" "$@" >"$work/b.out" 2>"$work/b.err"
  rc_b=$?
  await "$pid"; rc_a=$?
  cat "$work/a.err" "$work/b.err" >"$work/stderr"
}
test_setup() { # a case's workers never meet the next case's: ended, then forgotten
  kill_recorded_pids "$work/out/pids" launcher_test_worker
  rm -rf "${work:?}"/out/* "$work/stdout" "$work/stderr"
}
