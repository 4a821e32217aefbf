// ckpt_mutation_fixture, for test_ckpt_mutation.sh:
//   write DIR     saves steps 1 and 2 of the world-4 model (different values) into DIR
//   restore DIR   restore_latest on 3 thread-ranks (a resharding restore), whole tensors on every
//                 rank; prints {"step": N, "skipped": [...]} and exits 0 only if every rank got
//                 exactly the bytes of step N's model. Exit 3: nothing restorable; 1: an error.
#include <iostream>
#include <mutex>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

using namespace elastrun::ckpt;

namespace {
std::uint64_t model_seed(std::uint64_t step) { return 1000 * step; }

int restore(const std::filesystem::path& dir) {
  std::mutex mutex;
  std::vector<std::uint64_t> steps;
  nlohmann::json skipped = nlohmann::json::array();
  bool bytes_match = true;
  testing::run_ranks(3, [&](int rank, Communicator& comm) {
    const auto shape_of = testing::world4_model(0);  // names, dtypes and shapes only
    std::vector<std::vector<std::byte>> into;
    std::vector<TensorTarget> targets;
    into.reserve(shape_of.size());
    for (const auto& t : shape_of) {
      into.emplace_back(t.bytes.size());
      targets.push_back(TensorTarget::whole(t.name, t.dtype, t.shape, into.back().data()));
    }
    auto result = restore_latest(dir, targets, comm);
    std::lock_guard lock(mutex);
    if (!result) {
      steps.push_back(0);
      return;
    }
    steps.push_back(result->step);
    const auto expected = testing::world4_model(model_seed(result->step));
    for (std::size_t i = 0; i < expected.size(); ++i) bytes_match = bytes_match && into[i] == expected[i].bytes;
    if (rank == 0)
      for (const auto& s : result->skipped) skipped.push_back(s);
  });
  for (auto s : steps)
    if (s != steps.front()) {
      std::cerr << "ranks restored different steps\n";
      return 1;
    }
  const nlohmann::json out = {{"step", steps.front()}, {"skipped", skipped}, {"bytes_match", bytes_match}};
  std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  if (steps.front() == 0) return 3;
  return bytes_match ? 0 : 1;
}
}  // namespace

int main(int argc, char** argv) {
  const std::string verb = argc == 3 ? argv[1] : "";
  if (verb != "write" && verb != "restore") {
    std::cerr << "usage: ckpt_mutation_fixture write|restore DIR\n";
    return 2;
  }
  try {
    if (verb == "write") {
      for (std::uint64_t step : {1, 2}) testing::save_world4(argv[2], step, testing::world4_model(model_seed(step)));
      return 0;
    }
    return restore(argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "ckpt_mutation_fixture: " << e.what() << "\n";
    return 1;
  }
}
