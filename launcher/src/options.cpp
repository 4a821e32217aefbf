#include "options.hpp"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sched.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "elastrun/util/parse.hpp"
#include "gpu_binding.hpp"

namespace elastrun::launcher {
namespace {

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  while (!text.empty() && text.back() == ' ') text.pop_back();
  return text;
}

std::optional<long> to_long(std::string_view text) { return util::parse_integer<long>(text); }

Millis seconds_option(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  errno = 0;
  double seconds = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0 || !std::isfinite(seconds) || seconds < 0 ||
      seconds > 86400.0 * 365)
    throw UsageError(fmt::format("{}='{}' is not a number of seconds (e.g. 30 or 0.5)", flag, text));
  return Millis(static_cast<long long>(std::llround(seconds * 1000.0)));
}

// gpu and auto count the step's GPUs on this node (gpu_binding.hpp: Slurm's allocation first),
// one worker per GPU or per --gpus-per-worker GPUs.
int parse_nproc(const std::string& text, int gpus_per_worker) {
  if (text == "cpu") return cpu_count();
  if (text == "gpu" || text == "auto") {
    const auto gpus = detect_gpus();
    const int n = static_cast<int>(gpus.size()) / std::max(1, gpus_per_worker);
    if (n > 0 || text == "auto") return n > 0 ? n : cpu_count();
    throw UsageError(
        gpus.size() == 0
            ? fmt::format("--nproc-per-node=gpu: no GPU for this step on this node ({} names none); give a number "
                          "or 'cpu'",
                          gpus.source)
            : fmt::format("--nproc-per-node=gpu: {} GPU(s) on this node ({}) are too few for --gpus-per-worker {}",
                          gpus.size(), gpus.source, gpus_per_worker));
  }
  auto n = to_long(text);
  if (!n || *n < 1 || *n > 4096)
    throw UsageError(
        fmt::format("--nproc-per-node='{}' must be a number of processes (1-4096), auto, cpu or gpu", text));
  return static_cast<int>(*n);
}

void parse_nnodes(const std::string& text, AgentOptions& o) {
  auto colon = text.find(':');
  auto lo = to_long(std::string_view(text).substr(0, colon));
  auto hi = colon == std::string::npos ? lo : to_long(std::string_view(text).substr(colon + 1));
  if (!lo || !hi || *lo < 1 || *hi > 100000)
    throw UsageError(fmt::format("--nnodes='{}' must be N or MIN:MAX with 1 <= MIN <= MAX", text));
  if (*lo > *hi) throw UsageError(fmt::format("--nnodes={}: MIN is larger than MAX", text));
  o.min_nodes = static_cast<int>(*lo);
  o.max_nodes = static_cast<int>(*hi);
}

// --het-nnodes=N|MIN:MAX,N|MIN:MAX,...: one entry per het component, each as --nnodes.
std::vector<std::pair<int, int>> parse_het_nnodes(const std::string& text) {
  std::vector<std::pair<int, int>> bounds;
  for (auto item : util::split_list(text)) {
    AgentOptions one;
    try {
      parse_nnodes(std::string(item), one);
    } catch (const UsageError&) {
      throw UsageError(fmt::format(
          "--het-nnodes='{}': '{}' is not N or MIN:MAX; give one per het component, e.g. 1:1,2:3", text, item));
    }
    bounds.emplace_back(*one.min_nodes, *one.max_nodes);
  }
  if (bounds.empty())
    throw UsageError(fmt::format("--het-nnodes='{}' is empty; give MIN:MAX per het component, e.g. 1:1,2:3", text));
  return bounds;
}

// A name that goes into store keys and roster lines: 1..max printable characters, no blanks.
void check_word(const char* flag, const std::string& value, std::size_t max) {
  const bool ok = value.size() <= max && std::all_of(value.begin(), value.end(), [](char c) {
                    return static_cast<unsigned char>(c) > 0x20 && static_cast<unsigned char>(c) < 0x7f;
                  });
  if (!ok)
    throw UsageError(fmt::format("{}='{}' must be at most {} printable characters without blanks", flag,
                                 util::printable(value, 40), max));
}

// HOST[:PORT] with a port of 1-65535 when given.
void check_endpoint(const std::string& endpoint) {
  const auto colon = endpoint.rfind(':');
  const auto host = endpoint.substr(0, colon);
  bool ok = !host.empty() && host.size() <= 253 && std::none_of(host.begin(), host.end(), [](char c) {
    return static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f;
  });
  if (ok && colon != std::string::npos) {
    auto port = to_long(std::string_view(endpoint).substr(colon + 1));
    ok = port && *port >= 1 && *port <= 65535;
  }
  if (!ok)
    throw UsageError(
        fmt::format("--rdzv-endpoint='{}' is not HOST[:PORT] with a port of 1-65535", util::printable(endpoint, 60)));
}

bool parse_bool(const std::string& flag, const std::string& value) {
  if (auto b = util::parse_boolean(value)) return *b;
  throw UsageError(fmt::format("{}='{}' must be true or false (also 1/0, yes/no, on/off)", flag, value));
}

// Quotes around the whole value ('k=v,k2=v2'): PyTorch's own launcher tests pass them literally
// (no shell strips them) and torchrun, which ignores keys it does not know, then runs anyway.
std::string_view unquoted(std::string_view text) {
  while (text.size() >= 2 && (text.front() == '\'' || text.front() == '"') && text.back() == text.front())
    text = text.substr(1, text.size() - 2);
  return text;
}

