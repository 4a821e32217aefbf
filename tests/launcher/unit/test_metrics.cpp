// --metrics-dir (launcher/src/metrics.hpp): what the node's event log says, as node_exporter's
// textfile collector reads it. The format is checked line by line against the exposition format's
// rules that the collector enforces; the real collector is driven in slurm.launcher_metrics.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "metrics.hpp"
#include "temp_dir.hpp"

using namespace elastrun::launcher;
using elastrun::launcher::test_support::TempDir;
using nlohmann::json;

namespace {

json ev(double t, const char* event, json fields, const char* node = "n1", const char* run = "7.r0") {
  json e = {{"v", 1}, {"time", t}, {"node", node}, {"run_id", run}, {"event", event}};
  e.update(fields);
  return e;
}

std::string sample_line(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(prefix, 0) == 0) return line;
  return {};
}

}  // namespace

TEST(Metrics, WhatTheEventLogSaysInTheExpositionFormat) {
  MetricsState s;
  for (const auto& e :
       {ev(100, "state", {{"state", "RENDEZVOUS"}}),
        ev(101, "round", {{"generation", 1}, {"world_size", 8}, {"restart_count", 0}}),
        ev(102, "step", {{"rank", 0}, {"step", 10}}), ev(104, "step", {{"rank", 0}, {"step", 14}}),
        ev(104.5, "checkpoint_saved", {{"rank", 0}, {"step", 14}, {"tier", "memory"}, {"blocked_s", 0.01}}),
        ev(105, "checkpoint_saved",
           {{"rank", 0}, {"step", 10}, {"tier", "file"}, {"blocked_s", 0.2}, {"durable_s", 1.5}}),
        ev(106, "member_lost", {{"member", "n3"}}), ev(106.1, "state", {{"state", "MONITOR"}}),
        ev(106.15, "straggler", {{"member", "n4"}, {"member_rank", 7}, {"ratio", 2.5}}),
        ev(106.16, "health_check", {{"ok", false}, {"check", "command"}}),
        ev(106.2, "round", {{"generation", 2}, {"world_size", 6}, {"restart_count", 0}})})
    s.apply(e);
  const auto text = render_metrics(s, {"7", "n1", "7.r\"0"}, 110);
  const std::string labels = "job_id=\"7\",node=\"n1\",run_id=\"7.r\\\"0\"";
  EXPECT_EQ(sample_line(text, "elastrun_world_size{"), "elastrun_world_size{" + labels + "} 6");
  EXPECT_EQ(sample_line(text, "elastrun_round{"), "elastrun_round{" + labels + "} 2");
  EXPECT_EQ(sample_line(text, "elastrun_node_losses_total{"), "elastrun_node_losses_total{" + labels + "} 1");
  EXPECT_EQ(sample_line(text, "elastrun_restarts_total{"), "elastrun_restarts_total{" + labels + "} 0");
  EXPECT_EQ(sample_line(text, "elastrun_training_step{"), "elastrun_training_step{" + labels + "} 14");
  EXPECT_EQ(sample_line(text, "elastrun_step_seconds{"), "elastrun_step_seconds{" + labels + "} 0.5");
  EXPECT_EQ(sample_line(text, "elastrun_agent_state{"), "elastrun_agent_state{" + labels + ",state=\"MONITOR\"} 1");
  EXPECT_EQ(sample_line(text, "elastrun_seconds_since_progress{"), "elastrun_seconds_since_progress{" + labels + "} 5");
  EXPECT_EQ(sample_line(text, "elastrun_checkpoint_step{" + labels + ",tier=\"file\"}"),
            "elastrun_checkpoint_step{" + labels + ",tier=\"file\"} 10");
  EXPECT_EQ(sample_line(text, "elastrun_checkpoint_age_seconds{" + labels + ",tier=\"memory\"}"),
            "elastrun_checkpoint_age_seconds{" + labels + ",tier=\"memory\"} 5.5");
  EXPECT_EQ(sample_line(text, "elastrun_straggler_ratio{"),
            "elastrun_straggler_ratio{" + labels + ",member=\"n4\"} 2.5");
  EXPECT_EQ(sample_line(text, "elastrun_health_check_failures_total{"),
            "elastrun_health_check_failures_total{" + labels + "} 1");
  EXPECT_EQ(sample_line(text, "elastrun_checkpoint_durable_seconds{" + labels + ",tier=\"file\"}"),
            "elastrun_checkpoint_durable_seconds{" + labels + ",tier=\"file\"} 1.5");
  // the collector's rules: no timestamps, each family's lines together after its HELP and TYPE,
  // no family twice
  std::istringstream in(text);
  std::set<std::string> done;
  std::string current;
  const std::regex sample_re(R"(^([a-z_]+)\{[^}]*\} (-?[0-9.e+]+)$)");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# HELP ", 0) == 0) {
      current = line.substr(7, line.find(' ', 7) - 7);
      EXPECT_TRUE(done.insert(current).second) << current << " twice";
      continue;
    }
    if (line.rfind("# TYPE ", 0) == 0) continue;
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, sample_re)) << "not a sample without timestamp: " << line;
    EXPECT_EQ(m[1].str(), current) << line;
  }
  // every file has the same HELP/TYPE lines, samples or not
  const auto empty = render_metrics(MetricsState{}, {"8", "n2", "8.r0"}, 0);
  std::string headers_a, headers_b;
  for (auto [t, out] : {std::pair{&text, &headers_a}, std::pair{&empty, &headers_b}}) {
    std::istringstream lines(*t);
    for (std::string line; std::getline(lines, line);)
      if (line[0] == '#') *out += line + "\n";
  }
  EXPECT_EQ(headers_a, headers_b);
}

