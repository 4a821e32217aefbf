// The collective decisions of saves and restores, typed: every rank sends rank 0 a RankVote (its
// outcome, why, and on success its report), rank 0 decides and broadcasts a Decision. One codec
// for both directions and both operations (save: create / write / commit; restore: check / copy),
// and for the forked snapshot writer's reply to its parent. Internal to ckpt/.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace elastrun::ckpt::detail {

struct RankVote {
  // Ok: done (report holds what it wrote). Error: a failure older steps would not fix (a save
  // failed, a caller mistake). Corrupt, Mismatch (restore only): try an older step.
  enum class Outcome { Ok = 0, Error = 1, Corrupt = 2, Mismatch = 3 };
  Outcome outcome = Outcome::Ok;
  std::string why;
  nlohmann::json report;  // Ok: the shard report of a save, null otherwise

  static RankVote ok(nlohmann::json report = nullptr) { return {Outcome::Ok, {}, std::move(report)}; }
  static RankVote error(std::string why) { return {Outcome::Error, std::move(why), nullptr}; }
  bool is_ok() const { return outcome == Outcome::Ok; }

  // Invalid UTF-8 in a message (a damaged file's bytes) is replaced, never thrown about.
  std::string encode() const;
  // Throws CheckpointError naming the text when it is not a vote (a damaged peer, a bug).
  static RankVote decode(std::string_view text);
};

struct Decision {
  // Go: proceed (value: e.g. the save's generation). Fail: every rank throws `error`.
  // Skip (restore): this step is damaged or does not fit; try an older one.
  enum class Action { Go = 0, Fail = 1, Skip = 2 };
  Action action = Action::Go;
  std::string error;                  // Fail
  std::string value;                  // Go: what rank 0 tells everyone (a generation token)
  std::vector<std::string> skipped;   // Skip: "rank R: why", one per rank that found damage
  std::string mismatch;               // Skip: the first rank's mismatch, if that was the reason
  std::vector<std::string> warnings;  // Go: things the save wants the caller to know

  static Decision go(std::string value = {}) { return {Action::Go, {}, std::move(value), {}, {}, {}}; }
  static Decision fail(std::string error) { return {Action::Fail, std::move(error), {}, {}, {}, {}}; }

  std::string encode() const;
  static Decision decode(std::string_view text);
};

std::vector<RankVote> decode_votes(const std::vector<std::string>& texts);

// "rank R: why; rank S: why" for every rank whose vote is not Ok ("" if all are).
std::string failed_ranks(const std::vector<RankVote>& votes);

}  // namespace elastrun::ckpt::detail