// Every key torchrun (1.x and 2.x) knows is accepted: mapped where it means something here,
// otherwise logged as "no effect". A key unknown to both is kept for one warning line (torchrun
// ignores such keys too: a conf written for another backend must not stop the job).
void parse_rdzv_conf(const std::string& text, AgentOptions& o) {
  std::optional<Millis> timeout, keep_alive_interval;
  std::optional<long> keep_alive_attempts;
  bool join_given = false, heartbeat_given = false;
  for (auto item : util::split_list(unquoted(text))) {
    if (item.empty()) continue;
    auto eq = item.find('=');
    if (eq == std::string_view::npos) throw UsageError(fmt::format("--rdzv-conf: '{}' is not KEY=VALUE", item));
    std::string key(item.substr(0, eq)), value(item.substr(eq + 1));
    const std::string flag = "--rdzv-conf " + key;
    if (key == "join_timeout")
      o.join_timeout = seconds_option(flag, value), join_given = true;
    else if (key == "last_call_timeout")
      o.last_call_timeout = seconds_option(flag, value);
    else if (key == "heartbeat_timeout")
      o.heartbeat_timeout = seconds_option(flag, value), heartbeat_given = true;
    else if (key == "is_host")
      o.is_host = parse_bool(flag, value);
    else if (key == "timeout")  // torchrun's static/etcd-v2 rendezvous: how long to wait for the others
      timeout = seconds_option(flag, value);
    else if (key == "keep_alive_interval")  // c10d: a member is dead after interval x max attempts
      keep_alive_interval = seconds_option(flag, value);
    else if (key == "keep_alive_max_attempt") {
      auto n = to_long(value);
      if (!n || *n < 1) throw UsageError(fmt::format("{}='{}' must be a positive integer", flag, value));
      keep_alive_attempts = *n;
    } else if (key == "read_timeout" || key == "close_timeout" || key == "store_type" || key == "use_libuv" ||
               key == "use_agent_store" || key == "protocol" || key == "cacert" || key == "cert" || key == "key" ||
               key == "local_addr" || key == "rank")
      o.ignored_rdzv_conf.push_back(key);
    else
      o.unknown_rdzv_conf.push_back(util::printable(key, 60));
  }
  if (timeout && !join_given) o.join_timeout = *timeout;
  if ((keep_alive_interval || keep_alive_attempts) && !heartbeat_given)
    o.heartbeat_timeout = keep_alive_interval.value_or(Millis(5000)) * keep_alive_attempts.value_or(3);
  if (o.heartbeat_timeout < Millis(200)) throw UsageError("--rdzv-conf heartbeat_timeout must be at least 0.2 s");
}

}  // namespace

int cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

std::string_view to_string(FailureClass c) {
  switch (c) {
    case FailureClass::App: return "app";
    case FailureClass::Node: return "node";
    case FailureClass::TimeLimit: return "timelimit";
    case FailureClass::Preempt: return "preempt";
  }
  return "?";
}

std::optional<FailureClass> failure_class_from_string(std::string_view name) {
  for (int c = 0; c < kFailureClasses; ++c)
    if (name == to_string(static_cast<FailureClass>(c))) return static_cast<FailureClass>(c);
  return std::nullopt;
}

std::string_view to_string(RdzvBackend b) {
  switch (b) {
    case RdzvBackend::C10d: return "c10d";
    case RdzvBackend::Static: return "static";
    case RdzvBackend::Etcd: return "etcd";
    case RdzvBackend::EtcdV2: return "etcd-v2";
  }
  return "?";
}

std::optional<RdzvBackend> rdzv_backend_from_string(std::string_view name) {
  for (auto b : {RdzvBackend::C10d, RdzvBackend::Static, RdzvBackend::Etcd, RdzvBackend::EtcdV2})
    if (name == to_string(b)) return b;
  return std::nullopt;
}

std::array<std::int64_t, kFailureClasses> parse_requeue_budget(const std::string& text,
                                                               std::array<std::int64_t, kFailureClasses> budget) {
  const auto bad = [&](std::string_view why) {
    return UsageError(
        fmt::format("--requeue-budget='{}': {} (e.g. app:0,node:3,timelimit:inf,preempt:inf)", text, why));
  };
  for (auto item : util::split_list(text)) {
    auto colon = item.find(':');
    if (colon == std::string_view::npos) throw bad(fmt::format("'{}' is not CLASS:COUNT", item));
    auto name = item.substr(0, colon), value = item.substr(colon + 1);
    const auto cls = failure_class_from_string(name);
    if (!cls) throw bad(fmt::format("unknown class '{}' (known: app, node, timelimit, preempt)", name));
    const auto index = static_cast<std::size_t>(*cls);
    if (value == "inf" || value == "unlimited") {
      budget[index] = kUnlimited;
      continue;
    }
    auto n = to_long(value);
    if (!n || *n < 0 || *n > 1'000'000) throw bad(fmt::format("'{}' is not a count (0 or more) or inf", value));
    budget[index] = *n;
  }
  return budget;
}

