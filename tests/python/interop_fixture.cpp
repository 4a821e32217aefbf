// The C++ side of the Python interop test (test_interop.py), without libtorch:
//   interop_fixture write DIR   two thread-ranks save step 11 (replicated and sharded tensors of
//                               several dtypes, metadata) with the C++ library
//   interop_fixture read DIR    restores the newest step, every tensor it holds, and prints
//                               {"step", "metadata", "tensors": {name: {dtype, shape, hex}}}
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "elastrun/ckpt/checkpoint.hpp"

namespace ckpt = elastrun::ckpt;

namespace {

int write(const std::string& dir) {
  std::vector<float> w(15);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i) * 0.25F;
  const std::vector<std::int64_t> steps{1, -2, 3, -4};
  const std::vector<std::uint8_t> flags{1, 0, 1};
  const std::vector<std::uint16_t> half{0x3f80, 0xc000};  // bfloat16 1.0, -2.0
  std::vector<double> table(8);
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = static_cast<double>(i);
  ckpt::InProcessGroup group(2);
  std::vector<std::string> errors(2);
  {
    std::vector<std::jthread> ranks;
    for (int rank = 0; rank < 2; ++rank) {
      ranks.emplace_back([&, rank] {
        try {
          const std::uint64_t first_row = static_cast<std::uint64_t>(rank) * 2;
          std::vector<ckpt::TensorView> views{
              ckpt::TensorView::replicated("model/w", ckpt::DType::float32, {5, 3}, w.data()),
              ckpt::TensorView::replicated("model/steps", ckpt::DType::int64, {4}, steps.data()),
              ckpt::TensorView::replicated("flags", ckpt::DType::boolean, {3}, flags.data()),
              ckpt::TensorView::replicated("half", ckpt::DType::bfloat16, {2}, half.data()),
              ckpt::TensorView::sharded("table", ckpt::DType::float64, {4, 2}, {first_row, 0}, {2, 2},
                                        table.data() + first_row * 2)};
          ckpt::save_checkpoint(dir, 11, views, nlohmann::json{{"epoch", 4}, {"writer", "c++"}},
                                group.communicator(rank));
        } catch (const std::exception& e) {
          errors[static_cast<std::size_t>(rank)] = e.what();  // a thrown exception would end the process unreported
        }
      });
    }
  }  // joins the ranks
  for (int rank = 0; rank < 2; ++rank) {
    if (!errors[static_cast<std::size_t>(rank)].empty()) {
      std::fprintf(stderr, "interop_fixture: rank %d: %s\n", rank, errors[static_cast<std::size_t>(rank)].c_str());
      return 1;
    }
  }
  return 0;
}

int read(const std::string& dir) {
  ckpt::SingleProcessCommunicator comm;
  std::map<std::string, std::vector<std::byte>> buffers;
  std::map<std::string, ckpt::TensorInfo> infos;
  ckpt::RestoreOptions options;
  options.targets_for = [&](const ckpt::Checkpoint& checkpoint) {
    std::vector<ckpt::TensorTarget> targets;
    for (const auto& info : checkpoint.tensors()) {
      auto& memory = buffers[info.name];
      memory.assign(info.bytes(), std::byte{0});
      infos[info.name] = info;
      targets.push_back(ckpt::TensorTarget::whole(info.name, info.dtype, info.shape, memory.data()));
    }
    return targets;
  };
  const auto restored = ckpt::restore_latest(dir, {}, comm, options);
  if (!restored) {
    std::fprintf(stderr, "interop_fixture: no checkpoint under %s\n", dir.c_str());
    return 1;
  }
  nlohmann::json tensors = nlohmann::json::object();
  for (const auto& [name, memory] : buffers) {
    std::string hex;
    for (std::byte b : memory) hex += fmt::format("{:02x}", static_cast<unsigned>(b));
    tensors[name] = {{"dtype", ckpt::dtype_name(infos[name].dtype)}, {"shape", infos[name].shape}, {"hex", hex}};
  }
  std::printf(
      "%s\n",
      nlohmann::json{{"step", restored->step}, {"metadata", restored->metadata}, {"tensors", tensors}}.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: interop_fixture write|read DIR\n");
    return 2;
  }
  try {
    const std::string verb = argv[1];
    if (verb == "write") return write(argv[2]);
    if (verb == "read") return read(argv[2]);
    std::fprintf(stderr, "interop_fixture: unknown verb '%s' (write or read)\n", argv[1]);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "interop_fixture: %s\n", e.what());
    return 1;
  }
}
