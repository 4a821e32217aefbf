#!/usr/bin/env bash
# The rendezvous against another local user (docs/rendezvous.md, "Threat model"): a second Unix
# user, created here with useradd (root only; skipped otherwise) and removed at the end, attacks
#   standalone  `elastrun --standalone` with the default --rdzv-auth=auto: the store listens on
#               127.0.0.1 only; the generated token is a 0600 file in a 0700 directory, removed at
#               the end; the intruder cannot read it, is refused with no credential, a guessed token,
#               a stolen token file, and another run id -- and learns neither the run id nor the token;
#               the store logs each refusal; the job ends 0 with WORLD_SIZE 1
#   two_agents  two agents on one host (loopback endpoint, auto): the second reads the first's token
#               file; the intruder's join and token guess are refused; the job ends with WORLD_SIZE 4
#   no_munge    auto across hosts with munged unreachable and no token: one error line naming
#               ELASTRUN_RDZV_TOKEN, exit 2; --rdzv-auth=none works but warns
#   memory      the agent's memory checkpoints (--memory-checkpoints): the intruder's requests to the
#               node endpoint (an abstract socket, which has no file permissions) are refused by the
#               peer's uid and carry no descriptor back; the segments' memfds under /proc of the
#               agent and of its workers cannot be opened; nothing of them is in /dev/shm; with
#               two agents, the TCP port of their partner copies refuses the intruder's list, get
#               and put (a wrong token, no authentication, another method)
# Usage: test_security.sh CASE path/to/elastrun path/to/rdzv_member path/to/launcher_test_worker
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
case_name=$1 elastrun=$2 member=$3 worker=$4
FAIL_TAG=$case_name
worker_sandbox launcher_test_worker
work=$SANDBOX
: >"$work/intruder.err"
show_on_failure 30 "$work/a.err" "$work/b.err" "$work/intruder.err"
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID
unset_env '^(SLURM_|PET_|PMI_|PMIX_|OMPI_|ELASTRUN_RDZV_TOKEN)'

intruder=
if [[ $case_name != no_munge ]]; then
  [[ $(id -u) == 0 ]] || skip "needs root to create a second user"
  command -v useradd >/dev/null && command -v runuser >/dev/null || skip "no useradd/runuser"
  intruder=elastrun-intruder-$$
  useradd --system --no-create-home --shell /usr/sbin/nologin "$intruder" || fail "useradd $intruder"
  on_exit "userdel $intruder 2>/dev/null"
  # the intruder's copy of the test client, where it may run it
  mkdir -p "$work/intruder"
  cp "$member" "$work/intruder/rdzv_member"
  chmod -R a+rx "$work/intruder"
fi

# as_intruder CMD...: runs CMD as the second user, its stderr in intruder.err (appended)
as_intruder() {
  runuser -u "$intruder" -- env -i PATH=/usr/bin:/bin HOME=/ TMPDIR=/tmp "$@" 2>>"$work/intruder.err"
}
# attack ENDPOINT RUN [ENV...] -- ARGS: the intruder tries to join the rendezvous; must be refused
attack() {
  local endpoint=$1 run=$2 env_vars=()
  shift 2
  while [[ $1 != -- ]]; do env_vars+=("$1"); shift; done
  shift
  local before rc
  before=$(wc -l <"$work/intruder.err" 2>/dev/null || echo 0)
  as_intruder "${env_vars[@]}" "$work/intruder/rdzv_member" --endpoint "$endpoint" --run-id "$run" --node evil \
    --index 9 --min 1 --max 4 --join-timeout-ms 2000 "$@" >"$work/intruder.out"
  rc=$?
  ((rc != 0)) || fail "the intruder joined with $*: $(cat "$work/intruder.out")"
  grep -q '"event":"round"' "$work/intruder.out" && fail "the intruder saw a round with $*"
  tail -n +$((before + 1)) "$work/intruder.err" >"$work/last-attack.err"
  echo "refused as expected ($*): $(tail -1 "$work/last-attack.err")"
}
# leaks SECRET...: the intruder's output must contain none of them
no_leaks() {
  local secret
  for secret in "$@"; do
    grep -qF -- "$secret" "$work/intruder.err" "$work/intruder.out" && fail "the intruder learnt '$secret'"
  done
  return 0
}
# the WORLD_SIZEs the workers saw, e.g. ['4']
world_sizes() {
  /usr/bin/python3 -c 'import glob, json, sys; print(sorted({json.load(open(f))["WORLD_SIZE"] for f in glob.glob(sys.argv[1] + "/rank*.json")}))' "$work/out"
}
# listening_on PORT: the local addresses with a listening socket on PORT
listening_on() { ss -Hltn "sport = :$1" | awk '{print $4}' | sort -u | tr '\n' ' '; }