StreamSpec parse_stream_spec(const std::string& flag, const std::string& text) {
  const auto bad = [&] {
    return UsageError(
        fmt::format("{}='{}': use 0 (none), 1 (stdout), 2 (stderr), 3 (both), or LOCAL_RANK:N,...", flag, text));
  };
  const auto value = [&](std::string_view v) {
    auto n = to_long(v);
    if (!n || *n < 0 || *n > 3) throw bad();
    return static_cast<int>(*n);
  };
  StreamSpec spec;
  if (text.find(':') == std::string::npos) {
    spec.all = value(text);
    return spec;
  }
  for (auto item : util::split_list(text)) {
    auto colon = item.find(':');
    if (colon == std::string_view::npos) throw bad();
    auto rank = to_long(item.substr(0, colon));
    if (!rank || *rank < 0 || *rank > 4096) throw bad();
    spec.per_rank[static_cast<int>(*rank)] = value(item.substr(colon + 1));
  }
  return spec;
}

namespace {

struct Torchrun2Flags {
  std::string shutdown_timeout;
  bool stop_grace_given = false;
  std::string logs_specs, event_log_handler, signals_to_handle, dup_stdout, dup_stderr;
  bool print_completion_given = false;
  bool use_env = false;
};

// torchrun's comma_separated_list: ",," stands for a comma inside an item.
std::vector<std::string> comma_list_with_escapes(const std::string& text) {
  std::vector<std::string> items(1);
  for (std::size_t i = 0; i < text.size(); ++i) {
    if (text[i] != ',') {
      items.back() += text[i];
    } else if (i + 1 < text.size() && text[i + 1] == ',') {
      items.back() += ',';
      ++i;
    } else {
      items.emplace_back();
    }
  }
  return items;
}

void parse_torchrun2_flags(const Torchrun2Flags& f, AgentOptions& o) {
  if (!f.shutdown_timeout.empty()) {
    if (f.stop_grace_given) throw UsageError("--shutdown-timeout and --stop-grace are the same setting; give one");
    o.stop_grace = seconds_option("--shutdown-timeout", f.shutdown_timeout);
  } else if (const char* env = std::getenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"); env && *env && !f.stop_grace_given) {
    o.stop_grace = seconds_option("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", env);
  }
  if (!f.logs_specs.empty() && f.logs_specs != "default")
    throw UsageError(
        fmt::format("--logs-specs='{}': elastrun has no Python log plug-ins; only 'default' (use "
                    "--log-dir, --redirects, --tee, --local-ranks-filter)",
                    util::printable(f.logs_specs)));
  if (!f.event_log_handler.empty()) {
    if (f.event_log_handler != "null" && f.event_log_handler != "console" &&
        f.event_log_handler != "dynamic_rendezvous")
      throw UsageError(fmt::format("--event-log-handler='{}' is not one of null, console, dynamic_rendezvous",
                                   util::printable(f.event_log_handler)));
    if (f.event_log_handler != "null")
      o.notes.push_back(
          fmt::format("--event-log-handler={}: torchrun's Python event handlers do not exist here; "
                      "elastrun's events are JSON lines in --events (or LOG_DIR/events-NODE.jsonl)",
                      f.event_log_handler));
  }
  if (!f.signals_to_handle.empty()) {
    static const std::set<std::string> handled = {"SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"};
    for (auto item : util::split_list(f.signals_to_handle)) {
      while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
      while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
      const std::string name(item);
      if (!handled.contains(name))
        throw UsageError(
            fmt::format("--signals-to-handle: '{}' is not one of SIGTERM, SIGINT, SIGHUP, SIGQUIT, "
                        "SIGUSR1, SIGUSR2 (the signals elastrun handles)",
                        util::printable(name)));
    }
    o.notes.push_back(
        "--signals-to-handle: elastrun always handles SIGTERM, SIGINT, SIGHUP, SIGQUIT (stop the "
        "workers) and SIGUSR1, SIGUSR2 (checkpoint and stop); --forward-signals sends them on");
  }
  if (!o.numa_binding.empty() && o.numa_binding != "node" && o.numa_binding != "socket" &&
      o.numa_binding != "exclusive" && o.numa_binding != "core-complex")
    throw UsageError(fmt::format("--numa-binding='{}' is not one of node, socket, exclusive, core-complex",
                                 util::printable(o.numa_binding)));
  if (!f.dup_stdout.empty()) o.duplicate_stdout_filters = comma_list_with_escapes(f.dup_stdout);
  if (!f.dup_stderr.empty()) o.duplicate_stderr_filters = comma_list_with_escapes(f.dup_stderr);
  if (f.print_completion_given)
    throw UsageError(
        "--print-completion: elastrun prints no shell completion script; 'elastrun --help' lists every "
        "flag");
  if (!o.local_rank_arg.empty() && o.local_rank_arg != "--local-rank" && o.local_rank_arg != "--local_rank")
    throw UsageError(fmt::format("--local-rank-arg='{}' is not --local-rank (torch 2.x) or --local_rank (torch 1.x)",
                                 util::printable(o.local_rank_arg)));
  if (f.use_env) o.local_rank_arg.clear();
  if (o.log_line_prefix_template.empty())
    if (const char* env = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"); env && *env)
      o.log_line_prefix_template = env;
}

// --memory-checkpoints' value: BYTES, or "auto" (the flag without a value): a quarter of the RAM.
std::uint64_t memory_budget(const std::string& text) {
  if (text == "auto" || text == "true" || text == "1") {
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page) / 4 : 0;
  }
  const auto bytes = util::parse_byte_size(text);
  if (!bytes || *bytes == 0)
    throw UsageError(fmt::format("--memory-checkpoints='{}' is not a size in bytes (e.g. 8G, 512M, 1073741824)",
                                 util::printable(text)));
  return *bytes;
}

// The flags' values as given, before they are checked and converted into AgentOptions.
struct RawFlags {
  std::string rdzv_backend = "c10d", requeue_budget, checkpoint_timeout = "300", scale_up_checkpoint = "true";
  std::string het_nnodes;
  std::string nnodes, nproc = "1", rdzv_conf, monitor = "0.1", grace = "5", exit_barrier = "300", redirects = "0",
                      tee = "0", ranks_filter, node_rank, master_port, hang_timeout, memory_checkpoints,
                      partition_timeout, health_check_timeout = "60", straggler_threshold = "1.5",
                      health_check_interval = "0";
  std::vector<std::string> health_checks;
  // torchrun 2.x flags
  std::string shutdown_timeout, logs_specs, event_log_handler, signals_to_handle, dup_stdout, dup_stderr,
      print_completion;
  bool use_env = false;
};

// --help's frame: how elastrun is called, what PROGRAM is, the exit codes.
void describe_usage(CLI::App& app) {
  app.prefix_command();  // the first positional is the program; everything after it is its own
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.get_formatter()->column_width(44);
  app.footer(
      "\nusage: elastrun [options] [--] PROGRAM [ARGS...]\n"
      "       elastrun run|status|log|cancel|list|describe ...   the job CLI (docs/jobs.md; a program\n"
      "                                 called like a verb: elastrun -- run ...)\n"
      "       elastrun env [--json]     print the detected Slurm/MPI/torch environment\n"
      "       elastrun --version\n"
      "PROGRAM: a *.py script or -m MODULE runs with $ELASTRUN_PYTHON (default python3) -u;\n"
      "any other executable runs as is. PET_<FLAG> environment variables give defaults.\n"
      "Exit codes: 0 success, 1 workers failed for good or rendezvous error, 2 bad command line,\n"
      "85 workers checkpointed and stopped (requeue requested when allowed), 86 cut off from a\n"
      "majority of the job (--partition-timeout), 87 this node failed its --health-check, 128+N stopped by\n"
      "signal N. SIGUSR1/SIGUSR2/SIGTERM ask workers to checkpoint and stop through\n"
      "$ELASTRUN_CONTROL_FILE. See docs/launcher.md.");
}

// Every flag, its aliases and its help line: strings into `raw`, plain values into `o`.
void declare_flags(CLI::App& app, RawFlags& raw, AgentOptions& o) {
  app.add_option("--nnodes", raw.nnodes, "N or MIN:MAX nodes (default: the Slurm step's node count, else 1)");
  app.add_option("--het-nnodes,--het_nnodes", raw.het_nnodes,
                 "heterogeneous job: N or MIN:MAX nodes per component, in component order (e.g. 1:1,2:3)");
  app.add_option("--nproc-per-node,--nproc_per_node", raw.nproc, "workers per node: N, auto, cpu or gpu (default 1)");
  app.add_option("--rdzv-backend,--rdzv_backend", raw.rdzv_backend,
                 "c10d|static (embedded store, default) or etcd|etcd-v2 (external etcd v3)");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint,
                 "HOST[:PORT] of the store (default under Slurm: first node of the step)");
  app.add_option("--rdzv-id,--rdzv_id", o.rdzv_id, "run id (default: <job id>.r<restart count> under Slurm)");
  app.add_option("--rdzv-conf,--rdzv_conf", raw.rdzv_conf,
                 "KEY=VALUE,...: join_timeout, last_call_timeout, heartbeat_timeout (seconds), is_host");
  app.add_option("--rdzv-auth,--rdzv_auth", o.rdzv_auth, "munge|token|none|auto (default auto)");
  app.add_flag("--standalone", o.standalone, "one machine: an in-process store on 127.0.0.1, no Slurm needed");
  app.add_option("--max-restarts,--max_restarts", o.max_restarts, "worker failures tolerated, job-wide (default 0)");
  app.add_option("--monitor-interval,--monitor_interval", raw.monitor, "seconds between worker checks (default 0.1)");
  app.add_option("--stop-grace,--stop_grace", raw.grace,
                 "seconds between SIGTERM and SIGKILL when stopping workers (default 5)");
  app.add_option("--exit-barrier-timeout,--exit_barrier_timeout", raw.exit_barrier,
                 "seconds to wait for the other nodes after local success (default 300)");
  app.add_option("--partition-timeout,--partition_timeout", raw.partition_timeout,
                 "seconds this node waits cut off from a majority of the job (no quorum, not training) "
                 "before it gives up and exits 86 (default: the join timeout)");
  app.add_option("--role", o.role, "worker role name (ROLE_NAME, default 'default')");
  app.add_option("--node-rank,--node_rank", raw.node_rank, "this node's position in the round order (static use)");
  app.add_option("--master-addr,--master_addr", o.master_addr,
                 "without --rdzv-endpoint: the store host (torchrun static); workers get MASTER_ADDR from the round");
  app.add_option("--master-port,--master_port", raw.master_port, "port to go with --master-addr (default 29500)");
  app.add_option("--local-addr,--local_addr", o.local_addr,
                 "address peers use to reach this node (default: the node's resolved address)");
  app.add_option("--start-method,--start_method", o.start_method,
                 "spawn|fork|forkserver: accepted; workers are always separate fork+exec'd processes");
  app.add_option("--log-dir,--log_dir", o.log_dir, "per-attempt worker logs and error files go here");
  app.add_option("--outcome-file,--outcome_file", o.outcome_file,
                 "group rank 0 writes how the job ended here (JSON; default $ELASTRUN_OUTCOME_FILE): lets a "
                 "batch script tell success from srun's exit code after a shrink");
  app.add_option("--metrics-dir,--metrics_dir", o.metrics_dir,
                 "a file of Prometheus metrics for node_exporter's textfile collector here (default "
                 "$ELASTRUN_METRICS_DIR; docs/launcher.md, Metrics)");
  app.add_option("--events", o.events,
                 "JSON-lines event log (default with --log-dir: LOG_DIR/events-NODE.jsonl); workers get it "
                 "as ELASTRUN_EVENTS_FILE");
  app.add_option("-r,--redirects", raw.redirects,
                 "to files only: 0 none, 1 stdout, 2 stderr, 3 both; or LOCAL_RANK:N,...");
  app.add_option("-t,--tee", raw.tee, "to files and console: same values as --redirects");
  app.add_option("--local-ranks-filter,--local_ranks_filter", raw.ranks_filter,
                 "comma list of local ranks whose output reaches the console (default all)");
  app.add_flag("-m,--module", o.module, "PROGRAM is a Python module (python -m)");
  app.add_flag("--no-python,--no_python", o.no_python, "run PROGRAM as is, even a *.py file");
  app.add_flag("--run-path,--run_path", o.run_path, "accepted (torchrun runs the script with runpy); runs with python");

