#include "job_cli.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "batch_script.hpp"
#include "command.hpp"
#include "elastrun/slurm/api.hpp"
#include "elastrun/util/parse.hpp"
#include "job_dir.hpp"
#include "job_status.hpp"
#include "run_spec.hpp"

extern char** environ;

namespace elastrun::jobs {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// An error that ends the verb with one line (and `code`).
struct Failure : std::runtime_error {
  int code;
  Failure(int c, const std::string& what) : std::runtime_error(what), code(c) {}
};

constexpr const char* kSpecFile = "job.json";
constexpr const char* kCancelFile = "cancel.json";
constexpr const char* kLocalFile = "local.json";
constexpr const char* kLocalExitFile = "exit.json";

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::string(v) : fallback;
}

fs::path index_dir() {
  const std::string set = env_or(launcher::kIndexDirEnv, "");
  if (!set.empty()) return set;
  const std::string home = env_or("HOME", "");
  if (home.empty()) throw Failure(kExitError, "no HOME and no ELASTRUN_INDEX_DIR: nowhere to keep the job index");
  return fs::path(home) / ".elastrun" / "jobs";
}

std::string hostname() {
  char buf[256] = {};
  ::gethostname(buf, sizeof buf - 1);
  return buf;
}

std::string utc_text(double t, const char* format = "%Y-%m-%d %H:%M:%S UTC") {
  const std::time_t secs = static_cast<std::time_t>(t);
  std::tm tm{};
  ::gmtime_r(&secs, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

double now_s() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

void write_json_file(const fs::path& path, const json& j) {
  const fs::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << j.dump(2) << "\n";
    if (!out) throw Failure(kExitError, fmt::format("cannot write {}", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Failure(kExitError, fmt::format("cannot write {}: {}", path.string(), ec.message()));
}

json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  try {
    return json::parse(in);
  } catch (const json::exception&) {
    return nullptr;
  }
}

void write_text_file(const fs::path& path, const std::string& text, bool executable) {
  {
    std::ofstream out(path, std::ios::trunc);
    out << text;
    if (!out) throw Failure(kExitError, fmt::format("cannot write {}", path.string()));
  }
  if (executable) ::chmod(path.c_str(), 0755);
}

void make_private_dir(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir.parent_path(), ec);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw Failure(kExitError,
                  fmt::format("cannot create the job directory {}: {}", dir.string(), std::strerror(errno)));
}

// A new job's directory, empty: one an earlier job of the same id left (a test cluster restarted
// at job id 1, an index entry of an old sbatch job) is moved aside, never mixed with the new records.
void make_fresh_job_dir(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec))) {
    const fs::path aside = dir.string() + ".old-" + utc_text(now_s(), "%Y%m%d%H%M%S");
    fs::rename(dir, aside, ec);
    if (ec)
      throw Failure(kExitError, fmt::format("{} exists (an earlier job's?) and cannot be moved aside: {}", dir.string(),
                                            ec.message()));
    fmt::print(stderr, "elastrun run: note: moved an earlier job's directory {} aside to {}\n", dir.string(),
               aside.string());
  }
  make_private_dir(dir);
}

// INT, TERM, HUP and QUIT held back while a submitted job is on hold: the command finishes
// releasing (or cancelling) it before it can be stopped; never a job left held.
class HeldSignals {
 public:
  HeldSignals() {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&set, sig);
    ::sigprocmask(SIG_BLOCK, &set, &previous_);
  }
  ~HeldSignals() { ::sigprocmask(SIG_SETMASK, &previous_, nullptr); }
  HeldSignals(const HeldSignals&) = delete;
  HeldSignals& operator=(const HeldSignals&) = delete;

 private:
  sigset_t previous_;
};

std::string self_exe() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  if (ec) throw Failure(kExitError, "cannot find this elastrun binary (/proc/self/exe)");
  return p.string();
}

// ---- handles: slurm://<cluster>/<job id>, local://<host>/<app id>, or a bare Slurm job id ----

struct Handle {
  std::string scheduler;  // "slurm" or "local"
  std::string cluster;    // Slurm's ClusterName, or the host of a local job
  std::string id;
  std::string role, replica;  // log's /ROLE/REPLICA
  std::string text() const { return fmt::format("{}://{}/{}", scheduler, cluster, id); }
  fs::path index_entry() const {
    return scheduler == "local" ? index_dir() / "local" / id : index_dir() / cluster / id;
  }
};

std::string current_cluster() {
  const std::string name = slurm::cluster_name();
  if (name.empty())
    throw Failure(kExitError,
                  "Slurm is unreachable: slurmctld did not answer (is SLURM_CONF right? try `scontrol ping`)");
  return name;
}

Handle parse_handle(const std::string& text, bool with_path = false) {
  Handle h;
  std::string rest;
  if (const auto at = text.find("://"); at != std::string::npos) {
    h.scheduler = text.substr(0, at);
    if (h.scheduler == "local_cwd") h.scheduler = "local";
    if (h.scheduler != "slurm" && h.scheduler != "local")
      throw Failure(kExitUsage, fmt::format("bad handle '{}': slurm://CLUSTER/JOBID or local://HOST/APPID", text));
    rest = text.substr(at + 3);
    const auto slash = rest.find('/');
    if (slash == std::string::npos || slash == 0)
      throw Failure(kExitUsage, fmt::format("bad handle '{}': slurm://CLUSTER/JOBID or local://HOST/APPID", text));
    h.cluster = rest.substr(0, slash);
    rest = rest.substr(slash + 1);
  } else {
    h.scheduler = "slurm";
    rest = text;
  }
  std::vector<std::string> parts;
  std::stringstream ss(rest);
  for (std::string part; std::getline(ss, part, '/');) parts.push_back(part);
  if (parts.empty() || parts[0].empty() || parts.size() > (with_path ? 3u : 1u))
    throw Failure(kExitUsage, fmt::format("bad handle '{}'{}", text, with_path ? " (HANDLE[/ROLE[/REPLICA]])" : ""));
  h.id = parts[0];
  if (parts.size() > 1) h.role = parts[1];
  if (parts.size() > 2) h.replica = parts[2];
  if (h.scheduler == "slurm" && !slurm::numeric_job_id(h.id))
    throw Failure(kExitUsage, fmt::format("bad handle '{}': '{}' is not a Slurm job id", text, h.id));
  if (h.id.find("..") != std::string::npos) throw Failure(kExitUsage, fmt::format("bad handle '{}'", text));
  if (h.cluster.empty()) h.cluster = current_cluster();
  return h;
}

// ---- a job: its directory and records ----

