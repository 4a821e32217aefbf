#include "elastrun/ckpt/c10d_store_comm.hpp"

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace elastrun::ckpt {

namespace {
class C10dKeyValueStore final : public KeyValueStore {
 public:
  explicit C10dKeyValueStore(c10d::Store& store) : store_(store) {}
  void set(const std::string& key, std::string_view value) override {
    store_.set(key, std::vector<std::uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    store_.wait({key});
    const std::vector<std::uint8_t> value = store_.get(key);
    return std::string(value.begin(), value.end());
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override { return store_.add(key, delta); }
  void remove(const std::string& key) noexcept override {
    try {
      (void)store_.deleteKey(key);
    } catch (const std::exception&) {
      // Stores without deleteKey (FileStore) keep the key; it is never read again.
    }
  }

 private:
  c10d::Store& store_;
};
}  // namespace

C10dStoreCommunicator::C10dStoreCommunicator(c10d::Store& store, int rank, int world_size, std::string prefix)
    : store_(std::make_unique<C10dKeyValueStore>(store)),
      communicator_(std::make_unique<StoreCommunicator>(*store_, rank, world_size, std::move(prefix))) {}

C10dStoreCommunicator::~C10dStoreCommunicator() = default;

}  // namespace elastrun::ckpt
