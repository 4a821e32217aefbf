#!/usr/bin/env bash
# shellcheck disable=SC2016 # $VARS in single quotes are expanded by the remote task
# testbed partition / isolate / heal on a private 3-node testbed: a task on each node listens on a
# port of its own, and tasks on the other nodes connect to it. A partition cuts exactly the links
# between its two sides, both ways, while slurmctld still reaches every node; heal restores them;
# isolate --cut-controller also cuts a node from slurmctld (it stops responding); status shows the
# cuts; down removes the nftables table and the node cgroups.
# Environment: ELASTRUN_TESTBED (testbed script), TESTBED_ID (private id), optional
# ELASTRUN_SHARED_TESTBED_ID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
if why=$("$TB" check-partitions 2>&1); then :; else
  [[ ${CI:-} == true ]] && fail "network cuts cannot work here (CI=true: a missing prerequisite fails): $why"
  skip "$why"
fi
private_testbed --given-id --keep-on-failure
sandbox
cd "$SANDBOX"
remember_shared_testbed
testbed_up 3
eval "$("$TB" env)"
cluster=$(scontrol show config | awk '/^ClusterName/ {print $3}')

base=$(free_port)
base=$((base > 60000 ? base - 100 : base))
# a listener per node on base + node index (n1: base, n2: base+1, n3: base+2)
BASE=$base srun -N3 -n3 --no-kill /usr/bin/python3 -u -c '
import os, socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(os.environ["BASE"]) + int(os.environ["SLURM_NODEID"])))
s.listen(16)
print("listening", os.environ["SLURMD_NODENAME"], flush=True)
while True:
    c, _ = s.accept()
    c.sendall(os.environ["SLURMD_NODENAME"].encode())
    c.close()
' >listeners.out 2>&1 &
listeners=$!
track_pid "$listeners"
three_listening() { (($(grep -c '^listening' listeners.out) == 3)); }

# reach FROM TO: a task on FROM connects to TO's listener and reads its name (2 s at most)
reach() {
  local port=$((base + ${2#n} - 1))
  [[ $(timeout 20 srun -N1 -n1 -w "$1" /usr/bin/python3 -c '
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2)
    s.settimeout(2)
    print(s.recv(16).decode())
except OSError as e:
    print("cut:", e)
' "$port" 2>/dev/null) == "$2" ]]
}
expect() { # expect FROM TO ok|cut
  local got=cut
  reach "$1" "$2" && got=ok
  [[ $got == "$3" ]] || fail "$1 -> $2: $got (expected $3); cuts: $("$TB" status | grep cuts)"
}

test_expect_success 'every node reaches every other before any cut' <<'CASE'
  wait_for 60 three_listening || fail "listeners: $(cat listeners.out)"
  for a in n1 n2 n3; do for b in n1 n2 n3; do [[ $a == "$b" ]] || expect $a $b ok; done; done
CASE

test_expect_success 'partition n1 / n2,n3 cuts exactly those links, both ways; slurmctld still reaches all' <<'CASE'
  "$TB" partition n1 / n2,n3
  expect n2 n1 cut; expect n1 n2 cut; expect n3 n1 cut; expect n1 n3 cut
  expect n2 n3 ok; expect n3 n2 ok
  "$TB" status | grep -q 'cuts *n1<->n2, n1<->n3$' || fail "status: $("$TB" status)"
  # the login node and slurmctld are in no partition: srun to n1 itself still works
  [[ $(timeout 20 srun -N1 -n1 -w n1 hostname -s >/dev/null && echo ok) == ok ]] || fail "srun to n1 failed"
  sleep 12  # past SlurmdTimeout (10 s): slurmctld still hears from every node
  ! sinfo -h -N -o '%N %T' | grep -q '\*' || fail "a node stopped responding to slurmctld: $(sinfo -N)"
CASE

test_expect_success 'heal restores every link' <<'CASE'
  "$TB" heal
  expect n2 n1 ok; expect n1 n3 ok
  "$TB" status | grep -q 'cuts *none$' || fail "status after heal: $("$TB" status)"
CASE

test_expect_success 'isolate n2 --cut-controller: n2 alone, and slurmctld stops hearing from it' <<'CASE'
  "$TB" isolate n2 --cut-controller
  expect n2 n1 cut; expect n3 n2 cut; expect n1 n3 ok
  n2_silent() { [[ $(sinfo -h -n n2 -o %T) == *'*' ]]; }  # not responding (then down*, ~10 s)
  wait_for 90 n2_silent || fail "slurmctld still hears from n2: $(sinfo -N)"
  [[ $(sinfo -h -n n1 -o %T) != *'*' ]] || fail "n1 stopped responding too"
  "$TB" heal
  # ReturnToService=2: a node that was down for not responding comes back once it registers again
  n2_back() { [[ $(sinfo -h -n n2 -o %T) =~ ^(idle|mixed|allocated)$ ]]; }
  wait_for 120 n2_back || fail "n2 not back after heal: $(sinfo -N)"
CASE

test_expect_success 'bad input: one line each, exit 1' <<'CASE'
  for args in "partition n1 / n9" "partition n1,n2 / n2" "partition n1 n2" "isolate n7"; do
    rc=0
    # shellcheck disable=SC2086
    "$TB" $args >bad.txt 2>&1 || rc=$?
    ((rc != 0)) && (($(wc -l <bad.txt) == 1)) || fail "'$args': rc $rc: $(cat bad.txt)"
  done
CASE

test_expect_success 'down removes the table and the node cgroups' <<'CASE'
  stop_pid "$listeners"
  "$TB" down >/dev/null
  ! nft list tables 2>/dev/null | grep -q "etb_$cluster" || fail "table etb_$cluster left: $(nft list tables)"
  [[ ! -e /sys/fs/cgroup/unified/elastrun-testbed-$cluster ]] || fail "cgroups left"
CASE

check_shared_testbed
test_done
