#!/usr/bin/env bash
# A node loss as the job CLI and Prometheus see it, on a private 4-node testbed:
#   `elastrun run dist.ddp -j 2:4x2` with ELASTRUN_METRICS_DIR -> Debian's prometheus-node-exporter
#   (its own instance on a free port, textfile collector only), scraped over HTTP, reports
#   elastrun_world_size 8 for n1..n4; `testbed kill-node n3` -> `elastrun status` shows world 6,
#   n3 lost (the root cause) and the time lost; the scrape shows world 6 for n1 n2 n4 and no n3
#   (the next round's leader removed its file); `elastrun cancel` -> CANCELLED, and no elastrun
#   series is left (each agent removes its file at exit).
# Usage: test_job_node_loss_slurm.sh   Environment: ELASTRUN_BIN, the testbed's (private id).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../support/lib.sh"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
elastrun=$ELASTRUN_BIN/elastrun
exporter=$(command -v prometheus-node-exporter || true)
[[ -n $exporter ]] || { [[ ${CI:-} == true ]] && fail "no prometheus-node-exporter (scripts/setup installs it)"; skip "no prometheus-node-exporter"; }
sandbox
out=$SANDBOX
export ELASTRUN_PYTHON=/usr/bin/python3 ELASTRUN_METRICS_DIR=$out/prom
mkdir -p "$out/prom"
cd "$out"
show_on_failure 30 "$out/index/*/*/batch.out" "$out/exporter.log"
private_testbed_up 4

port=$(free_port)
"$exporter" --web.listen-address="127.0.0.1:$port" --collector.disable-defaults --collector.textfile \
  --collector.textfile.directory="$out/prom" >"$out/exporter.log" 2>&1 &
track_pid "$!"
# scrape: "node world_size" per line for this job's elastrun_world_size series, over HTTP
scrape() {
  /usr/bin/python3 - "$port" <<'PY'
import re, sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode()
assert "node_textfile_scrape_error 0" in text, [l for l in text.splitlines() if "textfile" in l]
for line in text.splitlines():
    m = re.match(r'elastrun_world_size\{.*node="([^"]+)".*\} (\S+)$', line)
    if m:
        print(m.group(1), int(float(m.group(2))))
PY
}
seen() { [[ $(scrape | sort | tr '\n' ' ') == "$1" ]]; }


"$elastrun" run dist.ddp -j 2:4x2 --script "$here/cli_worker.py" >run.txt 2>&1 || fail "run: $(cat run.txt)"
h=$(grep -o 'slurm://[^ ]*' run.txt | head -1)
on_exit "scancel ${h##*/} 2>/dev/null || true"
world() { "$elastrun" status --json "$h" | /usr/bin/python3 -c 'import json,sys; print(json.load(sys.stdin)["world_size"])'; }
at8() { [[ $(world) == 8 ]]; }
wait_for 120 at8 || fail "no round of 8: $("$elastrun" status "$h")"
wait_for 30 seen "n1 8 n2 8 n3 8 n4 8 " || fail "scrape before the loss: $(scrape | tr '\n' ' ')"
echo "ok: node_exporter reports world 8 on n1..n4"

"$TB" kill-node n3
at6() { [[ $(world) == 6 ]]; }
wait_for 60 at6 || fail "no round of 6: $("$elastrun" status "$h")"
"$elastrun" status --json "$h" >status.json
/usr/bin/python3 - status.json <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
assert s["state"] == "RUNNING" and [r["world_size"] for r in s["rounds"]] == [8, 6], s
assert [l["node"] for l in s["nodes_lost"]] == ["n3"] and s["root_cause"] == "node n3 lost", s
assert s["time_lost_s"] > 0 and s["restarts"] == 0, s
print(f"ok: status: world 8 -> 6, n3 lost, {s['time_lost_s']:.2f} s lost")
PY
"$elastrun" status "$h" | grep -q '^  node lost    n3 at ' || fail "status: $("$elastrun" status "$h")"
wait_for 30 seen "n1 6 n2 6 n4 6 " || fail "scrape after the loss: $(scrape | tr '\n' ' ')"
echo "ok: node_exporter reports world 6 on n1 n2 n4, nothing of n3"

"$elastrun" cancel --timeout 90 "$h" >cancel.txt 2>&1 || fail "cancel: $(cat cancel.txt)"
cancelled() { "$elastrun" status "$h" | head -1 | grep -q CANCELLED; }
wait_for 60 cancelled || fail "status: $("$elastrun" status "$h")"
wait_for 30 seen "" || fail "series left after the job: $(scrape | tr '\n' ' ')"
[[ -z $(ls "$out/prom") ]] || fail "files left in the textfile directory: $(ls "$out/prom")"
echo "ok: cancelled; no metrics file left"