  // torchrun 2.x flags (docs/launcher.md, "torchrun flags"): mapped where they mean something here
  app.add_option("--shutdown-timeout,--shutdown_timeout", raw.shutdown_timeout,
                 "torchrun 2.x name of --stop-grace (seconds; torchrun's default is 30, elastrun's 5)");
  app.add_option("--logs-specs,--logs_specs", raw.logs_specs,
                 "accepted: 'default' only (torchrun's log-layout plug-in; see --log-dir, --redirects, --tee)");
  app.add_option("--event-log-handler,--event_log_handler", raw.event_log_handler,
                 "null|console|dynamic_rendezvous: accepted; elastrun writes its events to --events");
  app.add_option("--signals-to-handle,--signals_to_handle", raw.signals_to_handle,
                 "accepted and checked: elastrun handles SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 itself");
  app.add_option("--numa-binding,--numa_binding", o.numa_binding,
                 "node|socket|exclusive|core-complex: bind each worker to one NUMA node's CPUs (no-op with one node)");
  app.add_flag("--virtual-local-rank,--virtual_local_rank", o.virtual_local_rank,
               "LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES narrowed to the worker's own device");
  app.add_option("--gpus-per-worker", o.gpus_per_worker,
                 "N: each worker sees only its own N GPUs of the step's (CUDA_VISIBLE_DEVICES narrowed; "
                 "ELASTRUN_DEVICE=0); with --nproc-per-node=gpu, one worker per N GPUs");
  app.add_option("--duplicate-stdout-filters,--duplicate_stdout_filters", raw.dup_stdout,
                 "comma list (',,' is a comma): tee'd stdout lines containing one also go to "
                 "ATTEMPT_DIR/filtered_stdout.log");
  app.add_option("--duplicate-stderr-filters,--duplicate_stderr_filters", raw.dup_stderr,
                 "the same for stderr (filtered_stderr.log)");
  app.add_option("--log-line-prefix-template,--log_line_prefix_template", o.log_line_prefix_template,
                 "console line prefix with ${rank} ${local_rank} ${role_name} ${hostname} (default '[rank ${rank}] '; "
                 "else $TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)");
  app.add_option("--print-completion,--print_completion", raw.print_completion,
                 "not supported (torchrun prints a shtab completion script)");
  app.add_option("--local-rank-arg,--local_rank_arg", o.local_rank_arg,
                 "torch.distributed.launch: also pass --local-rank=N (2.x) or --local_rank=N (1.x) to the program");
  app.add_option("--hang-timeout,--hang_timeout", raw.hang_timeout,
                 "seconds without progress (elastrun::control::progress(), elastrun_control.progress()) after "
                 "which a worker that reported progress is hung: its stacks are dumped and the group restarts");
  app.add_option("--health-check,--health_check", raw.health_checks,
                 "builtin, or a command (/bin/sh -c) that exits 0 on a healthy node; repeatable: run at the first "
                 "join and after a failure of this node's workers; a failing node does not join (exit 87)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)
      ->allow_extra_args(false);  // one value per flag: the program that follows is not a second check
  app.add_option("--health-check-timeout,--health_check_timeout", raw.health_check_timeout,
                 "seconds a --health-check command may run before it fails the node (default 60)");
  app.add_option("--health-check-interval,--health_check_interval", raw.health_check_interval,
                 "seconds between --health-check runs while the workers train, in the background (default 0: "
                 "only at the first join and after a failure)");
  app.add_option("--straggler-action,--straggler_action", o.straggler_action,
                 "report|exclude|off: a node whose workers' compute time (progress(step, compute_s)) stays above "
                 "--straggler-threshold x the median node's is reported (event straggler), or excluded like a "
                 "failed node (default report)");
  app.add_option("--straggler-threshold,--straggler_threshold", raw.straggler_threshold,
                 "a node's compute time / the median node's above which it is slow (default 1.5)");
  app.add_option("--straggler-window,--straggler_window", o.straggler_window, "steps per scored window (default 20)");
  app.add_option("--straggler-windows,--straggler_windows", o.straggler_windows,
                 "scored windows in a row above the threshold that make a straggler (default 3)");
  app.add_flag(
      "--use-env,--use_env", raw.use_env,
      "torch.distributed.launch: the local rank only in LOCAL_RANK (elastrun's default; cancels --local-rank-arg)");

  app.add_option("--checkpoint-dir,--checkpoint_dir", o.checkpoint_dir,
                 "checkpoint directory: ELASTRUN_CHECKPOINT_DIR for workers, and the requeue ledger");
  app.add_option("--checkpoint-timeout,--checkpoint_timeout", raw.checkpoint_timeout,
                 "seconds workers get to checkpoint after a stop signal before they are stopped (default 300)");
  app.add_flag("--forward-signals,--forward_signals", o.forward_signals,
               "also send SIGUSR1/SIGUSR2/SIGTERM to the workers (legacy scripts with own handlers)");
  app.add_option("--scale-up-checkpoint,--scale_up_checkpoint", raw.scale_up_checkpoint,
                 "before re-forming for a node that joins, ask workers that read the control channel to "
                 "checkpoint and stop (true|false, default true)");
  app.add_flag("--memory-checkpoints{auto},--memory_checkpoints{auto}", raw.memory_checkpoints,
               "[=BYTES] keep the workers' memory checkpoints in this agent's memory (K/M/G suffixes; without a "
               "value: a quarter of the node's RAM); workers get ELASTRUN_MEMORY_CHECKPOINTS");
  app.add_option("--preload", o.preload,
                 "MODULES: Python workers are forked by one preloader per node that imported MODULES "
                 "(comma-separated, e.g. torch) once: restarts and re-forms skip the import");
  app.add_option("--requeue-budget,--requeue_budget", raw.requeue_budget,
                 "Slurm requeues allowed per class, CLASS:N|inf,... (default app:0,node:3,timelimit:inf,preempt:inf)");
}

// The values of `raw` checked and converted into `o`: one line naming the flag, exit 2.
void convert_values(const CLI::App& app, const RawFlags& raw, AgentOptions& o) {
  // Values that would otherwise fail late (after join_timeout of retries) or corrupt the roster,
  // whose fields are tab-separated: one line now, exit 2.
  if (app.count("--nnodes") > 0 && raw.nnodes.empty()) throw UsageError("--nnodes is empty; give N or MIN:MAX");
  check_word("--rdzv-id", o.rdzv_id, 200);
  check_word("--role", o.role, 100);
  if (o.rdzv_auth != "auto" && o.rdzv_auth != "munge" && o.rdzv_auth != "token" && o.rdzv_auth != "none")
    throw UsageError(
        fmt::format("--rdzv-auth='{}' is not one of auto, munge, token, none", util::printable(o.rdzv_auth)));
  if (!o.rdzv_endpoint.empty()) check_endpoint(o.rdzv_endpoint);
  if (!raw.nnodes.empty()) parse_nnodes(raw.nnodes, o);
  if (!raw.het_nnodes.empty()) {
    if (!raw.nnodes.empty())
      throw UsageError(
          "--nnodes and --het-nnodes contradict each other (with --het-nnodes the job's bounds are the sums)");
    o.het_nnodes = parse_het_nnodes(raw.het_nnodes);
  }
  if (o.gpus_per_worker < 0) throw UsageError(fmt::format("--gpus-per-worker={} must be 1 or more", o.gpus_per_worker));
  o.nproc_per_node = parse_nproc(raw.nproc, o.gpus_per_worker);
  if (o.gpus_per_worker >= 1) {
    const auto gpus = detect_gpus();
    if (static_cast<std::size_t>(o.nproc_per_node) * static_cast<std::size_t>(o.gpus_per_worker) > gpus.size())
      throw UsageError(
          fmt::format("--gpus-per-worker {} for {} worker(s) needs {} GPUs; this node has {} for the step "
                      "({}{}); give fewer workers or GPUs per worker",
                      o.gpus_per_worker, o.nproc_per_node, o.nproc_per_node * o.gpus_per_worker, gpus.size(),
                      gpus.source, gpus.size() ? "=" + fmt::format("{}", fmt::join(gpus.visible, ",")) : ""));
  }
  if (!raw.rdzv_conf.empty()) parse_rdzv_conf(raw.rdzv_conf, o);
  o.monitor_interval = std::max(Millis(10), seconds_option("--monitor-interval", raw.monitor));
  o.stop_grace = seconds_option("--stop-grace", raw.grace);
  if (!raw.hang_timeout.empty()) o.hang_timeout = seconds_option("--hang-timeout", raw.hang_timeout);
  for (const auto& check : raw.health_checks) {
    if (check == "builtin")
      o.health_check_builtin = true;
    else if (check.find_first_not_of(" \t") == std::string::npos)
      throw UsageError(fmt::format("--health-check='{}' is blank: give 'builtin' or a command", check));
    else
      o.health_check_commands.push_back(check);
  }
  o.health_check_timeout = seconds_option("--health-check-timeout", raw.health_check_timeout);
  if (o.straggler_action != "report" && o.straggler_action != "exclude" && o.straggler_action != "off")
    throw UsageError(
        fmt::format("--straggler-action='{}' is not one of report, exclude, off", util::printable(o.straggler_action)));
  {
    char* end = nullptr;
    o.straggler_threshold = std::strtod(raw.straggler_threshold.c_str(), &end);
    if (raw.straggler_threshold.empty() || end != raw.straggler_threshold.c_str() + raw.straggler_threshold.size() ||
        !std::isfinite(o.straggler_threshold) || o.straggler_threshold <= 1.0)
      throw UsageError(fmt::format("--straggler-threshold='{}' must be a ratio above 1 (e.g. 1.5)",
                                   util::printable(raw.straggler_threshold)));
  }
  if (o.straggler_window < 1)
    throw UsageError(fmt::format("--straggler-window={} must be 1 or more", o.straggler_window));
  if (o.straggler_windows < 1)
    throw UsageError(fmt::format("--straggler-windows={} must be 1 or more", o.straggler_windows));
  if (o.health_check_timeout.count() <= 0)
    throw UsageError(fmt::format("--health-check-timeout={} must be more than 0", raw.health_check_timeout));
  o.health_check_interval = seconds_option("--health-check-interval", raw.health_check_interval);
  if (!raw.memory_checkpoints.empty()) o.memory_checkpoints = memory_budget(raw.memory_checkpoints);
  parse_torchrun2_flags({.shutdown_timeout = raw.shutdown_timeout,
                         .stop_grace_given = app.count("--stop-grace") > 0,
                         .logs_specs = raw.logs_specs,
                         .event_log_handler = raw.event_log_handler,
                         .signals_to_handle = raw.signals_to_handle,
                         .dup_stdout = raw.dup_stdout,
                         .dup_stderr = raw.dup_stderr,
                         .print_completion_given = app.count("--print-completion") > 0,
                         .use_env = raw.use_env},
                        o);
  o.exit_barrier_timeout = seconds_option("--exit-barrier-timeout", raw.exit_barrier);
  o.checkpoint_timeout = seconds_option("--checkpoint-timeout", raw.checkpoint_timeout);
  if (!raw.partition_timeout.empty())
    o.partition_timeout = seconds_option("--partition-timeout", raw.partition_timeout);
  o.scale_up_checkpoint = parse_bool("--scale-up-checkpoint", raw.scale_up_checkpoint);
  if (!raw.requeue_budget.empty()) o.requeue_budget = parse_requeue_budget(raw.requeue_budget, o.requeue_budget);
  o.redirects = parse_stream_spec("--redirects", raw.redirects);
  o.tee = parse_stream_spec("--tee", raw.tee);
  if (!raw.ranks_filter.empty()) {
    std::set<int> ranks;
    for (auto item : util::split_list(raw.ranks_filter)) {
      auto n = to_long(item);
      if (!n || *n < 0)
        throw UsageError(
            fmt::format("--local-ranks-filter='{}' must be a comma list of local ranks", raw.ranks_filter));
      ranks.insert(static_cast<int>(*n));
    }
    o.local_ranks_filter = std::move(ranks);
  }
  if (!raw.node_rank.empty()) {
    auto n = to_long(raw.node_rank);
    if (!n || *n < 0 || *n > 1'000'000)
      throw UsageError(fmt::format("--node-rank='{}' must be a non-negative integer", raw.node_rank));
    o.node_rank = static_cast<int>(*n);
  }
  if (!raw.master_port.empty()) {
    auto n = to_long(raw.master_port);
    if (!n || *n < 1 || *n > 65535)
      throw UsageError(fmt::format("--master-port='{}' must be 1-65535", raw.master_port));
    o.master_port = static_cast<int>(*n);
  }
}

// Flags that contradict each other, and what one implies for another.
void check_contradictions(const RawFlags& raw, AgentOptions& o) {
  const auto backend = rdzv_backend_from_string(raw.rdzv_backend);
  if (!backend)
    throw UsageError(fmt::format("--rdzv-backend='{}' is not one of c10d, static, etcd, etcd-v2", raw.rdzv_backend));
  o.rdzv_backend = *backend;
  if (!o.start_method.empty() && o.start_method != "spawn" && o.start_method != "fork" &&
      o.start_method != "forkserver")
    throw UsageError(fmt::format("--start-method='{}' is not one of spawn, fork, forkserver", o.start_method));
  if (o.max_restarts < 0) throw UsageError("--max-restarts must be 0 or more");
  if (o.no_python && o.module)
    throw UsageError("--no-python and -m/--module contradict each other (a module needs python)");
  if (o.no_python && o.run_path) throw UsageError("--no-python and --run-path contradict each other");
  if (o.standalone) {
    if (!o.rdzv_endpoint.empty())
      throw UsageError("--standalone and --rdzv-endpoint contradict each other (standalone hosts its own store)");
    if (uses_etcd(o.rdzv_backend)) throw UsageError("--standalone and --rdzv-backend=etcd contradict each other");
    if (!o.het_nnodes.empty()) throw UsageError("--standalone and --het-nnodes contradict each other (one node)");
    if (o.max_nodes && *o.max_nodes > 1)
      throw UsageError(
          fmt::format("--standalone runs one node but --nnodes={}:{} asks for more", *o.min_nodes, *o.max_nodes));
  }
  if (uses_etcd(o.rdzv_backend) && o.rdzv_endpoint.empty())
    throw UsageError("--rdzv-backend=etcd needs --rdzv-endpoint=HOST:PORT of an etcd server");
  // torchrun's --master-addr defaults to 127.0.0.1: `--master-port=P` alone is the static form on this machine
  if (o.master_port && o.master_addr.empty() && o.rdzv_endpoint.empty() && !o.standalone) o.master_addr = "127.0.0.1";
}

ParseOutcome parse_command_line(int argc, char** argv, const std::map<std::string, std::string>& pet, AgentOptions& o) {
  CLI::App app{"elastrun: elastic agent for PyTorch training on Slurm (torchrun-compatible)", "elastrun"};
  describe_usage(app);
  RawFlags raw;
  declare_flags(app, raw, o);

  // PET_<FLAG> defaults go first on the line: explicit flags (later) win (TakeLast).
  std::vector<std::string> args;
  const auto on_line = [&](std::string_view flag) {  // --flag or --flag=..., dashes or underscores
    std::string underscored(flag);
    std::replace(underscored.begin(), underscored.end(), '-', '_');
    for (int i = 1; i < argc; ++i)
      for (const auto& f : {std::string(flag), underscored})
        if (std::string_view(argv[i]) == f || std::string_view(argv[i]).starts_with(f + "=")) return true;
    return false;
  };
  for (const auto& [key, value] : pet) {
    // a repeatable flag adds up: its PET_ default is dropped when the line gives it
    if (key == "health_check" && on_line("--health-check")) continue;
    if (key == "nproc_per_node" || key == "nnodes" || app.get_option_no_throw("--" + key) != nullptr)
      args.push_back(fmt::format("--{}={}", key, value));
  }
  for (int i = 1; i < argc; ++i) args.emplace_back(argv[i]);
  std::reverse(args.begin(), args.end());  // CLI11 parses a reversed vector
  try {
    app.parse(args);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return ParseOutcome::Exit0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return ParseOutcome::Exit0;
  } catch (const CLI::ParseError& e) {
    throw UsageError(one_line(e.what()));
  }

  auto rest = app.remaining();
  // `elastrun [options] -- PROGRAM`: the end of our flags; how a program called like one of our
  // verbs (`elastrun -- run`) is run instead of the verb (main.cpp)
  const bool after_separator = !rest.empty() && rest.front() == "--";
  if (after_separator) rest.erase(rest.begin());
  if (rest.empty()) throw UsageError("no program to run: elastrun [options] PROGRAM [ARGS...]");
  if (!after_separator && rest.front().starts_with("-") && rest.front() != "-")
    throw UsageError(fmt::format("unknown option '{}'", rest.front()));
  o.program = rest.front();
  o.program_args.assign(rest.begin() + 1, rest.end());

  convert_values(app, raw, o);
  check_contradictions(raw, o);
  if (o.outcome_file.empty())
    if (const char* f = std::getenv("ELASTRUN_OUTCOME_FILE"); f && *f) o.outcome_file = f;
  if (o.metrics_dir.empty())
    if (const char* d = std::getenv("ELASTRUN_METRICS_DIR"); d && *d) o.metrics_dir = d;
  const char* python = std::getenv("ELASTRUN_PYTHON");
  o.python = python && *python ? python : "python3";
  return ParseOutcome::Run;
}

}  // namespace

