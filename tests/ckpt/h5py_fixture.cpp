// Writes a world-4 checkpoint plus the expected global bytes of every tensor, for
// check_index_h5py.py (h5py must read the index with no elastrun code and get identical values).
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "test_support.hpp"

int main(int argc, char** argv) {
  using namespace elastrun::ckpt;
  if (argc != 2) {
    std::cerr << "usage: ckpt_h5py_fixture OUTPUT_DIR\n";
    return 2;
  }
  const std::filesystem::path out = argv[1];
  try {
    const auto model = testing::world4_model(4242);
    testing::save_world4(out / "ckpt", 42, model);
    nlohmann::json expected = nlohmann::json::object();
    std::filesystem::create_directories(out / "expected");
    int index = 0;
    for (const auto& t : model) {
      const std::string file = "expected/" + std::to_string(index++) + ".bin";
      std::ofstream stream(out / file, std::ios::binary);
      stream.write(reinterpret_cast<const char*>(t.bytes.data()), static_cast<std::streamsize>(t.bytes.size()));
      if (!stream) throw std::runtime_error("cannot write " + (out / file).string());
      expected[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"file", file}};
    }
    std::ofstream(out / "expected.json") << expected.dump(1);
  } catch (const std::exception& e) {
    std::cerr << "ckpt_h5py_fixture: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