case $case_name in
standalone)
  TEST_WORKER_SLEEP=12 "$elastrun" --standalone --nproc-per-node=1 "$worker" >"$work/a.out" 2>"$work/a.err" &
  agent=$!
  track_pid "$agent"
  wait_for -i 0.1 -a "$agent" "the agent exited early" 20 grep -q "store 127.0.0.1:[0-9]" "$work/a.err"
  read -r run port < <(sed -n "s/.*run '\([^']*\)'.*store 127.0.0.1:\([0-9]*\).*/\1 \2/p" "$work/a.err" | head -1)
  [[ -n $run && -n $port ]] || fail "no run id and store port in the agent's log"
  [[ $(listening_on "$port") == "127.0.0.1:$port " ]] || fail "the store listens on '$(listening_on "$port")', expected 127.0.0.1 only"
  token_file=$TMPDIR/elastrun-$(id -u)/rdzv-$run.token
  [[ -f $token_file ]] || fail "no generated token at $token_file"
  [[ $(stat -c %a "$TMPDIR/elastrun-$(id -u)") == 700 && $(stat -c %a "$token_file") == 600 ]] ||
    fail "token directory/file modes $(stat -c %a "$TMPDIR/elastrun-$(id -u)")/$(stat -c %a "$token_file"), expected 700/600"
  token=$(cat "$token_file")
  as_intruder cat "$token_file" >/dev/null && fail "the intruder read the token file"
  attack "127.0.0.1:$port" "$run" -- --auth none
  grep -q "refused our 'none' credential" "$work/last-attack.err" || fail "no auth refusal: $(cat "$work/last-attack.err")"
  attack "127.0.0.1:$port" "$run" ELASTRUN_RDZV_TOKEN=0123456789abcdef -- --auth token
  attack "127.0.0.1:$port" "$run" ELASTRUN_RDZV_TOKEN_FILE="$token_file" -- --auth token
  grep -q "cannot be read" "$work/last-attack.err" || fail "the stolen token file was not unreadable: $(cat "$work/last-attack.err")"
  attack "127.0.0.1:$port" "guess-$run" -- --auth none
  grep -q "serves another run than 'guess-$run'" "$work/last-attack.err" || fail "no wrong-run refusal: $(cat "$work/last-attack.err")"
  no_leaks "$token" "this store serves run"
  grep -q "\[store\] refused 127.0.0.1:[0-9]*: wrong token\|\[store\] refused 127.0.0.1:[0-9]*: client offered" "$work/a.err" ||
    fail "the store did not log the refusals"
  grep -q "asked for run 'guess-$run'" "$work/a.err" || fail "the store did not log the wrong-run hello"
  await "$agent"
  rc=$?
  ((rc == 0)) || fail "the attacked job exited $rc"
  [[ $(world_sizes) == "['1']" ]] || fail "world sizes $(world_sizes), expected only 1 (no intruder joined)"
  [[ ! -e $token_file ]] || fail "the token file outlived the job"
  echo "ok: a standalone job refused every attack and finished"
  ;;
