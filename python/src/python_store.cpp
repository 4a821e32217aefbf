#include "python_store.hpp"

#include <stdexcept>
#include <thread>

#include <fmt/format.h>

namespace py = pybind11;

namespace elastrun::python {

namespace {
// Runs `call` holding the GIL; a Python exception becomes a C++ one carrying its text (the
// Python error object must not outlive the GIL).
template <typename Call>
auto with_gil(const char* operation, const std::string& key, const Call& call) {
  py::gil_scoped_acquire gil;
  try {
    return call();
  } catch (py::error_already_set& e) {
    throw std::runtime_error(fmt::format("store {} '{}': {}", operation, key, e.what()));
  }
}

std::string ready_key(const std::string& key) { return key + "/ready"; }
}  // namespace

PythonKeyValueStore::PythonKeyValueStore(py::object store, std::chrono::milliseconds timeout)
    : store_(std::move(store)), timeout_(timeout) {}

PythonKeyValueStore::~PythonKeyValueStore() {
  py::gil_scoped_acquire gil;
  store_ = py::object();
}

void PythonKeyValueStore::set(const std::string& key, std::string_view value) {
  with_gil("set", key, [&] {
    store_.attr("set")(key, py::bytes(value.data(), value.size()));
    store_.attr("add")(ready_key(key), 1);
  });
}

std::string PythonKeyValueStore::get(const std::string& key) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + timeout_;
  auto pause = std::chrono::microseconds(500);
  while (true) {
    // the GIL is taken per poll and released while sleeping
    const bool ready =
        with_gil("get", key, [&] { return store_.attr("add")(ready_key(key), 0).cast<std::int64_t>() > 0; });
    if (ready) return with_gil("get", key, [&] { return std::string(py::bytes(store_.attr("get")(key))); });
    if (Clock::now() >= deadline) {
      throw std::runtime_error(fmt::format("store get '{}': no value after {} s (a peer died or is far behind)", key,
                                           std::chrono::duration_cast<std::chrono::seconds>(timeout_).count()));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(5));
  }
}

std::int64_t PythonKeyValueStore::add(const std::string& key, std::int64_t delta) {
  return with_gil("add", key, [&] { return store_.attr("add")(key, delta).cast<std::int64_t>(); });
}

void PythonKeyValueStore::remove(const std::string& key) noexcept {
  for (const std::string& k : {key, ready_key(key)}) {
    try {
      with_gil("delete", k, [&] { (void)store_.attr("delete_key")(k); });
    } catch (const std::exception&) {
      // Stores without delete_key (FileStore) keep the key; it is never read again.
    }
  }
}

}  // namespace elastrun::python
