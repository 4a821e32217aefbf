#!/usr/bin/env bash
# shellcheck disable=SC2016 # $VARS in single quotes are expanded by the remote task
# `testbed up --shared-fs` on a private 2-node testbed (TESTBED_ID must not be the shared one):
#   1. every node sees the GlusterFS volume at TESTBED_SHARED_FS through a FUSE mount of its own, in
#      a mount namespace of its own (not the login node's);
#   2. what one node writes, renames, appends or deletes, the other node (and the login node)
#      sees at once, bit-exact;
#   3. kill-node ends the node's mount client (and only that node's); after revive-node the node
#      mounts anew and reads what the other node wrote meanwhile;
#   4. down leaves no mount client, no mount, no volume and no brick of the testbed behind.
# Environment: ELASTRUN_TESTBED, TESTBED_ID (private id), optional ELASTRUN_SHARED_TESTBED_ID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
private_testbed --given-id --keep-on-failure
require_shared_fs --machine
remember_shared_testbed

t0=$SECONDS
testbed_up 2 --shared-fs
echo "up --shared-fs took $((SECONDS - t0)) s"
eval "$("$TB" env)"
[[ -n ${TESTBED_SHARED_FS:-} ]] || fail "'testbed env' printed no TESTBED_SHARED_FS"
fs=$TESTBED_SHARED_FS
dir=$("$TB" dir)
vol=$(cat "$dir/shared-fs")

