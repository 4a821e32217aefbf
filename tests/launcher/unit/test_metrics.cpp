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

json ev(double t, const char* event, json fields) {
  json e = {{"v", 1}, {"time", t}, {"node", "n1"}, {"run_id", "7.r0"}, {"event", event}};
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
        ev(106.2, "round", {{"generation", 2}, {"world_size", 6}, {"restart_count", 0}})})
    s.apply(e);
  const auto text = render_metrics(s, {"7", "n1", "7.r\"0"}, 110);
  const std::string labels = "job=\"7\",node=\"n1\",run_id=\"7.r\\\"0\"";
  EXPECT_EQ(sample_line(text, "elastrun_world_size{"), "elastrun_world_size{" + labels + "} 6");
  EXPECT_EQ(sample_line(text, "elastrun_round{"), "elastrun_round{" + labels + "} 2");
  EXPECT_EQ(sample_line(text, "elastrun_node_losses_total{"), "elastrun_node_losses_total{" + labels + "} 1");
  EXPECT_EQ(sample_line(text, "elastrun_training_step{"), "elastrun_training_step{" + labels + "} 14");
  EXPECT_EQ(sample_line(text, "elastrun_step_seconds{"), "elastrun_step_seconds{" + labels + "} 0.5");
  EXPECT_EQ(sample_line(text, "elastrun_agent_state{"), "elastrun_agent_state{" + labels + ",state=\"MONITOR\"} 1");
  EXPECT_EQ(sample_line(text, "elastrun_seconds_since_progress{"), "elastrun_seconds_since_progress{" + labels + "} 5");
  EXPECT_EQ(sample_line(text, "elastrun_checkpoint_step{" + labels + ",tier=\"file\"}"),
            "elastrun_checkpoint_step{" + labels + ",tier=\"file\"} 10");
  EXPECT_EQ(sample_line(text, "elastrun_checkpoint_age_seconds{" + labels + ",tier=\"memory\"}"),
            "elastrun_checkpoint_age_seconds{" + labels + ",tier=\"memory\"} 5.5");
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

TEST(Metrics, TheWriterTailsTheLogAndRemovesItsFileAtTheEnd) {
  TempDir dir;
  const auto log = dir.path() / "events-n1.jsonl";
  std::ofstream(log) << ev(1, "round", {{"generation", 1}, {"world_size", 4}}).dump() << "\n"
                     << R"({"v":1,"time":2,"event":"step","st)";  // a line still being written
  std::string path;
  {
    MetricsWriter writer((dir.path() / "prom").string(), log.string(), {"9", "n/1", "9.r0"},
                         std::chrono::milliseconds(50));
    path = writer.path();
    EXPECT_EQ(std::filesystem::path(path).filename(), "elastrun-9-n_1.prom");
    std::ifstream first(path);
    const std::string text((std::istreambuf_iterator<char>(first)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("} 4\n"), std::string::npos) << text;
    std::ofstream(log, std::ios::app) << R"(ep":3})"
                                      << "\n"
                                      << ev(3, "round", {{"generation", 2}, {"world_size", 2}}).dump() << "\n";
    std::string now;
    for (int i = 0; i < 100 && now.find("elastrun_training_step{") == std::string::npos; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::ifstream again(path);
      now.assign((std::istreambuf_iterator<char>(again)), std::istreambuf_iterator<char>());
    }
    EXPECT_NE(now.find("elastrun_training_step{job=\"9\",node=\"n/1\",run_id=\"9.r0\"} 3"), std::string::npos) << now;
    EXPECT_NE(now.find("elastrun_world_size{job=\"9\",node=\"n/1\",run_id=\"9.r0\"} 2"), std::string::npos) << now;
    std::ofstream(dir.path() / "prom" / "elastrun-9-n3.prom") << "stale\n";
    writer.remove_node("n3");
    EXPECT_FALSE(std::filesystem::exists(dir.path() / "prom" / "elastrun-9-n3.prom"));
  }
  EXPECT_FALSE(std::filesystem::exists(path)) << "an ended agent's file lingers";
  for (const auto& f : std::filesystem::directory_iterator(dir.path() / "prom"))
    ADD_FAILURE() << "left behind: " << f.path();
}