struct Job {
  Handle handle;
  fs::path dir;  // "" when only Slurm knows the job
  json spec;     // job.json (null for a job not started by `elastrun run`)
  std::optional<slurm::JobRecord> slurm;
  // the job's cluster is the one slurmctld here answers for (a local job: this host). Otherwise
  // (two clusters sharing a home) only its directory answers: job 4711 here is another job.
  bool here = true;
};

Job locate(const Handle& h) {
  Job job;
  job.handle = h;
  std::error_code ec;
  const fs::path entry = h.index_entry();
  if (fs::is_directory(entry, ec)) job.dir = fs::canonical(entry, ec);
  job.here = h.scheduler == "slurm" ? h.cluster == slurm::cluster_name() : h.cluster == hostname();
  if (!job.here) {
    if (job.dir.empty())
      throw Failure(kExitError,
                    fmt::format("unknown handle {}: a job of {} {}, not in the index {}", h.text(),
                                h.scheduler == "slurm" ? "cluster" : "host", h.cluster, entry.parent_path().string()));
    job.spec = read_json_file(job.dir / kSpecFile);
    return job;
  }
  if (h.scheduler == "slurm") {
    const auto q = slurm::query_job(*slurm::numeric_job_id(h.id));
    // unreachable is not "forgotten": a pending requeued job would read as its last run's end
    if (!q.error.empty()) throw Failure(kExitError, fmt::format("Slurm is unreachable: {}", q.error));
    job.slurm = q.job;
    if (job.dir.empty() && job.slurm && !job.slurm->work_dir.empty()) {
      const fs::path guess = fs::path(job.slurm->work_dir) / ("elastrun-" + h.id);  // the agents' default
      if (fs::is_directory(guess, ec)) job.dir = guess;
    }
    if (job.dir.empty() && !job.slurm)
      throw Failure(kExitError, fmt::format("unknown handle {}: Slurm does not know job {} and it is not in the "
                                            "index {}",
                                            h.text(), h.id, (index_dir() / h.cluster).string()));
  } else if (job.dir.empty()) {
    throw Failure(kExitError,
                  fmt::format("unknown handle {}: not in the index {}", h.text(), (index_dir() / "local").string()));
  }
  if (!job.dir.empty()) job.spec = read_json_file(job.dir / kSpecFile);
  return job;
}

std::vector<json> read_events(const fs::path& dir) {
  std::vector<json> events;
  std::error_code ec;
  if (dir.empty() || !fs::is_directory(dir, ec)) return events;
  for (const auto& f : fs::directory_iterator(dir, ec)) {
    const auto name = f.path().filename().string();
    if (!name.starts_with("events-") || !name.ends_with(".jsonl")) continue;
    std::ifstream in(f.path());
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      try {
        auto e = json::parse(line);
        if (e.is_object() && e.value("v", 1) <= 1) events.push_back(std::move(e));
      } catch (const json::exception&) {  // a line cut short by a crash
      }
    }
  }
  return events;
}

// A process's start time (/proc/PID/stat field 22), "" when it is gone: with the pid, what tells
// the process we recorded from a later one that reused its pid.
std::string process_start(long pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat;
  if (!std::getline(in, stat)) return {};
  const auto close = stat.rfind(')');
  if (close == std::string::npos) return {};
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i)
    if (i == 22) return field;
  return {};
}

bool process_alive(long pid, const std::string& start) { return !start.empty() && process_start(pid) == start; }

struct StatusView {
  std::string app_state, slurm_state, outcome;
  bool cancel_requested = false;
  JobSummary summary;
};

StatusView status_of(const Job& job) {
  StatusView v;
  if (!job.dir.empty()) {
    const json outcome = read_json_file(job.dir / launcher::kOutcomeFileName);
    if (outcome.is_object()) v.outcome = outcome.value("outcome", "");
    v.cancel_requested = fs::exists(job.dir / kCancelFile);
    v.summary = summarise(read_events(job.dir));
  }
  if (job.handle.scheduler == "local") {
    const json local = read_json_file(job.dir / kLocalFile);
    const json exit = read_json_file(job.dir / kLocalExitFile);
    const auto alive = [&](const char* pid, const char* start) {
      return local.is_object() && job.here && process_alive(local.value(pid, 0L), local.value(start, ""));
    };
    if (exit.is_object())
      v.app_state = v.cancel_requested ? "CANCELLED" : exit.value("exit_code", 1) == 0 ? "SUCCEEDED" : "FAILED";
    else if (alive("pid", "start") || alive("waiter", "waiter_start"))  // the waiter: about to write exit.json
      v.app_state = "RUNNING";
    else if (!job.here)
      v.app_state = "UNKNOWN";  // another host's processes cannot be seen from here
    else
      v.app_state = local.is_object() ? (v.cancel_requested ? "CANCELLED" : "FAILED") : "SUBMITTED";
    return v;
  }
  if (job.slurm) v.slurm_state = job.slurm->state;
  v.app_state =
      job.here ? app_state(v.slurm_state, v.outcome, v.cancel_requested) : app_state("", v.outcome, v.cancel_requested);
  return v;
}

bool terminal(const std::string& app_state) {
  return app_state == "SUCCEEDED" || app_state == "FAILED" || app_state == "CANCELLED";
}

std::string seconds_text(double s) {
  if (s < 60) return fmt::format("{:.1f} s", s);
  if (s < 3600) return fmt::format("{:.1f} min", s / 60);
  return fmt::format("{:.1f} h", s / 3600);
}

json status_json(const Job& job, const StatusView& v) {
  const auto& s = v.summary;
  json j = {{"handle", job.handle.text()},
            {"state", v.app_state},
            {"slurm_state", v.slurm_state.empty() ? json(nullptr) : json(v.slurm_state)},
            {"job_dir", job.dir.string()},
            {"outcome", v.outcome.empty() ? json(nullptr) : json(v.outcome)},
            {"cancel_requested", v.cancel_requested},
            {"world_size", s.rounds.empty() ? json(nullptr) : json(s.rounds.back().world_size)},
            {"restarts", s.restarts},
            {"max_restarts", s.max_restarts < 0 ? json(nullptr) : json(s.max_restarts)},
            {"requeues", std::max<long>(s.requeues, job.slurm ? job.slurm->restart_count : 0)},
            {"step", s.step ? json(*s.step) : json(nullptr)},
            {"steps_per_s", s.steps_per_s ? json(*s.steps_per_s) : json(nullptr)},
            {"time_lost_s", s.time_lost_s},
            {"root_cause", s.root_cause.empty() ? json(nullptr) : json(s.root_cause)}};
  json rounds = json::array();
  for (const auto& r : s.rounds)
    rounds.push_back(
        {{"time", r.time}, {"generation", r.generation}, {"world_size", r.world_size}, {"members", r.members}});
  j["rounds"] = rounds;
  json lost = json::array();
  for (const auto& l : s.lost) lost.push_back({{"time", l.time}, {"node", l.node}, {"how", l.how}});
  j["nodes_lost"] = lost;
  for (const auto& [key, flagged] : {std::pair{"stragglers", &s.stragglers}, std::pair{"unhealthy", &s.unhealthy}}) {
    json list = json::array();
    for (const auto& f : *flagged) list.push_back({{"time", f.time}, {"node", f.node}, {"what", f.what}});
    j[key] = list;
  }
  if (s.checkpoint)
    j["checkpoint"] = {{"step", s.checkpoint->step},
                       {"tier", s.checkpoint->tier},
                       {"durable", s.checkpoint->tier == "file"},
                       {"time", s.checkpoint->time},
                       {"blocked_s", s.checkpoint->blocked_s}};
  else
    j["checkpoint"] = nullptr;
  if (job.slurm) j["nodes"] = job.slurm->nodes;
  if (job.spec.is_object()) j["name"] = job.spec.value("name", "");
  return j;
}

