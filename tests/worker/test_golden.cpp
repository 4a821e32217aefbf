// The worker contract's golden vectors (tests/worker/golden/*.json), read by this test and by
// test_worker_contract.py: both languages must write the same event lines and progress records
// and parse the same control lines, and the agent's readers and writers agree with them.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "control_file.hpp"
#include "elastrun/control.hpp"
#include "elastrun/worker/contract.hpp"
#include "elastrun/worker/events.hpp"
#include "events.hpp"
#include "hang_watch.hpp"
#include "temp_dir.hpp"

namespace {

namespace fs = std::filesystem;
using nlohmann::ordered_json;

ordered_json golden(const std::string& name) {
  std::ifstream in(fs::path(ELASTRUN_GOLDEN_DIR) / name);
  EXPECT_TRUE(in) << "cannot read " << name;
  return ordered_json::parse(in)["cases"];
}

TEST(Golden, EventLines) {
  for (const auto& c : golden("events.json")) {
    std::optional<int> rank;
    if (!c["rank"].is_null()) rank.emplace(c["rank"].get<int>());
    EXPECT_EQ(
        elastrun::worker::event_line(c["time"].get<double>(), c["node"].get<std::string>(),
                                     c["run_id"].get<std::string>(), c["event"].get<std::string>(), rank, c["fields"]),
        c["line"].get<std::string>());
    if (!rank) {  // the agent's lines are the same writer's
      EXPECT_EQ(
          elastrun::launcher::event_line(c["time"].get<double>(), c["node"].get<std::string>(),
                                         c["run_id"].get<std::string>(), c["event"].get<std::string>(), c["fields"]),
          c["line"].get<std::string>());
    }
  }
}

TEST(Golden, ControlLines) {
  namespace control = elastrun::control;
  for (const auto& c : golden("control.json")) {
    const auto text = c["text"].get<std::string>();
    const auto parsed = control::parse(text);
    if (c["request"].is_null()) {
      EXPECT_FALSE(parsed.has_value()) << "'" << text << "'";
      continue;
    }
    ASSERT_TRUE(parsed.has_value()) << "'" << text << "'";
    EXPECT_EQ(control::to_string(parsed->request), c["request"].get<std::string>());
    EXPECT_EQ(parsed->sequence, c["sequence"].get<std::uint64_t>());
    const auto canonical = elastrun::launcher::control_line(*parsed);
    EXPECT_EQ(canonical, std::to_string(parsed->sequence) + " " + c["request"].get<std::string>() + "\n");
    EXPECT_EQ(control::parse(canonical)->sequence, parsed->sequence);
  }
}

TEST(Golden, ProgressRecords) {
  for (const auto& c : golden("progress.json")) {
    const auto step = c["step"].get<long>();
    char record[elastrun::contract::kProgressRecordSize + 1];
    std::snprintf(record, sizeof record, elastrun::contract::kProgressRecordFormat, step);
    EXPECT_EQ(std::string(record), c["record"].get<std::string>());
    EXPECT_EQ(c["record"].get<std::string>().size(), elastrun::contract::kProgressRecordSize);
    const auto back = elastrun::launcher::parse_progress_record(record);
    if (step < 0) {
      EXPECT_FALSE(back.has_value());
    } else {
      EXPECT_EQ(back, step);
    }
  }
}

// progress(step, compute_s) from a fresh process: the file holds the last step and the compute
// time so far; the agent reads both back (Python writes the same: test_worker_contract.py).
TEST(Golden, ProgressWithComputeTime) {
  std::ifstream in(fs::path(ELASTRUN_GOLDEN_DIR) / "progress_compute.json");
  const auto golden_file = ordered_json::parse(in);
  elastrun::launcher::test_support::TempDir dir;
  const auto path = dir.path() / "progress";
  ::setenv(elastrun::contract::env::kProgressFile.data(), path.c_str(), 1);  // before the first progress()
  for (const auto& call : golden_file["calls"]) elastrun::control::progress(call[0].get<long>(), call[1].get<double>());
  std::ifstream written(path);
  const std::string text((std::istreambuf_iterator<char>(written)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, golden_file["file"].get<std::string>());
  const auto back = elastrun::launcher::read_progress(path.string());
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->step, golden_file["calls"].back()[0].get<long>());
  EXPECT_EQ(back->compute_us, 750002);
}

// The writer: one line per write, every line of schema v1, the rank when it has one.
TEST(EventWriter, AppendsWholeLinesOfSchemaV1) {
  elastrun::launcher::test_support::TempDir dir;
  const auto path = (dir.path() / "events-n1.jsonl").string();
  {
    elastrun::worker::EventWriter agent(path, "n1", "5.r0");
    elastrun::worker::EventWriter worker(path, "n1", "5.r0", 3);
    ASSERT_TRUE(agent.write(elastrun::contract::event::kState, {{"state", "MONITOR"}}));
    ASSERT_TRUE(worker.write(elastrun::contract::event::kStep, {{"step", 1}}));
  }
  std::ifstream in(path);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["v"], elastrun::contract::kEventsSchemaVersion);
    EXPECT_EQ(j.contains("rank"), j["event"] == "step");
    ++lines;
  }
  EXPECT_EQ(lines, 2);
  EXPECT_THROW(elastrun::worker::EventWriter("/proc/no/such/file", "n", "r"), std::system_error);
  ::unsetenv("ELASTRUN_EVENTS_FILE");
  EXPECT_FALSE(elastrun::worker::EventWriter::from_environment(0).enabled());
}

}  // namespace
