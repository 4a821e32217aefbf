#include "metrics.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

namespace elastrun::launcher {

namespace fs = std::filesystem;

namespace {

std::string text_of(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

std::optional<std::int64_t> int_of(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  if (it == e.end() || !it->is_number_integer()) return std::nullopt;
  return it->get<std::int64_t>();
}

double real_of(const nlohmann::json& e, const char* key) {
  auto it = e.find(key);
  return it != e.end() && it->is_number() ? it->get<double>() : 0.0;
}

// A label value in the exposition format: \, " and newline escaped.
std::string label_value(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

// A number as Prometheus reads it (a double; integers without a fraction).
std::string number(double v) { return fmt::format("{}", v); }

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The live file's path for remove_metrics_file_now(): a fixed buffer, set before it is readable.
char g_exit_path[4096];
std::atomic<bool> g_exit_path_set{false};

constexpr std::uintmax_t kMaxReadPerRefresh = 8u << 20;  // a long log is caught up over a few refreshes

}  // namespace

void MetricsState::apply(const nlohmann::json& e) {
  if (!e.is_object()) return;
  const std::string kind = text_of(e, "event");
  const double t = real_of(e, "time");
  if (kind == "state") {
    state = text_of(e, "state");
  } else if (kind == "round") {
    generation = int_of(e, "generation").value_or(generation);
    world_size = static_cast<int>(int_of(e, "world_size").value_or(world_size));
    restarts = int_of(e, "restart_count").value_or(restarts);
  } else if (kind == "straggler") {
    if (const auto member = text_of(e, "member"); !member.empty()) stragglers[member] = real_of(e, "ratio");
  } else if (kind == "health_check") {
    if (e.contains("ok") && e["ok"].is_boolean() && !e["ok"].get<bool>()) ++health_check_failures;
  } else if (kind == "member_lost" || kind == "store_lost") {
    ++node_losses;
  } else if (kind == "failure_decision") {
    if (auto r = int_of(e, "restarts"); r && *r >= 0) restarts = std::max(restarts, *r);
  } else if (kind == "workers_started") {
    restarts = int_of(e, "restart_count").value_or(restarts);
  } else if (kind == "step") {
    const auto s = int_of(e, "step");
    if (!s) return;
    if (step && step_time > 0 && *s > *step) step_seconds = (t - step_time) / static_cast<double>(*s - *step);
    step = s;
    step_time = t;
    progress_time = std::max(progress_time, t);
  } else if (kind == "checkpoint_saved") {
    const std::string tier = text_of(e, "tier").empty() ? "file" : text_of(e, "tier");
    auto& c = checkpoints[tier];
    c.step = int_of(e, "step").value_or(c.step);
    c.time = t;
    c.blocked_s = real_of(e, "blocked_s");
    c.durable_s = real_of(e, "durable_s");
    progress_time = std::max(progress_time, t);
  }
}

std::string render_metrics(const MetricsState& s, const MetricsLabels& l, double now) {
  const std::string base = fmt::format("job_id=\"{}\",node=\"{}\",run_id=\"{}\"", label_value(l.job_id),
                                       label_value(l.node), label_value(l.run_id));
  // every family's HELP and TYPE, always (the same lines in every file), then its samples
  struct Family {
    const char* name;
    const char* type;
    const char* help;
    std::vector<std::pair<std::string, double>> samples;  // (extra labels, value)
  };
  std::vector<Family> families = {
      {"elastrun_up", "gauge", "1 while the node's elastrun agent runs (the file goes with it).", {{"", 1}}},
      {"elastrun_agent_state", "gauge", "The agent's state (1 for the current one).", {}},
      {"elastrun_world_size", "gauge", "Workers in the newest round.", {{"", s.world_size}}},
      {"elastrun_round",
       "gauge",
       "The newest rendezvous round (generation).",
       {{"", static_cast<double>(s.generation)}}},
      {"elastrun_restarts_total",
       "counter",
       "Job-wide worker restarts of this run (node losses are not counted).",
       {{"", static_cast<double>(s.restarts)}}},
      {"elastrun_node_losses_total",
       "counter",
       "Members of the round this agent saw lost.",
       {{"", static_cast<double>(s.node_losses)}}},
      {"elastrun_training_step", "gauge", "The newest training step (rank 0's step events).", {}},
      {"elastrun_step_seconds", "gauge", "Seconds per training step, between the last two step events.", {}},
      {"elastrun_last_progress_timestamp_seconds", "gauge", "When the workers last reported a step or checkpoint.", {}},
      {"elastrun_seconds_since_progress",
       "gauge",
       "Seconds since the last step or checkpoint, when the file was written.",
       {}},
      {"elastrun_checkpoint_step", "gauge", "The newest checkpoint's step, per tier.", {}},
      {"elastrun_checkpoint_age_seconds", "gauge", "Seconds since the newest checkpoint, per tier.", {}},
      {"elastrun_checkpoint_blocked_seconds", "gauge", "Seconds training was blocked by the newest checkpoint.", {}},
      {"elastrun_checkpoint_durable_seconds", "gauge", "Seconds until the newest checkpoint was durable.", {}},
      {"elastrun_straggler_ratio",
       "gauge",
       "A straggler group rank 0 named (--straggler-action): its compute time / the median node's.",
       {}},
      {"elastrun_health_check_failures_total",
       "counter",
       "This node's failed --health-check runs (it left the job).",
       {{"", static_cast<double>(s.health_check_failures)}}},
  };
  const auto add = [&](std::string_view name, std::string extra, double value) {
    for (auto& f : families)
      if (name == f.name) f.samples.emplace_back(std::move(extra), value);
  };
  if (!s.state.empty()) add("elastrun_agent_state", fmt::format(",state=\"{}\"", label_value(s.state)), 1);
  if (s.step) add("elastrun_training_step", "", static_cast<double>(*s.step));
  if (s.step_seconds) add("elastrun_step_seconds", "", *s.step_seconds);
  if (s.progress_time > 0) {
    add("elastrun_last_progress_timestamp_seconds", "", s.progress_time);
    add("elastrun_seconds_since_progress", "", std::max(0.0, now - s.progress_time));
  }
  for (const auto& [member, ratio] : s.stragglers)
    add("elastrun_straggler_ratio", fmt::format(",member=\"{}\"", label_value(member)), ratio);
  for (const auto& [tier, c] : s.checkpoints) {
    const std::string tl = fmt::format(",tier=\"{}\"", label_value(tier));
    add("elastrun_checkpoint_step", tl, static_cast<double>(c.step));
    add("elastrun_checkpoint_age_seconds", tl, std::max(0.0, now - c.time));
    add("elastrun_checkpoint_blocked_seconds", tl, c.blocked_s);
    add("elastrun_checkpoint_durable_seconds", tl, c.durable_s);
  }
  std::string out;
  for (const auto& f : families) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f.name, f.help, f.name, f.type);
    for (const auto& [extra, value] : f.samples)
      out += fmt::format("{}{{{}{}}} {}\n", f.name, base, extra, number(value));
  }
  return out;
}

void remove_metrics_file_now() noexcept {
  if (g_exit_path_set.load(std::memory_order_acquire)) ::unlink(g_exit_path);
}

std::string metrics_file_name(const std::string& run_id, const std::string& node) {
  std::string name = fmt::format("elastrun-{}-{}", run_id, node);
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  return name + ".prom";
}

MetricsWriter::MetricsWriter(std::string dir, std::string events_path, MetricsLabels labels,
                             std::chrono::milliseconds interval)
    : dir_(std::move(dir)),
      events_path_(std::move(events_path)),
      path_((fs::path(dir_) / metrics_file_name(labels.run_id, labels.node)).string()),
      labels_(std::move(labels)),
      interval_(interval) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (path_.size() < sizeof g_exit_path) {
    std::copy(path_.begin(), path_.end(), g_exit_path);
    g_exit_path[path_.size()] = '\0';
    g_exit_path_set.store(true, std::memory_order_release);
  }
  write_file();  // the file exists from the start; the thread reads the log (a requeued job's is long)
  thread_ = std::thread([this] { run(); });
}