void print_status(const Job& job, const StatusView& v) {
  const auto& s = v.summary;
  fmt::print("{}  {}{}\n", job.handle.text(), v.app_state,
             v.slurm_state.empty() ? "" : fmt::format(" (Slurm: {})", v.slurm_state));
  if (job.spec.is_object())
    fmt::print("  {:<13}{} ({})\n", "job", job.spec.value("name", ""), job.spec.value("summary", ""));
  if (!job.dir.empty()) fmt::print("  {:<13}{}\n", "job dir", job.dir.string());
  if (job.slurm && !job.slurm->nodes.empty()) fmt::print("  {:<13}{}\n", "nodes", job.slurm->nodes);
  if (!s.rounds.empty()) {
    std::string history;
    for (const auto& r : s.rounds)
      history += fmt::format("{}{} at {}", history.empty() ? "" : ", ", r.world_size, utc_text(r.time, "%H:%M:%S"));
    fmt::print("  {:<13}{} (rounds: {})\n", "world size", s.rounds.back().world_size, history);
  }
  for (const auto& l : s.lost)
    fmt::print("  {:<13}{} at {}{}\n", "node lost", l.node, utc_text(l.time, "%H:%M:%S"),
               l.how.empty() ? "" : " (" + l.how + ")");
  for (const auto& f : s.unhealthy)
    fmt::print("  {:<13}{} at {} (health check {})\n", "node left", f.node, utc_text(f.time, "%H:%M:%S"), f.what);
  for (const auto& f : s.stragglers)
    fmt::print("  {:<13}{} at {}: {}\n", "straggler", f.node, utc_text(f.time, "%H:%M:%S"), f.what);
  fmt::print("  {:<13}{}{} (job-wide), requeues {}\n", "restarts", s.restarts,
             s.max_restarts >= 0 ? fmt::format(" of {}", s.max_restarts) : "",
             std::max<long>(s.requeues, job.slurm ? job.slurm->restart_count : 0));
  if (s.step)
    fmt::print("  {:<13}{}{} (at {})\n", "step", *s.step,
               s.steps_per_s ? fmt::format(", {:.2f} steps/s", *s.steps_per_s) : "", utc_text(s.step_time, "%H:%M:%S"));
  if (s.checkpoint)
    fmt::print("  {:<13}step {}, {} tier ({}), at {}\n", "checkpoint", s.checkpoint->step, s.checkpoint->tier,
               s.checkpoint->tier == "file" ? "durable" : "in memory, not durable",
               utc_text(s.checkpoint->time, "%H:%M:%S"));
  if (s.time_lost_s > 0 || !s.lost.empty())
    fmt::print("  {:<13}{} to failures\n", "time lost", seconds_text(s.time_lost_s));
  if (!s.root_cause.empty()) fmt::print("  {:<13}{}\n", "root cause", s.root_cause);
  if (!v.outcome.empty()) fmt::print("  {:<13}{}\n", "outcome", v.outcome);
}

Job refreshed(const Job& job) {
  Job j = job;
  if (j.handle.scheduler == "slurm" && j.here) {
    const auto q = slurm::query_job(*slurm::numeric_job_id(j.handle.id));
    if (q.error.empty()) j.slurm = q.job;
  }
  return j;
}