two_agents)
  port=$(free_port)
  common=(--nnodes=2 --nproc-per-node=2 --rdzv-endpoint=127.0.0.1:$port --rdzv-id=sec2 --monitor-interval=0.05)
  export TEST_WORKER_SLEEP=12
  "$elastrun" "${common[@]}" --rdzv-conf=is_host=1 --node-rank=0 "$worker" >"$work/a.out" 2>"$work/a.err" &
  a=$!
  "$elastrun" "${common[@]}" --rdzv-conf=is_host=0 --node-rank=1 "$worker" >"$work/b.out" 2>"$work/b.err" &
  b=$!
  track_pid "$a" "$b"
  wait_for -i 0.1 30 have_files 4 "$work/out/rank*.json" || fail "4 workers did not start"
  [[ $(listening_on "$port") == "127.0.0.1:$port " ]] || fail "the store listens on '$(listening_on "$port")', expected 127.0.0.1 only"
  token=$(cat "$TMPDIR/elastrun-$(id -u)/rdzv-sec2.token")
  attack "127.0.0.1:$port" sec2 -- --auth none
  attack "127.0.0.1:$port" sec2 ELASTRUN_RDZV_TOKEN=guess -- --auth token
  no_leaks "$token"
  grep -q "\[store\] refused" "$work/a.err" || fail "the store did not log the refusals"
  await "$a"; rc_a=$?
  await "$b"; rc_b=$?
  ((rc_a == 0 && rc_b == 0)) || fail "the attacked agents exited $rc_a/$rc_b"
  [[ $(world_sizes) == "['4']" ]] || fail "world sizes $(world_sizes), expected only 4 (no intruder joined)"
  echo "ok: two agents on one host shared the generated token; the intruder was refused"
  ;;
no_munge)
  ELASTRUN_MUNGE_SOCKET=$work/no-munged.socket "$elastrun" --nnodes=2 --rdzv-endpoint=192.0.2.1:29400 --rdzv-id=x \
    "$worker" >"$work/a.out" 2>"$work/a.err"
  rc=$?
  ((rc == 2)) || fail "exit $rc, expected 2"
  [[ $(wc -l <"$work/a.err") == 1 ]] || fail "not one error line: $(cat "$work/a.err")"
  grep -q "error: --rdzv-auth=auto: .*ELASTRUN_RDZV_TOKEN.*--rdzv-auth=none" "$work/a.err" || fail "unclear error: $(cat "$work/a.err")"
  TEST_WORKER_SLEEP=0 "$elastrun" --standalone --rdzv-auth=none "$worker" >"$work/b.out" 2>"$work/b.err" ||
    fail "--rdzv-auth=none standalone failed"
  grep -q "warning: --rdzv-auth=none: anyone who can reach" "$work/b.err" || fail "no warning for --rdzv-auth=none"
  echo "ok: auto without munge across hosts is a clear error; none warns"
  ;;
memory)
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  on_exit "kill_recorded_pids $(printf '%q' "$work/out/pids") memory_worker"
  shm_before=$(ls /dev/shm | sort)
  PYTHONPATH=$root/python MEMORY_WORKER_MODE=hold "$elastrun" --standalone --nproc-per-node 2 \
    --memory-checkpoints=128M /usr/bin/python3 "$root/tests/launcher/memory_worker.py" >"$work/a.out" 2>"$work/a.err" &
  agent=$!
  track_pid "$agent"
  wait_for -a "$agent" "the agent exited early" 30 have_files 2 "$work/out/held.*" || fail "no snapshot held"
  address=$(sed -n 's/.*node endpoint @\([^ ]*\).*/\1/p' "$work/a.err" | head -1)
  [[ -n $address ]] || fail "no node endpoint address in the agent's log"
  for op in mem_list mem_get status; do
    reply=$(as_intruder /usr/bin/python3 -c '
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1])
try:
    s.sendall((json.dumps({"v": 1, "op": sys.argv[2], "rank": 0, "step": 424242}) + "\n").encode())
except (BrokenPipeError, ConnectionResetError):
    pass  # refused at once: the refusal is already in our receive buffer