ParseOutcome parse_agent_options(int argc, char** argv, const std::map<std::string, std::string>& pet,
                                 AgentOptions& o) {
  try {
    return parse_command_line(argc, argv, pet, o);
  } catch (const UsageError& e) {
    // A bad value that came from a PET_<FLAG> variable (no such flag on the line) names the
    // variable: the user never typed the flag the message would otherwise name.
    const std::string what = e.what();
    for (const auto& [key, value] : pet) {
      std::string flag = "--" + key;
      std::replace(flag.begin(), flag.end(), '_', '-');
      if (what.find(flag + "=") == std::string::npos && what.find(flag + " ") == std::string::npos) continue;
      std::string underscored = flag;
      std::replace(underscored.begin(), underscored.end(), '-', '_');
      bool on_line = false;
      for (int i = 1; i < argc && !on_line; ++i) {
        const std::string_view arg = argv[i];
        for (const auto& f : {flag, underscored}) on_line = on_line || arg == f || arg.starts_with(f + "=");
      }
      if (on_line) continue;
      std::string name = key;
      std::transform(name.begin(), name.end(), name.begin(), [](unsigned char c) { return std::toupper(c); });
      throw UsageError(
          fmt::format("PET_{}='{}' (the default for {}): {}", name, util::printable(value, 60), flag, what));
    }
    throw;
  }
}

}  // namespace elastrun::launcher