# the mount clients (glusterfs FUSE daemons) of node $1 (n1, n2, login)
clients_of() {
  local p
  for p in $(grep -lzxF "ELASTRUN_TESTBED_NODE=$dir:$1" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
    [[ $(cat "/proc/$p/comm" 2>/dev/null) == glusterfs ]] && echo "$p"
  done
  return 0
}
on_node() { timeout 120 srun -N1 -n1 -w "$1" bash -c "$2"; }

# ---- 1. one mount per node ----------------------------------------------------------------------
mapfile -t views < <(timeout 120 srun -N2 -n2 bash -c \
  'echo "$SLURMD_NODENAME $(readlink /proc/self/ns/mnt) $(findmnt -n -o FSTYPE,SOURCE "$TESTBED_SHARED_FS" | tr -s " " ,)"' | sort)
printf '  %s\n' "${views[@]}"
((${#views[@]} == 2)) || fail "expected a line from each of 2 nodes, got ${#views[@]}"
own_ns=$(readlink /proc/self/ns/mnt)
[[ ${views[0]} == "n1 "* && ${views[1]} == "n2 "* ]] || fail "the tasks did not run on n1 and n2"
for v in "${views[@]}"; do
  read -r node ns mnt <<<"$v"
  [[ $mnt == "fuse.glusterfs,$(hostname):/$vol" ]] || fail "$node sees '$mnt' at $fs, not the volume $vol"
  [[ $ns != "$own_ns" ]] || fail "$node's task runs in the login node's mount namespace"
  [[ $(clients_of "$node" | wc -l) == 1 ]] || fail "$node has $(clients_of "$node" | wc -l) mount clients, expected 1"
done
[[ ${views[0]#* } != "${views[1]#* }" ]] || fail "n1 and n2 share one mount namespace"
[[ $(findmnt -n -o FSTYPE "$fs") == fuse.glusterfs ]] || fail "the login node has no mount at $fs"

# ---- 2. cross-mount visibility --------------------------------------------------------------------
# n1 writes 4 MiB through its client (temp file, fsync, rename, fsync of the directory);
on_node n1 '/usr/bin/python3 - "$TESTBED_SHARED_FS" <<"PY"
import hashlib, os, sys
d = os.path.join(sys.argv[1], "xmount")
os.makedirs(d + ".tmp")
data = os.urandom(4 << 20)
with open(os.path.join(d + ".tmp", "blob"), "wb") as f:
    f.write(data); f.flush(); os.fsync(f.fileno())
os.rename(d + ".tmp", d)
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); os.fsync(fd); os.close(fd)
open(os.path.join(sys.argv[1], "xmount.sha256"), "w").write(hashlib.sha256(data).hexdigest() + "\n")
PY' || fail "n1 could not write to $fs"
# ... n2 reads it right away through its own client, bit-exact, and does not see the temp name;
on_node n2 'cd "$TESTBED_SHARED_FS" && [[ ! -e xmount.tmp ]] && [[ $(sha256sum <xmount/blob | cut -d" " -f1) == $(head -n1 xmount.sha256) ]]' ||
  fail "n2 does not read n1's file bit-exact (or still sees the temp directory)"
[[ $(sha256sum <"$fs/xmount/blob" | cut -d' ' -f1) == $(head -n1 "$fs/xmount.sha256") ]] ||
  fail "the login node does not read n1's file bit-exact"
# n2 appends and overwrites in place, n1 sees both; n1 deletes, n2 no longer sees it.
on_node n2 'cd "$TESTBED_SHARED_FS" && echo appended >>xmount.sha256 && printf XYZ | dd of=xmount/blob bs=1 seek=100 conv=notrunc,fsync status=none' ||
  fail "n2 could not modify n1's files"
on_node n1 'cd "$TESTBED_SHARED_FS" && [[ $(tail -n1 xmount.sha256) == appended ]] && [[ $(dd if=xmount/blob bs=1 skip=100 count=3 status=none) == XYZ ]]' ||
  fail "n1 does not see n2's append and in-place overwrite"
on_node n1 'rm -r "$TESTBED_SHARED_FS/xmount"' || fail "n1 could not delete"
on_node n2 '[[ ! -e $TESTBED_SHARED_FS/xmount ]]' || fail "n2 still sees the directory n1 deleted"

# ---- 3. kill-node ends the node's client ------------------------------------------------------------
mapfile -t n1_client < <(clients_of n1)
mapfile -t n2_client < <(clients_of n2)
mapfile -t n2_all < <("$TB" pids n2)
[[ " ${n2_all[*]} " == *" ${n2_client[0]} "* ]] || fail "'testbed pids n2' misses n2's mount client ${n2_client[0]}"
"$TB" kill-node n2
[[ -z $(alive_pids "${n2_client[@]}") ]] || fail "kill-node n2 left its mount client ${n2_client[*]} running"
[[ -n $(alive_pids "${n1_client[@]}") ]] || fail "kill-node n2 ended n1's mount client too"
on_node n1 'echo "written while n2 was down" >"$TESTBED_SHARED_FS/while-down"' || fail "n1 cannot write after n2's crash"
"$TB" revive-node n2
mapfile -t n2_new < <(clients_of n2)
((${#n2_new[@]} == 1)) && [[ ${n2_new[0]} != "${n2_client[0]}" ]] || fail "revived n2 has no new mount client (${n2_new[*]})"
[[ $(on_node n2 'cat "$TESTBED_SHARED_FS/while-down"') == "written while n2 was down" ]] ||
  fail "revived n2 does not read what n1 wrote while it was down"

# ---- 4. down leaves nothing behind ----------------------------------------------------------------------
mapfile -t all_clients < <(clients_of n1; clients_of n2; clients_of login)
"$TB" down
[[ -z $(alive_pids "${all_clients[@]}") ]] || fail "down left mount clients: $(alive_pids "${all_clients[@]}")"
leftover=$(grep -lzxF "ELASTRUN_TESTBED_RUN=$dir" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | tr '\n' ' ') || true
[[ -z $leftover ]] || fail "down left processes of the run: $leftover"
! grep -qF " $fs " /proc/self/mountinfo || fail "$fs is still mounted after down"
[[ ! -e /var/lib/glusterd/vols/$vol ]] || fail "volume $vol still exists after down"
[[ ! -e $dir ]] || fail "down left $dir (bricks) behind"

check_shared_testbed
echo "PASS: --shared-fs on testbed '$TESTBED_ID' (volume $vol)"
