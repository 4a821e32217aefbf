#include "vote.hpp"

#include <fmt/format.h>

#include "elastrun/ckpt/checkpoint.hpp"

namespace elastrun::ckpt::detail {

using json = nlohmann::json;

namespace {
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json parse_object(std::string_view text, std::string_view what) {
  json j = json::parse(text, nullptr, false);
  if (!j.is_object())
    throw CheckpointError(fmt::format("internal: a {} is not a JSON object: '{}'", what, text.substr(0, 200)));
  return j;
}
}  // namespace

std::string RankVote::encode() const {
  return dump({{"outcome", static_cast<int>(outcome)}, {"why", why}, {"report", report}});
}

RankVote RankVote::decode(std::string_view text) {
  const json j = parse_object(text, "rank's vote");
  try {
    const int outcome = j.at("outcome").get<int>();
    if (outcome < 0 || outcome > static_cast<int>(Outcome::Mismatch)) throw std::out_of_range("outcome");
    return {static_cast<Outcome>(outcome), j.at("why").get<std::string>(), j.value("report", json())};
  } catch (const std::exception& e) {
    throw CheckpointError(
        fmt::format("internal: a rank's vote is malformed ({}): '{}'", e.what(), text.substr(0, 200)));
  }
}

std::string Decision::encode() const {
  return dump({{"action", static_cast<int>(action)},
               {"error", error},
               {"value", value},
               {"skipped", skipped},
               {"mismatch", mismatch},
               {"warnings", warnings}});
}

Decision Decision::decode(std::string_view text) {
  const json j = parse_object(text, "decision");
  try {
    const int action = j.at("action").get<int>();
    if (action < 0 || action > static_cast<int>(Action::Skip)) throw std::out_of_range("action");
    return {static_cast<Action>(action),         j.at("error").get<std::string>(),
            j.at("value").get<std::string>(),    j.at("skipped").get<std::vector<std::string>>(),
            j.at("mismatch").get<std::string>(), j.at("warnings").get<std::vector<std::string>>()};
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("internal: a decision is malformed ({}): '{}'", e.what(), text.substr(0, 200)));
  }
}

std::vector<RankVote> decode_votes(const std::vector<std::string>& texts) {
  std::vector<RankVote> votes;
  votes.reserve(texts.size());
  for (const auto& t : texts) votes.push_back(RankVote::decode(t));
  return votes;
}

std::string failed_ranks(const std::vector<RankVote>& votes) {
  std::vector<std::string> failed;
  for (std::size_t r = 0; r < votes.size(); ++r)
    if (!votes[r].is_ok()) failed.push_back(fmt::format("rank {}: {}", r, votes[r].why));
  return fmt::format("{}", fmt::join(failed, "; "));
}

}  // namespace elastrun::ckpt::detail