// Follows a job to its end, one progress line per change; the exit code of `run --wait`.
int follow(Job job) {
  std::string last;
  while (true) {
    job = refreshed(job);
    const auto v = status_of(job);
    const auto& s = v.summary;
    const std::string line =
        fmt::format("{} {}{}{}", job.handle.text(), v.app_state,
                    s.rounds.empty() ? "" : fmt::format(", world size {}", s.rounds.back().world_size),
                    s.step ? fmt::format(", step {}", *s.step) : "");
    if (line != last) {
      fmt::print("[{}] {}\n", utc_text(now_s(), "%H:%M:%S"), line);
      std::fflush(stdout);
      last = line;
    }
    if (terminal(v.app_state)) return v.app_state == "SUCCEEDED" ? kExitOk : kExitJobFailed;
    if (v.app_state == "UNKNOWN" && (!job.here || (job.handle.scheduler == "slurm" && !job.slurm)))
      throw Failure(kExitError, fmt::format("{}: {} and its directory has no outcome", job.handle.text(),
                                            job.here ? "Slurm forgot the job" : "a job of another cluster or host"));
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
}

// ---- run ----

json spec_json(const RunSpec& spec, const std::string& handle, const ScriptContext& ctx) {
  std::string summary = spec.component;
  const auto shape_text = [](const JobShape& j) {
    return fmt::format(" -j {}{}x{}", j.min_nodes == j.max_nodes ? "" : fmt::format("{}:", j.min_nodes), j.max_nodes,
                       j.nproc_per_node);
  };
  if (spec.component == "dist.ddp" && spec.het.empty())
    summary += shape_text({spec.min_nodes, spec.max_nodes, spec.nproc_per_node});
  json het = json::array();
  int min_nodes = spec.min_nodes, max_nodes = spec.max_nodes;
  if (!spec.het.empty()) {
    summary += " --het";
    min_nodes = max_nodes = 0;
    for (const auto& j : spec.het) {
      summary += shape_text(j);
      het.push_back({{"min", j.min_nodes}, {"max", j.max_nodes}, {"nproc_per_node", j.nproc_per_node}});
      min_nodes += j.min_nodes;
      max_nodes += j.max_nodes;
    }
  }
  json env = json::object();
  for (const auto& [k, v] : spec.env) env[k] = v;
  json cfg = json::object();
  for (const auto& [k, v] : spec.cfg) cfg[k] = v;
  return {{"handle", handle},
          {"name", job_name(spec)},
          {"component", spec.component},
          {"summary", summary},
          {"args", spec.words},
          {"scheduler", spec.scheduler},
          {"cfg", cfg},
          {"env", env},
          {"nodes", {{"min", min_nodes}, {"max", max_nodes}, {"spares", spec.spares}}},
          {"nproc_per_node", spec.nproc_per_node},
          {"het", het},
          {"script", spec.script},
          {"module", spec.module},
          {"command", spec.command},
          {"script_args", spec.script_args},
          {"max_retries", spec.max_retries},
          {"checkpoint_dir", spec.checkpoint_dir},
          {"submit_dir", ctx.submit_dir},
          {"elastrun", ctx.elastrun},
          {"submitted_at", now_s()},
          {"user", env_or("USER", "")}};
}

std::string cfg_value(const RunSpec& spec, const std::string& key) {
  std::string v;
  for (const auto& [k, value] : spec.cfg)
    if (k == key) v = value;
  return v;
}

int run_on_slurm(const RunSpec& spec, ScriptContext ctx) {
  std::string cluster = slurm::cluster_name();
  if (cluster.empty() && !spec.dryrun)
    throw Failure(kExitError,
                  "Slurm is unreachable: slurmctld did not answer (is SLURM_CONF right? try `scontrol ping`)");
  if (cluster.empty()) cluster = "CLUSTER";
  const std::string dir_setting = cfg_value(spec, "job_dir");
  ctx.job_dir = dir_setting.empty() ? (index_dir() / cluster / "%j").string() : fs::absolute(dir_setting).string();
  if (!dir_setting.empty() && ctx.job_dir.find("%j") == std::string::npos) ctx.job_dir += "/%j";
  const std::string script = batch_script(spec, ctx);
  if (spec.dryrun) {
    std::cout << script;
    return kExitOk;
  }
  // Submitted on hold: the job directory (its output file's directory) must exist before the job
  // can start, and its name needs the job id.
  const fs::path staging = index_dir() / cluster / ".submit";
  std::error_code ec;
  fs::create_directories(staging, ec);
  const fs::path file = staging / fmt::format("elastrun-run-{}-{}.sbatch", ::getpid(), static_cast<long>(now_s()));
  write_text_file(file, script, true);
  const HeldSignals held;
  const auto r = run_command({"sbatch", "--hold", "--parsable", file.string()});
  if (r.exit_code != 0) {
    fs::remove(file, ec);
    const std::string why = first_line(r.err).empty() ? first_line(r.out) : first_line(r.err);
    throw Failure(kExitError, fmt::format("sbatch refused the job: {}", why.empty() ? "(no message)" : why));
  }
  const std::string id = first_line(r.out).substr(0, first_line(r.out).find(';'));
  const auto numeric = slurm::numeric_job_id(id);
  if (!numeric) throw Failure(kExitError, fmt::format("sbatch printed no job id: '{}'", first_line(r.out)));
  Handle h{"slurm", cluster, id, "", ""};
  const auto give_up = [&](const std::string& why) {
    const std::string err = slurm::cancel_job(*numeric);
    return Failure(kExitError, err.empty() ? fmt::format("{}; job {} cancelled", why, id)
                                           : fmt::format("{}; job {} left on hold ({}): scancel {}", why, id, err, id));
  };
  try {
    const fs::path dir = launcher::replace_job_id(ctx.job_dir, id);
    make_fresh_job_dir(dir);
    fs::rename(file, dir / "job.sbatch", ec);
    if (ec) {
      fs::copy_file(file, dir / "job.sbatch", fs::copy_options::overwrite_existing, ec);
      if (ec) throw Failure(kExitError, fmt::format("cannot keep the script in {}: {}", dir.string(), ec.message()));
      fs::remove(file, ec);
    }
    write_json_file(dir / kSpecFile, spec_json(spec, h.text(), ctx));
    if (fs::absolute(dir) != fs::absolute(h.index_entry()))
      launcher::add_index_entry(h.index_entry().string(), dir.string());
    const auto released = run_command({"scontrol", "release", id});
    if (released.exit_code != 0)
      throw Failure(kExitError, fmt::format("cannot release job {}: {}", id, first_line(released.err)));
  } catch (const std::exception& e) {
    throw give_up(e.what());
  }
  fmt::print("{}\n", h.text());
  std::fflush(stdout);
  if (!spec.wait) return kExitOk;
  return follow(locate(h));
}

// -s local: one agent on this machine with --standalone, in the background (a waiter process of
// its own session records its pid and exit code in the job directory).
int run_locally(RunSpec spec, ScriptContext ctx) {
  const std::string app_id = fmt::format("{}-{}-{}", job_name(spec), utc_text(now_s(), "%Y%m%d%H%M%S"), ::getpid());
  const std::string dir_setting = cfg_value(spec, "job_dir");
  std::string dir_pattern = dir_setting;
  if (!dir_pattern.empty() && dir_pattern.find("%j") == std::string::npos) dir_pattern += "/%j";
  const fs::path dir = dir_setting.empty() ? index_dir() / "local" / app_id
                                           : fs::absolute(launcher::replace_job_id(dir_pattern, app_id));
  ctx.job_dir = dir.string();
  if (spec.component == "dist.ddp") {  // the same world on one machine
    spec.nproc_per_node *= spec.max_nodes;
    spec.min_nodes = spec.max_nodes = 1;
    spec.spares = 0;
  }
  std::string script = "#!/bin/bash\n";
  script += fmt::format("# Generated by `elastrun run` on {} from:\n#   elastrun run {}\n", ctx.generated_at,
                        comment_text(spec.words));
  script += "# -s local: this machine, one agent with --standalone (no Slurm).\nset -u\n";
  script += fmt::format("cd {}\nexport ELASTRUN_JOB_DIR={}\n", shell_quote(ctx.submit_dir), shell_quote(ctx.job_dir));
  for (const auto& [k, v] : spec.env) script += fmt::format("export {}={}\n", k, shell_quote(v));
  script += fmt::format("exec {} --standalone --nnodes=1", shell_quote(ctx.elastrun));
  for (const auto& w : agent_words(spec, ctx.python)) script += " \\\n  " + shell_quote(w);
  script += "\n";
  if (spec.dryrun) {
    std::cout << script;
    return kExitOk;
  }
  make_fresh_job_dir(dir);
  write_text_file(dir / "job.sh", script, true);
  const Handle h{"local", hostname(), app_id, "", ""};
  write_json_file(dir / kSpecFile, spec_json(spec, h.text(), ctx));
  if (fs::absolute(dir) != fs::absolute(h.index_entry()))
    launcher::add_index_entry(h.index_entry().string(), dir.string());
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t waiter = ::fork();
  if (waiter < 0) throw Failure(kExitError, fmt::format("cannot fork: {}", std::strerror(errno)));
  if (waiter == 0) {  // the waiter: one thread (the CLI starts none), detached from the caller
    ::setsid();
    ::signal(SIGCHLD, SIG_DFL);  // the agent's exit status must reach waitpid
    // nothing of the caller's: a `$(elastrun run -s local ...)` must not wait for the job
    const int null_fd = ::open("/dev/null", O_RDWR);
    if (null_fd >= 0) {
      for (int fd = 0; fd <= 2; ++fd) ::dup2(null_fd, fd);
      if (null_fd > 2) ::close(null_fd);
    }
    ::close_range(3, ~0U, 0);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    const std::string out = (dir / "batch.out").string();
    posix_spawn_file_actions_addopen(&actions, 1, out.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0600);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    const std::string sh = (dir / "job.sh").string();
    char* argv[] = {const_cast<char*>("/bin/bash"), const_cast<char*>(sh.c_str()), nullptr};
    pid_t agent = -1;
    const int rc = ::posix_spawn(&agent, "/bin/bash", &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    int code = 127;
    if (rc == 0) {
      try {
        write_json_file(dir / kLocalFile, {{"pid", agent},
                                           {"start", process_start(agent)},
                                           {"waiter", ::getpid()},
                                           {"waiter_start", process_start(::getpid())}});
      } catch (...) {
      }
      int status = 0;
      pid_t waited;
      while ((waited = ::waitpid(agent, &status, 0)) < 0 && errno == EINTR) {
      }
      code = waited != agent ? 127 : WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    try {
      write_json_file(dir / kLocalExitFile, {{"exit_code", code}, {"time", now_s()}});
    } catch (...) {
    }
    ::_exit(0);
  }
  // the waiter's record of the agent's pid comes first: status and cancel need it
  for (int i = 0; i < 100 && !fs::exists(dir / kLocalFile) && !fs::exists(dir / kLocalExitFile); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  fmt::print("{}\n", h.text());
  std::fflush(stdout);
  int rc = kExitOk;
  if (spec.wait) rc = follow(locate(h));
  if (spec.wait) ::waitpid(waiter, nullptr, 0);
  return rc;
}

const char* kRunHelp =
    "usage: elastrun run [-s slurm|local] [-cfg KEY=VALUE,...] [--dryrun] [--wait] COMPONENT [ARGS] [-- SCRIPT_ARGS]\n"
    "\n"
    "Components:\n"
    "  dist.ddp      one elastrun agent per node, elastic:\n"
    "                -j [MIN:]MAXxNPROC (e.g. -j 2:4x8), --script FILE or -m MODULE, --env K=V,...,\n"
    "                --max_retries N (requeues of the job after a failure: TorchX's meaning; default 0),\n"
    "                --max-restarts N (the agent's in-job worker restarts), --checkpoint-dir DIR, --spares N,\n"
    "                --preload MODULES, --memory-checkpoints[=BYTES], --signal SIG@SECONDS (checkpoint before\n"
    "                the time limit; default USR1@120; none: off), --cpu N, --gpu N, --memMB N, --name NAME,\n"
    "                --het -j SHAPE -j SHAPE...: a heterogeneous job, one component per -j (ranks in that order)\n"
    "  utils.python  one Python process: --script FILE, -m MODULE or -c CODE, --env, --name\n"
    "  utils.sh      one shell command: utils.sh COMMAND [ARGS...]\n"
    "\n"
    "-s slurm (default) submits a batch script (kept in the job directory as job.sbatch); -s local (alias\n"
    "local_cwd) runs the same component on this machine with --standalone. -cfg keys: partition, time,\n"
    "account, qos, constraint, comment, mail-user, mail-type, job_dir, nomem, and any sbatch long option\n"
    "(KEY= for a flag such as exclusive=). Prints the app handle (slurm://CLUSTER/JOBID,\n"
    "local://HOST/APPID) and exits; --wait follows the job to its end. --dryrun prints the script.\n"
    "Exit codes: 0 ok, 1 error (Slurm unreachable, sbatch refused), 2 usage, 3 the job failed (--wait).\n"
    "Docs: docs/jobs.md.\n";

int verb_run(const std::vector<std::string>& args) {
  for (const auto& a : args) {
    if (a == "--") break;
    if (a == "-h" || a == "--help") {
      std::cout << kRunHelp;
      return kExitOk;
    }
  }
  RunSpec spec;
  try {
    spec = parse_run(args);
  } catch (const UsageError& e) {
    throw Failure(kExitUsage, e.what());
  }
  ScriptContext ctx;
  ctx.elastrun = self_exe();
  ctx.submit_dir = fs::current_path().string();
  ctx.generated_at = utc_text(now_s(), "%Y-%m-%d %H:%M UTC");
  ctx.python = env_or("ELASTRUN_PYTHON", "python3");
  if (!spec.script.empty() && !fs::exists(spec.script))
    throw Failure(kExitUsage,
                  fmt::format("--script {}: no such file (relative paths are from {})", spec.script, ctx.submit_dir));
  return spec.scheduler == "local" ? run_locally(spec, ctx) : run_on_slurm(spec, ctx);
}

// ---- status, describe, list ----

struct Flags {
  std::vector<std::string> positional;
  std::map<std::string, std::string> values;
  std::set<std::string> flags;
};

// A verb's own small command line: `known_values` take a value, `known_flags` do not.
Flags parse_flags(const std::vector<std::string>& args, const std::set<std::string>& known_values,
                  const std::set<std::string>& known_flags, const std::string& verb) {
  Flags f;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.starts_with("-") && a.size() > 1) {
      const auto eq = a.find('=');
      const std::string name = a.substr(0, eq);
      if (known_values.contains(name)) {
        if (eq != std::string::npos) {
          f.values[name] = a.substr(eq + 1);
        } else if (i + 1 < args.size()) {
          f.values[name] = args[++i];
        } else {
          throw Failure(kExitUsage, fmt::format("{} needs a value (elastrun {} --help)", name, verb));
        }
        continue;
      }
      if (known_flags.contains(a)) {
        f.flags.insert(a);
        continue;
      }
      throw Failure(kExitUsage, fmt::format("unknown option '{}' for elastrun {} (elastrun {} --help)", a, verb, verb));
    }
    f.positional.push_back(a);
  }
  return f;
}

bool wants_help(const std::vector<std::string>& args, const char* help) {
  for (const auto& a : args)
    if (a == "-h" || a == "--help") {
      std::cout << help;
      return true;
    }
  return false;
}

const std::string& one_handle(const Flags& f, const char* verb) {
  if (f.positional.size() != 1)
    throw Failure(kExitUsage, fmt::format("elastrun {} takes one handle (e.g. slurm://CLUSTER/JOBID)", verb));
  return f.positional[0];
}

int verb_status(const std::vector<std::string>& args) {
  if (wants_help(args,
                 "usage: elastrun status HANDLE [--json] [--watch]\n"
                 "The job's state (TorchX's AppState names, Slurm's own state beside it), world size and\n"
                 "rounds, nodes lost, restarts and requeues, newest checkpoint, training step, time lost\n"
                 "to failures and the root cause of a failure. Works without Slurm accounting and after\n"
                 "the job left squeue (the job directory's records). --watch repeats until the end.\n"))
    return kExitOk;
  const auto f = parse_flags(args, {}, {"--json", "--watch"}, "status");
  Job job = locate(parse_handle(one_handle(f, "status")));
  if (f.flags.contains("--watch")) return follow(job);
  const auto v = status_of(job);
  if (f.flags.contains("--json"))
    std::cout << status_json(job, v).dump() << "\n";
  else
    print_status(job, v);
  return kExitOk;
}

int verb_describe(const std::vector<std::string>& args) {
  if (wants_help(args,
                 "usage: elastrun describe HANDLE [--json]\n"
                 "The component, its arguments, resources, environment and script of a job started with\n"
                 "elastrun run.\n"))
    return kExitOk;
  const auto f = parse_flags(args, {}, {"--json"}, "describe");
  const Job job = locate(parse_handle(one_handle(f, "describe")));
  if (!job.spec.is_object())
    throw Failure(kExitError, fmt::format("{} was not started with elastrun run: no {} in {}", job.handle.text(),
                                          kSpecFile, job.dir.empty() ? "(no job directory)" : job.dir.string()));
  if (f.flags.contains("--json")) {
    std::cout << job.spec.dump() << "\n";
    return kExitOk;
  }
  const auto& s = job.spec;
  fmt::print("{}  {}\n", job.handle.text(), s.value("name", ""));
  fmt::print("  {:<13}{}\n", "component", s.value("summary", ""));
  std::string line;
  for (const auto& w : s.value("args", std::vector<std::string>{})) line += (line.empty() ? "" : " ") + shell_quote(w);
  fmt::print("  {:<13}elastrun run {}\n", "command", line);
  fmt::print("  {:<13}{}\n", "scheduler", s.value("scheduler", ""));
  if (s.contains("nodes"))
    fmt::print("  {:<13}{} to {} node(s), {} spare(s), {} worker(s) per node\n", "resources",
               s["nodes"].value("min", 0), s["nodes"].value("max", 0), s["nodes"].value("spares", 0),
               s.value("nproc_per_node", 0));
  for (const char* key : {"cfg", "env"}) {
    const json pairs = s.value(key, json::object());  // kept: items() refers to it
    for (const auto& [k, v] : pairs.items())
      fmt::print("  {:<13}{}={}\n", key, k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  fmt::print("  {:<13}{}\n", "submit dir", s.value("submit_dir", ""));
  fmt::print("  {:<13}{}\n", "submitted", utc_text(s.value("submitted_at", 0.0)));
  fmt::print("  {:<13}{}\n", "job dir", job.dir.string());
  const fs::path script = job.dir / (job.handle.scheduler == "local" ? "job.sh" : "job.sbatch");
  std::ifstream in(script);
  if (in) {
    fmt::print("  {:<13}{}\n", "script", script.string());
    for (std::string l; std::getline(in, l);) fmt::print("    {}\n", l);
  }
  return kExitOk;
}

int verb_list(const std::vector<std::string>& args) {
  if (wants_help(args,
                 "usage: elastrun list [--all-users] [--json]\n"
                 "Jobs started with elastrun run, newest first, with their state and world size (this\n"
                 "user's index). --all-users: every user's elastrun run jobs slurmctld still knows.\n"))
    return kExitOk;
  const auto f = parse_flags(args, {}, {"--all-users", "--json"}, "list");
  if (!f.positional.empty()) throw Failure(kExitUsage, "elastrun list takes no handle");
  struct Row {
    double submitted;
    std::string handle, name, state, user;
    json world;
  };
  std::vector<Row> rows;
  if (f.flags.contains("--all-users")) {
    std::vector<slurm::JobRecord> all;
    if (auto err = slurm::query_jobs(all); !err.empty()) throw Failure(kExitError, "Slurm is unreachable: " + err);
    const std::string cluster = current_cluster();
    for (const auto& r : all) {
      if (!fs::path(r.command).filename().string().starts_with("elastrun-run-")) continue;
      rows.push_back({static_cast<double>(r.submit_time), fmt::format("slurm://{}/{}", cluster, r.job_id), r.name,
                      app_state_of_slurm(r.state), r.user, nullptr});
    }
  } else {
    std::error_code ec;
    const fs::path index = index_dir();
    std::string cluster = slurm::cluster_name();
    for (const auto& group : fs::directory_iterator(index, ec)) {
      if (!group.is_directory(ec)) continue;
      const std::string key = group.path().filename().string();
      if (key != "local" && key != cluster) continue;  // handles of other clusters cannot be asked here
      for (const auto& entry : fs::directory_iterator(group.path(), ec)) {
        const std::string id = entry.path().filename().string();
        if (id.starts_with(".")) continue;
        const json spec = read_json_file(entry.path() / kSpecFile);
        if (!spec.is_object()) continue;  // a job of sbatch's, not of elastrun run
        try {
          Job job = locate(parse_handle(spec.value("handle", "")));
          const auto v = status_of(job);
          rows.push_back({spec.value("submitted_at", 0.0), job.handle.text(), spec.value("name", ""), v.app_state,
                          spec.value("user", ""),
                          v.summary.rounds.empty() ? json(nullptr) : json(v.summary.rounds.back().world_size)});
        } catch (const Failure&) {
          rows.push_back({spec.value("submitted_at", 0.0), spec.value("handle", ""), spec.value("name", ""), "UNKNOWN",
                          spec.value("user", ""), nullptr});
        }
      }
    }
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) { return a.submitted > b.submitted; });
  if (f.flags.contains("--json")) {
    json out = json::array();
    for (const auto& r : rows)
      out.push_back({{"handle", r.handle},
                     {"name", r.name},
                     {"state", r.state},
                     {"user", r.user},
                     {"world_size", r.world},
                     {"submitted_at", r.submitted}});
    std::cout << out.dump() << "\n";
    return kExitOk;
  }
  fmt::print("{:<28} {:<16} {:<10} {:>5}  {}\n", "HANDLE", "NAME", "STATE", "WORLD", "SUBMITTED");
  for (const auto& r : rows)
    fmt::print("{:<28} {:<16} {:<10} {:>5}  {}\n", r.handle, r.name, r.state,
               r.world.is_number() ? std::to_string(r.world.get<int>()) : "-", utc_text(r.submitted, "%Y-%m-%d %H:%M"));
  return kExitOk;
}

// ---- log ----

struct RankLog {
  double started;
  std::string node;
  long rank;
  fs::path stdout_file, stderr_file;
};

// Every worker's log files, in the order their workers started, from the workers_started events.
std::vector<RankLog> rank_logs(const fs::path& dir) {
  auto events = read_events(dir);
  std::stable_sort(events.begin(), events.end(),
                   [](const json& a, const json& b) { return a.value("time", 0.0) < b.value("time", 0.0); });
  std::vector<RankLog> logs;
  for (const auto& e : events) {
    if (e.value("event", "") != "workers_started") continue;
    const auto ranks = e.value("ranks", std::vector<long>{});
    if (ranks.size() != 2) continue;
    const fs::path attempt =
        dir / e.value("node", "") / e.value("run_id", "") / fmt::format("attempt_{}", e.value("attempt", 0L));
    for (long r = ranks[0]; r <= ranks[1]; ++r) {
      const fs::path base = attempt / std::to_string(r - ranks[0]);
      logs.push_back({e.value("time", 0.0), e.value("node", ""), r, base / "stdout.log", base / "stderr.log"});
    }
  }
  return logs;
}

// --since: a duration back from now (90s, 10m, 2h, 1d; a bare number is seconds) or a time,
// YYYY-MM-DDTHH:MM[:SS] (a space for the T works too) in local time, or UTC with a trailing Z.
double parse_since(const std::string& text) {
  const auto bad =
      Failure(kExitUsage, fmt::format("bad --since '{}': a duration such as 90s, 10m or 2h, or a time such as "
                                      "2026-12-07T09:30 (local; add Z for UTC)",
                                      text));
  if (text.empty()) throw bad;
  if (text.size() >= 16 && text[4] == '-' && (text[10] == 'T' || text[10] == ' ')) {
    const bool utc = text.back() == 'Z';
    std::tm tm{};
    const std::string when = text.substr(0, text.size() - (utc ? 1 : 0));
    const char* end = strptime(when.c_str(), "%Y-%m-%dT%H:%M", &tm);
    if (!end) end = strptime(when.c_str(), "%Y-%m-%d %H:%M", &tm);
    if (end && *end == ':') end = strptime(end, ":%S", &tm);
    if (!end || *end != '\0') throw bad;
    tm.tm_isdst = -1;
    const std::time_t t = utc ? timegm(&tm) : std::mktime(&tm);
    if (t == static_cast<std::time_t>(-1)) throw bad;
    return static_cast<double>(t);
  }
  const char unit = text.back();
  const double scale = unit == 's' ? 1 : unit == 'm' ? 60 : unit == 'h' ? 3600 : unit == 'd' ? 86400 : 0;
  const auto n = util::parse_integer<long>(scale > 0 ? text.substr(0, text.size() - 1) : text);
  if (!n || *n < 0) throw bad;
  return now_s() - static_cast<double>(*n) * (scale > 0 ? scale : 1);
}

int verb_log(const std::vector<std::string>& args) {
  if (wants_help(args,
                 "usage: elastrun log HANDLE[/ROLE[/REPLICA]] [--rank N] [--tail] [--regex R] [--since T]\n"
                 "Every worker's output, each line prefixed [rank N], from the job directory (any working\n"
                 "directory). REPLICA: a node name or its index among the job's nodes; --rank: one global\n"
                 "rank; --since 10m (or 2026-12-07T09:30, local; Z: UTC): output of workers started since\n"
                 "then; --tail: follow the\n"
                 "job across re-forms and requeues until it ends.\n"))
    return kExitOk;
  const auto f = parse_flags(args, {"--rank", "--regex", "--since"}, {"--tail"}, "log");
  const Handle h = parse_handle(one_handle(f, "log"), true);
  const Job job = locate(h);
  if (job.dir.empty()) throw Failure(kExitError, fmt::format("{} has no job directory: no logs to show", h.text()));
  std::optional<long> rank;
  if (f.values.contains("--rank")) {
    rank = util::parse_integer_in<long>(f.values.at("--rank"), 0, 1L << 30);
    if (!rank) throw Failure(kExitUsage, fmt::format("bad --rank '{}': a global rank", f.values.at("--rank")));
  }
  std::optional<std::regex> pattern;
  if (f.values.contains("--regex")) {
    try {
      pattern.emplace(f.values.at("--regex"));
    } catch (const std::regex_error& e) {
      throw Failure(kExitUsage, fmt::format("bad --regex '{}': {}", f.values.at("--regex"), e.what()));
    }
  }
  const double since = f.values.contains("--since") ? parse_since(f.values.at("--since")) : 0;
  if (!h.role.empty() && job.spec.is_object() && h.role != job.spec.value("name", "") && h.role != "default")
    throw Failure(kExitUsage, fmt::format("unknown role '{}' of {}: its role is '{}'", h.role, h.text(),
                                          job.spec.value("name", "")));
  const bool tail = f.flags.contains("--tail");
  std::map<fs::path, std::uintmax_t> offsets;  // what was printed of each file
  std::map<fs::path, std::string> partial;     // a last line without its newline yet
  const auto print_new = [&](bool final_pass) {
    auto logs = rank_logs(job.dir);
    std::vector<std::string> nodes;
    for (const auto& l : logs)
      if (std::find(nodes.begin(), nodes.end(), l.node) == nodes.end()) nodes.push_back(l.node);
    std::sort(nodes.begin(), nodes.end());
    for (const auto& l : logs) {
      if (rank && l.rank != *rank) continue;
      if (l.started < since) continue;
      if (!h.replica.empty()) {
        const auto index = util::parse_integer<std::size_t>(h.replica);
        const bool match = l.node == h.replica || (index && *index < nodes.size() && nodes[*index] == l.node);
        if (!match) continue;
      }
      for (const auto& file : {l.stdout_file, l.stderr_file}) {
        std::ifstream in(file, std::ios::binary);
        if (!in) continue;
        in.seekg(static_cast<std::streamoff>(offsets[file]));
        std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        offsets[file] += chunk.size();
        std::string text = partial[file] + chunk;
        partial[file].clear();
        std::size_t start = 0;
        while (start < text.size()) {
          const auto end = text.find('\n', start);
          if (end == std::string::npos && !final_pass) {
            partial[file] = text.substr(start);
            break;
          }
          const std::string line = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
          start = end == std::string::npos ? text.size() : end + 1;
          if (pattern && !std::regex_search(line, *pattern)) continue;
          fmt::print("[rank {}] {}\n", l.rank, line);
        }
      }
    }
    std::fflush(stdout);
  };
  if (!tail) {
    print_new(true);
    return kExitOk;
  }
  while (true) {
    const auto v = status_of(refreshed(job));
    const bool ended = terminal(v.app_state);
    print_new(ended);
    if (ended) return kExitOk;
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

// ---- cancel ----

// "cancelled" is printed once Slurm says so too: a status or list right after shows it ended
// (bounded: about 10 s, then the caller reports what it did anyway).
void wait_until_slurm_ended(Job& job) {
  for (int i = 0; i < 40; ++i) {
    job = refreshed(job);
    if (!job.slurm || terminal(app_state_of_slurm(job.slurm->state))) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

int verb_cancel(const std::vector<std::string>& args) {
  if (wants_help(args,
                 "usage: elastrun cancel HANDLE [--now] [--timeout SECONDS]\n"
                 "Asks the running job's workers to checkpoint and stop (no requeue), waits for them (up\n"
                 "to --timeout, default 300 s), then cancels the job in Slurm. A pending job, and --now,\n"
                 "cancel at once (scancel). The job's state becomes CANCELLED.\n"))
    return kExitOk;
  const auto f = parse_flags(args, {"--timeout"}, {"--now"}, "cancel");
  Job job = locate(parse_handle(one_handle(f, "cancel")));
  double timeout = 300;
  if (f.values.contains("--timeout")) {
    const auto t = util::parse_integer_in<long>(f.values.at("--timeout"), 0, 86400);
    if (!t) throw Failure(kExitUsage, fmt::format("bad --timeout '{}': seconds", f.values.at("--timeout")));
    timeout = static_cast<double>(*t);
  }
  if (!job.here)
    throw Failure(kExitError, fmt::format("{} is a job of {} {}: cancel it there", job.handle.text(),
                                          job.handle.scheduler == "slurm" ? "cluster" : "host", job.handle.cluster));
  const auto before = status_of(job);
  if (terminal(before.app_state)) {
    fmt::print("{} already ended: {}\n", job.handle.text(), before.app_state);
    return kExitOk;
  }
  const bool now = f.flags.contains("--now");
  // the record first (the job may end the moment it is signalled: it must read as CANCELLED
  // then), taken back if the request cannot be delivered
  const fs::path record = job.dir.empty() ? fs::path() : job.dir / kCancelFile;
  if (!record.empty()) write_json_file(record, {{"time", now_s()}, {"user", env_or("USER", "")}, {"now", now}});
  const auto undelivered = [&](const std::string& why) {
    std::error_code ec;
    if (!record.empty()) fs::remove(record, ec);
    return Failure(kExitError, why);
  };
  const auto id = job.handle.scheduler == "slurm" ? *slurm::numeric_job_id(job.handle.id) : 0;
  if (job.handle.scheduler == "local") {
    const json local = read_json_file(job.dir / kLocalFile);
    const long pid = local.is_object() ? local.value("pid", 0L) : 0;
    if (pid <= 0 || !process_alive(pid, local.value("start", "")))
      throw undelivered(fmt::format("{}: its agent is not running (yet?)", job.handle.text()));
    if (::kill(static_cast<pid_t>(pid), now ? SIGKILL : SIGTERM) != 0)  // SIGTERM: checkpoint and stop
      throw undelivered(fmt::format("cannot signal the agent {}: {}", pid, std::strerror(errno)));
  } else {
    const bool running = before.app_state == "RUNNING";
    if (now || !running) {
      if (auto err = slurm::cancel_job(id); !err.empty())
        throw undelivered(fmt::format("cannot cancel job {}: {}", id, err));
      wait_until_slurm_ended(job);
      fmt::print("{} cancelled\n", job.handle.text());
      return kExitOk;
    }
    // SIGTERM to the steps only: each agent checkpoints and stops its workers; group rank 0 finds
    // the job neither preempted nor out of time and does not requeue (docs/launcher.md, Signals)
    if (auto err = slurm::signal_job_steps(id, SIGTERM); !err.empty())
      throw undelivered(fmt::format("cannot signal job {}: {}", id, err));
  }
  fmt::print("{}: asked the workers to checkpoint and stop (waiting up to {:.0f} s)\n", job.handle.text(), timeout);
  std::fflush(stdout);
  const double deadline = now_s() + timeout;
  double signalled = now_s();
  std::string outcome;
  while (now_s() < deadline) {
    job = refreshed(job);
    const auto v = status_of(job);
    outcome = v.outcome;
    if (!outcome.empty() || terminal(v.app_state) || (job.handle.scheduler == "slurm" && !job.slurm)) break;
    // a step that started after the signal (a batch script still before its srun) gets it too;
    // agents that have it already log and ignore a repeat
    if (job.handle.scheduler == "slurm" && now_s() - signalled >= 5) {
      slurm::signal_job_steps(id, SIGTERM);
      signalled = now_s();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  if (job.handle.scheduler == "slurm") {
    job = refreshed(job);
    if (job.slurm && app_state_of_slurm(job.slurm->state) != "SUCCEEDED" &&
        !terminal(app_state_of_slurm(job.slurm->state)))
      slurm::cancel_job(id);  // what is left: the batch script's end
    wait_until_slurm_ended(job);
  }
  fmt::print("{} cancelled{}\n", job.handle.text(),
             outcome == "checkpointed" ? " (the workers checkpointed first)"
             : outcome.empty()         ? " (no checkpoint confirmed within the timeout)"
                                       : " (outcome: " + outcome + ")");
  return kExitOk;
}

}  // namespace

bool is_job_verb(std::string_view word) {
  return word == "run" || word == "status" || word == "log" || word == "cancel" || word == "list" || word == "describe";
}

int run_job_verb(int argc, char** argv) {
  const std::string verb = argv[0];
  ::signal(SIGCHLD, SIG_DFL);  // sbatch's and scontrol's exit codes must reach waitpid
  const std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (verb == "run") return verb_run(args);
    if (verb == "status") return verb_status(args);
    if (verb == "log") return verb_log(args);
    if (verb == "cancel") return verb_cancel(args);
    if (verb == "list") return verb_list(args);
    if (verb == "describe") return verb_describe(args);
    throw Failure(kExitUsage, fmt::format("unknown verb '{}'", verb));
  } catch (const Failure& e) {
    fmt::print(stderr, "elastrun {}: {}\n", verb, e.what());
    return e.code;
  } catch (const std::exception& e) {
    fmt::print(stderr, "elastrun {}: {}\n", verb, e.what());
    return kExitError;
  }
}

}  // namespace elastrun::jobs
