// Fenced commits: before rank 0 renames a step into place, the elastrun agent of its node
// ($ELASTRUN_NODE_SOCKET, the worker contract's node endpoint) confirms that the node's round
// still holds a quorum on the rendezvous store and records the commit there (op commit_fence;
// docs/rendezvous.md, "Fenced commits"). A node cut off from the majority commits nothing: the
// agent cannot reach the quorum's store, or finds its round over or its lease gone.
#include <fmt/format.h>

#include <fstream>

#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/errors.hpp"
#include "elastrun/worker/node.hpp"
#include "steps.hpp"

namespace elastrun::ckpt {

std::string detail::fence_commit(const std::filesystem::path& step_dir) {
  const std::string address = worker::node_address_from_environment();
  if (address.empty()) return "";  // not under an elastrun agent (mpirun, srun --torch-env, tests)
  nlohmann::json reply;
  try {
    // the agent asks the store (1 s to connect, a heartbeat for the answer)
    reply = worker::node_request(address, {{"op", contract::node_op::kCommitFence}, {"what", step_dir.string()}},
                                 std::chrono::seconds(15))
                .body;
  } catch (const std::exception& e) {
    throw CheckpointError(
        fmt::format("{} not committed: the agent cannot confirm this node's round ({})", step_dir.string(), e.what()));
  }
  if (!reply.value("ok", false))
    throw CheckpointError(fmt::format("{} not committed (fenced): {}", step_dir.string(),
                                      reply.value("error", std::string("the agent refused"))));
  const auto token = reply.value("token", std::string());
  if (token.empty())
    throw CheckpointError(fmt::format("{} not committed: the agent's commit_fence answer has no token ({})",
                                      step_dir.string(), reply.dump()));
  return token;
}

std::string commit_token(const std::filesystem::path& step_dir) {
  std::ifstream in(step_dir / kCommitRecord);
  if (!in) return "";
  auto record = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!record.is_object()) return "";
  const auto token = record.find("fence_token");
  return token != record.end() && token->is_string() ? token->get<std::string>() : std::string();
}

}  // namespace elastrun::ckpt
