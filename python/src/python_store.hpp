#pragma once
// The job's c10d store as seen from Python (torch.distributed's Store: the default process
// group's, or one the package opened) as a KeyValueStore, so that the checkpoint votes run the C++
// StoreCommunicator protocol over it -- from the AsyncSaver's writer thread too.
//
// Every operation takes the GIL for one store call. Waiting for a key never blocks inside the
// store: a TCPStore client holds its connection's lock for a whole wait(), which would stall every
// other user of the store in this process (new_group, a sync save during an async one) until the
// peers voted. Instead set() also bumps "<key>/ready", and get() polls that counter with add(0)
// -- a non-blocking call -- sleeping without the GIL in between (0.5 ms, growing to 5 ms).
#include <chrono>
#include <string>

#include <pybind11/pybind11.h>

#include "elastrun/ckpt/store_comm.hpp"

namespace elastrun::python {

class PythonKeyValueStore final : public ckpt::KeyValueStore {
 public:
  // `timeout` bounds every wait for a key (a dead peer fails the vote instead of hanging).
  PythonKeyValueStore(pybind11::object store, std::chrono::milliseconds timeout);
  ~PythonKeyValueStore() override;
  PythonKeyValueStore(const PythonKeyValueStore&) = delete;
  PythonKeyValueStore& operator=(const PythonKeyValueStore&) = delete;

  void set(const std::string& key, std::string_view value) override;
  std::string get(const std::string& key) override;
  std::int64_t add(const std::string& key, std::int64_t delta) override;
  void remove(const std::string& key) noexcept override;

 private:
  pybind11::object store_;
  std::chrono::milliseconds timeout_;
};

}  // namespace elastrun::python