msg, fds, _, _ = socket.recv_fds(s, 65536, 4)
print(len(fds), msg.decode().strip())' "$address" "$op") || fail "the intruder's $op request failed to run: $(tail -3 "$work/intruder.err")"
    [[ $reply == '0 {"error":"refused: the node endpoint answers its own user only","ok":false,"v":1}' ]] ||
      fail "the intruder's $op got: $reply"
  done
  echo "refused as expected: $reply"
  segments=$(find /proc/[0-9]*/fd -lname "/memfd:elastrun-mem-424242-*" 2>/dev/null)
  [[ -n $segments ]] || fail "no process holds the segments"
  for fd in $segments; do
    as_intruder head -c 16 "$fd" >/dev/null && fail "the intruder read the segment $fd"
  done
  as_intruder ls "/proc/$agent/fd" >/dev/null && fail "the intruder listed the agent's descriptors"
  echo "ok: $(wc -w <<<"$segments") segment descriptor(s) unreadable by the intruder"
  [[ $(ls /dev/shm | sort) == "$shm_before" ]] || fail "/dev/shm changed: $(ls /dev/shm)"
  kill -TERM "$agent"
  await "$agent" || true
  # partner copies (two agents): the TCP port each agent serves them on answers the run's
  # credential only -- no segment listed, sent or planted for a wrong token, another method, none
  rm -f "$work"/out/held.*
  port=$(free_port)
  for n in 0 1; do
    PYTHONPATH=$root/python MEMORY_WORKER_MODE=hold "$elastrun" --nnodes=2 --nproc-per-node 2 \
      --rdzv-endpoint=127.0.0.1:$port --rdzv-id=mem2 --rdzv-conf=is_host=$((1 - n)) --node-rank=$n \
      --memory-checkpoints=256M /usr/bin/python3 "$root/tests/launcher/memory_worker.py" \
      >"$work/pair$n.out" 2>"$work/pair$n.err" &
    printf -v "pair$n" '%s' "$!"
    track_pid "$!"
  done
  wait_for -a "$pair0" "agent 0 exited early" 60 have_files 4 "$work/out/held.*" || fail "no snapshots held by the pair"
  peer=$(sed -n 's/.*partner copies served on \([0-9.:]*\).*/\1/p' "$work/pair0.err" | head -1)
  [[ -n $peer ]] || fail "agent 0 serves no partner copies: $(cat "$work/pair0.err")"
  status=@$(sed -n 's/.*node endpoint @\([^ ]*\).*/\1/p' "$work/pair1.err" | head -1)
  wait_for 60 eval '"$elastrun" node-status "$status" | grep -q "\"received\":[1-9]"' ||
    fail "agent 1 received no partner copy: $("$elastrun" node-status "$status")"
  for attempt in 'list token guess' 'get none -' 'put munge forged'; do
    read -r op kind credential <<<"$attempt"
    reply=$(as_intruder /usr/bin/python3 -c '
import json, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=10)
request = {"v": 1, "op": sys.argv[2], "run": "mem2", "auth": sys.argv[3], "credential": sys.argv[4],
           "step": 424242, "rank": 2, "bytes": 4096, "checksum": 0, "world": 4, "generation": 1}
s.sendall((json.dumps(request) + "\n").encode())
got = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    got += chunk
print(got.decode(errors="replace").strip())' "$peer" "$op" "$kind" "$credential") ||
      fail "the intruder's $op request failed to run: $(tail -3 "$work/intruder.err")"
    [[ $reply == '{"error":'*'"ok":false}' && $reply != *$'\n'* ]] || fail "the intruder's $op ($kind) got: $reply"
  done
  echo "refused as expected: $reply"
  "$elastrun" node-status "$status" | grep -q '"received":[1-9]' || fail "agent 1 lost its partner copies"
  kill -TERM "$pair0" "$pair1"
  await "$pair0" || true
  await "$pair1" || true
  echo "ok: partner copies: the intruder's list, get and put refused (wrong token, no authentication, another method)"
  ;;
*) fail "unknown case" ;;
esac
