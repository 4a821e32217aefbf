#!/usr/bin/env bash
# shellcheck disable=SC2016 # $VARS in single quotes are expanded by the remote task
# Smoke test against the shared ctest testbed (fixture "testbed"): 4 nodes answer, srun spreads 8 ranks
# over n1..n4, PMIx and heterogeneous steps launch. Other tests may use the cluster at the same time,
# so nodes may be mixed/allocated; the sruns ask for --oversubscribe and may still queue for a while.
# Environment: ELASTRUN_TESTBED (path of the testbed script), TESTBED_ID (of the shared testbed).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
on_failure '"$TB" status >&2 || true'

eval "$("$TB" env)"
[[ -r $SLURM_CONF ]] || fail "testbed '$TESTBED_ID' is not up ($SLURM_CONF missing); run the testbed_up fixture"

# 1. four nodes, none down/drained
nodes=$(sinfo -h -N -o '%N %T') || fail "sinfo failed"
echo "$nodes"
[[ $(wc -l <<<"$nodes") -eq 4 ]] || fail "expected 4 nodes, got: $nodes"
if grep -Eiq 'down|drain|fail|\*' <<<"$nodes"; then fail "a node is not in service: $nodes"; fi

# 2. srun -N4 -n8: ranks 0..7, two per node, every node n1..n4
out=$(timeout 300 srun --oversubscribe -N4 -n8 --ntasks-per-node=2 bash -c 'echo "$SLURM_PROCID $SLURMD_NODENAME"') ||
  fail "srun -N4 -n8 failed (rc $?)"
echo "$out"
[[ $(cut -d' ' -f1 <<<"$out" | sort -n | tr '\n' ' ') == "0 1 2 3 4 5 6 7 " ]] ||
  fail "srun -N4 -n8 ranks wrong: $out"
[[ $(cut -d' ' -f2 <<<"$out" | sort | uniq -c | awk '{ print $2 "=" $1 }' | tr '\n' ' ') == \
  "n1=2 n2=2 n3=2 n4=2 " ]] || fail "srun -N4 -n8 did not put 2 tasks on each of n1..n4: $out"

# 3. PMIx wire-up across 2 nodes
out=$(timeout 300 srun --oversubscribe -N2 -n4 --mpi=pmix bash -c 'echo "$PMIX_RANK"') || fail "srun --mpi=pmix failed (rc $?)"
[[ $(sort -n <<<"$out" | tr '\n' ' ') == "0 1 2 3 " ]] || fail "PMIX_RANK not 0..3: $out"

# 4. heterogeneous step: two components, global SLURM_PROCID
out=$(timeout 300 srun --oversubscribe -N1 -n1 : --oversubscribe -N2 -n2 bash -c 'echo "$SLURM_PROCID $SLURM_HET_SIZE"') ||
  fail "het srun failed (rc $?)"
[[ $(sort -n <<<"$out" | tr '\n' ' ') == "0 2 1 2 2 2 " ]] || fail "het step output wrong: $out"

echo "PASS: testbed '$TESTBED_ID' smoke"