MetricsWriter::~MetricsWriter() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  g_exit_path_set.store(false, std::memory_order_release);
  std::error_code ec;
  fs::remove(path_, ec);  // an ended job's file does not linger
}

void MetricsWriter::remove_node(const std::string& node) const {
  std::error_code ec;
  fs::remove(fs::path(dir_) / metrics_file_name(labels_.run_id, node), ec);
}

void MetricsWriter::run() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    lock.unlock();
    refresh();
    lock.lock();
    wake_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

void MetricsWriter::refresh() {
  // the node's event log: what was appended since the last read (whole lines only)
  if (std::ifstream in(events_path_, std::ios::binary); in) {
    in.seekg(0, std::ios::end);
    const auto size = static_cast<std::uintmax_t>(in.tellg());
    if (size < offset_) {  // replaced: read it again from a clean state
      offset_ = 0;
      partial_.clear();
      state_ = MetricsState{};
    }
    in.seekg(static_cast<std::streamoff>(offset_));
    std::string chunk(std::min(size - offset_, kMaxReadPerRefresh), '\0');
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    chunk.resize(static_cast<std::size_t>(in.gcount()));
    offset_ += chunk.size();
    std::string text = partial_ + chunk;
    std::size_t start = 0;
    for (auto end = text.find('\n'); end != std::string::npos; end = text.find('\n', start)) {
      const auto line = std::string_view(text).substr(start, end - start);
      start = end + 1;
      const auto e = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      // this run's and this node's lines: a requeued job's log holds its earlier runs, and
      // --events may name a file other nodes write too
      if (e.is_discarded() || !e.is_object() || e.value("run_id", "") != labels_.run_id ||
          e.value("node", "") != labels_.node)
        continue;
      state_.apply(e);
    }
    partial_ = text.substr(start);
  }
  write_file();
}

void MetricsWriter::write_file() {
  const std::string tmp = path_ + fmt::format(".tmp.{}", ::getpid());
  std::error_code ec;
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << render_metrics(state_, labels_, now_seconds());
    out.close();
    // node_exporter usually runs as its own user: readable whatever the agent's umask
    fs::permissions(
        tmp, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read, ec);
    if (!out) {
      fs::remove(tmp, ec);
      if (!warned_) spdlog::warn("warning: cannot write the metrics file {}", tmp);
      warned_ = true;
      return;
    }
  }
  fs::rename(tmp, path_, ec);
  if (ec) {
    const std::string why = ec.message();
    fs::remove(tmp, ec);
    if (!warned_) spdlog::warn("warning: cannot write the metrics file {}: {}", path_, why);
    warned_ = true;
  }
}

}  // namespace elastrun::launcher