namespace {
std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}
// Polls `path` (up to 2 s) until it holds `text`; returns what it last held.
std::string await_text(const std::string& path, const std::string& text) {
  std::string now;
  for (int i = 0; i < 100 && (now = read_all(path)).find(text) == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return now;
}
}  // namespace

TEST(Metrics, TheWriterTailsThisRunsLinesAndRemovesItsFileAtTheEnd) {
  TempDir dir;
  const auto log = dir.path() / "events-n1.jsonl";
  std::ofstream(log) << ev(0.5, "round", {{"generation", 7}, {"world_size", 16}}, "n/1", "9.r-earlier").dump() << "\n"
                     << ev(0.6, "member_lost", {{"member", "n5"}}, "n2", "9.r0").dump() << "\n"
                     << ev(1, "round", {{"generation", 1}, {"world_size", 4}}, "n/1", "9.r0").dump() << "\n"
                     << R"({"v":1,"time":2,"node":"n/1","run_id":"9.r0","event":"step","st)";  // being written
  const std::string labels = "job_id=\"9\",node=\"n/1\",run_id=\"9.r0\"";
  std::string path;
  {
    MetricsWriter writer((dir.path() / "prom").string(), log.string(), {"9", "n/1", "9.r0"},
                         std::chrono::milliseconds(50));
    path = writer.path();
    EXPECT_EQ(std::filesystem::path(path).filename(), "elastrun-9.r0-n_1.prom");
    EXPECT_TRUE(std::filesystem::exists(path)) << "no file from the start";
    auto text = await_text(path, "elastrun_world_size{" + labels + "} 4");
    EXPECT_NE(text.find("elastrun_world_size{" + labels + "} 4"), std::string::npos) << text;
    EXPECT_NE(text.find("elastrun_node_losses_total{" + labels + "} 0"), std::string::npos)
        << "another node's or run's lines were counted:\n"
        << text;
    EXPECT_NE(text.find("elastrun_round{" + labels + "} 1"), std::string::npos) << text;
    EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::others_read,
              std::filesystem::perms::others_read);
    std::ofstream(log, std::ios::app) << R"(ep":3})"
                                      << "\n"
                                      << ev(3, "round", {{"generation", 2}, {"world_size", 2}}, "n/1", "9.r0").dump()
                                      << "\n";
    text = await_text(path, "elastrun_training_step{" + labels + "} 3");
    EXPECT_NE(text.find("elastrun_training_step{" + labels + "} 3"), std::string::npos) << text;
    EXPECT_NE(text.find("elastrun_world_size{" + labels + "} 2"), std::string::npos) << text;
    std::ofstream(dir.path() / "prom" / "elastrun-9.r0-n3.prom") << "stale\n";
    writer.remove_node("n3");
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "prom" / "elastrun-9.r0-n3.prom"));
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "an ended agent's file lingers";
  for (const auto& f : std::filesystem::directory_iterator(dir.path() / "prom"))
    ADD_FAILURE() << "left behind: " << f.path();
}

TEST(Metrics, TheFileIsRemovedOnTheAgentsUnwoundExitPaths) {
  TempDir dir;
  const auto log = dir.path() / "events.jsonl";
  std::ofstream(log) << "";
  MetricsWriter writer((dir.path() / "prom").string(), log.string(), {"9", "n1", "9.r0"}, std::chrono::seconds(10));
  ASSERT_TRUE(std::filesystem::exists(writer.path()));
  remove_metrics_file_now();  // what signals.cpp does before _exit
  EXPECT_FALSE(std::filesystem::exists(writer.path()));
}
