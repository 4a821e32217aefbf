// elastrun._core: the C++ checkpoint library (ckpt/) for the elastrun Python package. The Python
// side (elastrun/checkpoint.py) walks state_dicts and exports tensors through DLPack; this module
// turns them into TensorViews/TensorTargets (no copy), runs saves and restores with the GIL
// released, and maps the library's errors onto Python exceptions.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include "dlpack_buffer.hpp"
#include "elastrun/ckpt/async_saver.hpp"
#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/control.hpp"
#include "python_store.hpp"
#include "segment_copy.hpp"

namespace py = pybind11;
using nlohmann::json;

namespace elastrun::python {
namespace {

// A communicator and what it runs over, owned by one Python object.
struct Comm {
  std::unique_ptr<ckpt::KeyValueStore> store;  // null for a single process
  std::unique_ptr<ckpt::Communicator> communicator;
};

std::optional<ckpt::DType> dtype_override(const py::handle& name) {
  if (name.is_none()) return std::nullopt;
  try {
    return ckpt::dtype_from_name(name.cast<std::string>());
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

// The DLPack tensor in a "dltensor" capsule (left unconsumed: its owner frees it).
HostBuffer capsule_buffer(const py::handle& capsule, const std::string& key, std::optional<ckpt::DType> as) {
  auto* managed = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule.ptr(), "dltensor"));
  if (managed == nullptr) {
    PyErr_Clear();
    throw py::type_error(fmt::format("'{}': expected a DLPack capsule (torch.utils.dlpack.to_dlpack)", key));
  }
  try {
    return host_buffer(managed->dl_tensor, key, as);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

ckpt::Shape shape_of(const py::handle& sequence) { return sequence.cast<ckpt::Shape>(); }

// Calls make(entry, name, buffer) for each entry (name, capsule, dtype or None, ...) of a list
// from elastrun/checkpoint.py: the name and the capsule's memory, unpacked once for both kinds.
template <class Item, class Make>
std::vector<Item> map_entries(const py::list& entries, Make make) {
  std::vector<Item> items;
  items.reserve(entries.size());
  for (const auto& element : entries) {
    const auto entry = element.cast<py::tuple>();
    auto name = entry[0].cast<std::string>();
    const HostBuffer buffer = capsule_buffer(entry[1], name, dtype_override(entry[2]));
    items.push_back(make(entry, std::move(name), buffer));
  }
  return items;
}

std::size_t host_bytes(const HostBuffer& buffer) {
  return static_cast<std::size_t>(ckpt::element_count(buffer.shape)) * ckpt::dtype_size(buffer.dtype);
}

// Save entries: (name, capsule, dtype or None, global_shape or None, offset or None); a global
// shape makes the entry this rank's slice of a sharded tensor, otherwise it is replicated.
std::vector<ckpt::TensorView> views_of(const py::list& entries) {
  return map_entries<ckpt::TensorView>(entries, [](const py::tuple& entry, std::string name, const HostBuffer& buffer) {
    if (entry[3].is_none())
      return ckpt::TensorView::replicated(std::move(name), buffer.dtype, buffer.shape, buffer.data);
    return ckpt::TensorView::sharded(std::move(name), buffer.dtype, shape_of(entry[3]), shape_of(entry[4]),
                                     buffer.shape, buffer.data);
  });
}

// Restore targets: (name, capsule, dtype or None, offset or None): the box of the global tensor
// at `offset` (zeros if None) with the capsule's shape, read into the capsule's memory.
std::vector<ckpt::TensorTarget> targets_of(const py::list& entries) {
  return map_entries<ckpt::TensorTarget>(
      entries, [](const py::tuple& entry, std::string name, const HostBuffer& buffer) {
        ckpt::Shape offset = entry[3].is_none() ? ckpt::Shape(buffer.shape.size(), 0) : shape_of(entry[3]);
        return ckpt::TensorTarget::box(std::move(name), buffer.dtype, std::move(offset), buffer.shape, buffer.data);
      });
}

ckpt::SaveOptions save_options(const py::dict& options) {
  ckpt::SaveOptions o;
  for (const auto& [key, value] : options) {
    const auto name = key.cast<std::string>();
    if (name == "keep_last") {
      o.keep_last = value.cast<int>();
    } else if (name == "keep_every") {
      o.keep_every = value.cast<std::uint64_t>();
    } else if (name == "alignment") {
      o.alignment = value.cast<std::uint64_t>();
    } else if (name == "fsync") {
      o.fsync = value.cast<bool>();
    } else if (name == "check_replicas") {
      const auto mode = value.cast<std::string>();
      if (mode == "off")
        o.check_replicas = ckpt::ReplicaCheck::off;
      else if (mode == "sampled")
        o.check_replicas = ckpt::ReplicaCheck::sampled;
      else if (mode == "full")
        o.check_replicas = ckpt::ReplicaCheck::full;
      else
        throw py::value_error(fmt::format("check_replicas='{}': use 'off', 'sampled' or 'full'", mode));
    } else if (name == "snapshot") {
      const auto mode = value.cast<std::string>();
      if (mode == "copy")
        o.async_snapshot = ckpt::AsyncSnapshot::copy;
      else if (mode == "fork")
        o.async_snapshot = ckpt::AsyncSnapshot::fork;
      else
        throw py::value_error(fmt::format("snapshot='{}': use 'copy' or 'fork'", mode));
    } else {
      throw py::type_error(fmt::format("unknown save option '{}'", name));
    }
  }
  return o;
}

json parse_metadata(const std::string& text) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw py::value_error(fmt::format("metadata is not valid JSON: {}", e.what()));
  }
}

py::dict result_dict(const ckpt::SaveResult& result) {
  py::dict d;
  d["path"] = result.path.string();
  d["bytes_written"] = result.bytes_written;
  d["snapshot_bytes"] = result.snapshot_bytes;
  d["warnings"] = result.warnings;
  return d;
}

py::dict index_dict(const ckpt::Checkpoint& checkpoint) {
  py::list tensors;
  for (const auto& t : checkpoint.tensors()) {
    tensors.append(py::make_tuple(t.name, std::string(ckpt::dtype_name(t.dtype)), t.shape,
                                  t.placement == ckpt::Placement::sharded ? "sharded" : "replicated"));
  }
  py::dict d;
  d["step"] = checkpoint.step();
  d["path"] = checkpoint.path().string();
  d["world_size"] = checkpoint.world_size();
  d["layout"] = checkpoint.layout();
  d["metadata"] = checkpoint.metadata().dump();
  d["tensors"] = tensors;
  return d;
}

// Rethrows a Python exception raised by a restore callback as the library's error of the same
// meaning, so that restore skips (mismatch, damage) or fails (anything else) the step.
[[noreturn]] void rethrow_callback_error(py::error_already_set& e, const py::object& mismatch,
                                         const py::object& corrupt) {
  const std::string message = py::str(e.value()).cast<std::string>();
  if (e.matches(mismatch)) throw ckpt::CheckpointMismatchError(message);
  if (e.matches(corrupt)) throw ckpt::CorruptCheckpointError(message);
  throw ckpt::CheckpointError(fmt::format("{}: {}", py::str(e.type().attr("__name__")).cast<std::string>(), message));
}

class PyAsyncSaver {
 public:
  PyAsyncSaver(const std::string& root, py::object comm, const py::dict& options)
      : comm_(std::move(comm)),
        saver_(std::make_unique<ckpt::AsyncSaver>(root, *comm_.cast<Comm&>().communicator, save_options(options))) {}
  // The writer thread takes the GIL for its votes: joining it must not hold the GIL.
  ~PyAsyncSaver() {
    py::gil_scoped_release release;
    saver_.reset();
  }
  void save(std::uint64_t step, const py::list& entries, const std::string& metadata) {
    const auto views = views_of(entries);
    json parsed = parse_metadata(metadata);
    py::gil_scoped_release release;
    saver_->save(step, views, std::move(parsed));
  }
  void fail(std::uint64_t step, std::string reason) {
    py::gil_scoped_release release;
    saver_->fail(step, std::move(reason));
  }
  py::object wait() {
    std::optional<ckpt::SaveResult> result;
    {
      py::gil_scoped_release release;
      result = saver_->wait();
    }
    if (!result) return py::none();
    return result_dict(*result);
  }
  bool busy() const { return saver_->busy(); }

 private:
  py::object comm_;  // kept alive: the saver uses its communicator
  std::unique_ptr<ckpt::AsyncSaver> saver_;
};

}  // namespace
}  // namespace elastrun::python

PYBIND11_MODULE(_core, m) {
  using namespace elastrun;
  using namespace elastrun::python;
  m.doc() = "elastrun's C++ checkpoint library; use elastrun.checkpoint, not this module";

  auto checkpoint_error = py::register_exception<ckpt::CheckpointError>(m, "CheckpointError", PyExc_RuntimeError);
  auto corrupt_error =
      py::register_exception<ckpt::CorruptCheckpointError>(m, "CorruptCheckpointError", checkpoint_error.ptr());
  auto mismatch_error =
      py::register_exception<ckpt::CheckpointMismatchError>(m, "CheckpointMismatchError", checkpoint_error.ptr());
  // pybind11 tries translators in reverse order of registration: the subclasses come first.

  py::class_<Comm>(m, "Comm", "a communicator for checkpoint votes (elastrun/_comm.py makes them)")
      .def_static(
          "single",
          [] {
            return Comm{nullptr, std::make_unique<ckpt::SingleProcessCommunicator>()};
          },
          "a world of one process")
      .def_static(
          "over_store",
          [](py::object store, int rank, int world_size, const std::string& prefix, std::chrono::milliseconds timeout) {
            Comm comm;
            comm.store = std::make_unique<PythonKeyValueStore>(std::move(store), timeout);
            comm.communicator = std::make_unique<ckpt::StoreCommunicator>(*comm.store, rank, world_size, prefix);
            return comm;
          },
          py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("prefix"), py::arg("timeout"),
          "votes through a torch.distributed Store under keys '<prefix>/...'")
      .def(
          "allgather",
          [](Comm& c, const py::bytes& mine) {
            const std::string value = mine;
            std::vector<std::string> all;
            {
              py::gil_scoped_release release;  // the store's calls take the GIL when they need it
              all = c.communicator->allgather(value);
            }
            py::list out;
            for (const auto& v : all) out.append(py::bytes(v));
            return out;
          },
          py::arg("mine"), "every rank's value, in rank order (a collective: every rank calls it)")
      .def_property_readonly("rank", [](const Comm& c) { return c.communicator->rank(); })
      .def_property_readonly("world_size", [](const Comm& c) { return c.communicator->size(); });

  m.def(
      "copy_and_hash",
      [](const py::buffer& segment, const py::list& pieces, bool hash) {
        // pieces: (name, capsule, dtype or None, offset in the segment)
        py::buffer_info out = segment.request(true);
        auto copies = map_entries<SegmentPiece>(pieces, [](const py::tuple& entry, std::string, const HostBuffer& t) {
          return SegmentPiece{t.data, host_bytes(t), entry[3].cast<std::size_t>()};
        });
        auto* data = static_cast<std::byte*>(out.ptr);
        const auto size = static_cast<std::size_t>(out.size * out.itemsize);
        py::gil_scoped_release release;
        return copy_and_hash(data, size, std::move(copies), hash);  // std::invalid_argument: ValueError
      },
      py::arg("segment"), py::arg("pieces"), py::arg("hash") = true,
      "copies each tensor into the writable buffer at its offset; returns the XXH3-64 of the whole buffer "
      "(hash=False: 0, the copy only)");
  m.def(
      "xxh3",
      [](const py::buffer& data) {
        py::buffer_info in = data.request();
        const auto* bytes = static_cast<const std::byte*>(in.ptr);
        const auto size = static_cast<std::size_t>(in.size * in.itemsize);
        py::gil_scoped_release release;
        return hash_bytes(bytes, size);
      },
      py::arg("data"), "the XXH3-64 of a buffer's bytes (a memory snapshot's checksum)");
  m.def(
      "xxh3_fd",
      [](int fd, std::size_t size) {
        py::gil_scoped_release release;
        return hash_fd(fd, size);
      },
      py::arg("fd"), py::arg("size"), "the XXH3-64 of the first `size` bytes of a descriptor, read with pread");
  m.def(
      "read_into",
      [](int fd, const py::list& pieces) {
        // pieces: (name, capsule of a contiguous host tensor to fill, dtype or None, offset in the segment)
        const auto reads =
            map_entries<SegmentRead>(pieces, [](const py::tuple& entry, std::string, const HostBuffer& t) {
              return SegmentRead{t.data, host_bytes(t), entry[3].cast<std::size_t>()};
            });
        py::gil_scoped_release release;
        read_pieces(fd, reads);
      },
      py::arg("fd"), py::arg("pieces"), "reads each piece of a memory snapshot's descriptor into its tensor");
  m.def(
      "save",
      [](const std::string& root, std::uint64_t step, const py::list& entries, const std::string& metadata, Comm& comm,
         const py::dict& options) {
        const auto views = views_of(entries);
        const json parsed = parse_metadata(metadata);
        auto o = save_options(options);
        o.on_progress = [] { elastrun::control::progress(); };  // a long save is not a hang (--hang-timeout)
        ckpt::SaveResult result;
        {
          py::gil_scoped_release release;
          result = ckpt::save_checkpoint(root, step, views, parsed, *comm.communicator, o);
        }
        return result_dict(result);
      },
      py::arg("root"), py::arg("step"), py::arg("entries"), py::arg("metadata"), py::arg("comm"), py::arg("options"));

  m.def(
      "fail_save",
      [](const std::string& root, std::uint64_t step, const std::string& reason, Comm& comm, const py::dict& options) {
        const auto o = save_options(options);
        py::gil_scoped_release release;
        ckpt::fail_save_checkpoint(root, step, reason, *comm.communicator, o);
      },
      py::arg("root"), py::arg("step"), py::arg("reason"), py::arg("comm"), py::arg("options"),
      "this rank votes no in the save its peers are in (always raises CheckpointError)");

  m.def(
      "restore",
      [mismatch = py::object(mismatch_error), corrupt = py::object(corrupt_error)](
          const std::string& root, Comm& comm, py::function targets_for, bool verify,
          bool allow_fresh_start) -> py::object {
        std::vector<py::object> keep_alive;  // the step's target list; freed holding the GIL
        ckpt::RestoreOptions options;
        options.verify = verify;
        options.allow_fresh_start = allow_fresh_start;
        options.targets_for = [&](const ckpt::Checkpoint& checkpoint) {
          py::gil_scoped_acquire gil;
          try {
            py::object entries = targets_for(index_dict(checkpoint));
            keep_alive.clear();  // an earlier step's targets are done with: free them now
            keep_alive.push_back(entries);
            return targets_of(entries.cast<py::list>());
          } catch (py::error_already_set& e) {
            rethrow_callback_error(e, mismatch, corrupt);
          } catch (const py::builtin_exception& e) {
            throw ckpt::CheckpointError(e.what());  // a bad target list: the package's mistake, not the data's
          }
        };
        std::optional<ckpt::RestoreResult> result;
        {
          py::gil_scoped_release release;
          result = ckpt::restore_latest(root, {}, *comm.communicator, options);
        }
        if (!result) return py::none();
        py::dict d;
        d["step"] = result->step;
        d["path"] = result->path.string();
        d["metadata"] = result->metadata.dump();
        d["skipped"] = result->skipped;
        return d;
      },
      py::arg("root"), py::arg("comm"), py::arg("targets_for"), py::arg("verify") = true,
      py::arg("allow_fresh_start") = false);

  m.def(
      "read_index",
      [](const std::string& step_dir) {
        ckpt::Checkpoint checkpoint(step_dir);
        return index_dict(checkpoint);
      },
      py::arg("step_dir"), "the index of one step directory (tensors, metadata)");

  m.def(
      "read_step",
      [](const std::string& step_dir, py::function targets_for, bool verify) -> py::dict {
        ckpt::Checkpoint checkpoint(step_dir);
        py::list entries = targets_for(index_dict(checkpoint)).cast<py::list>();
        const auto targets = targets_of(entries);
        ckpt::ReadOptions options;
        options.verify = verify;
        {
          py::gil_scoped_release release;
          for (const auto& target : targets) checkpoint.read(target, options);
        }
        return index_dict(checkpoint);
      },
      py::arg("step_dir"), py::arg("targets_for"), py::arg("verify") = true,
      "reads one step directory into targets_for(index)'s entries (one process, no vote); returns the index");

  m.def(
      "list_steps",
      [](const std::string& root) {
        std::vector<std::pair<std::uint64_t, std::string>> steps;
        for (const auto& entry : ckpt::list_steps(root)) steps.emplace_back(entry.step, entry.path.string());
        return steps;
      },
      py::arg("root"), "committed steps under root, oldest first, as (step, path)");

  m.def(
      "verify",
      [](const std::string& step_dir) {
        ckpt::Checkpoint checkpoint(step_dir);
        py::gil_scoped_release release;
        return checkpoint.verify_all();
      },
      py::arg("step_dir"), "hashes every shard; one line per problem (empty: intact)");

  py::class_<PyAsyncSaver>(m, "AsyncSaver")
      .def(py::init<const std::string&, py::object, const py::dict&>(), py::arg("root"), py::arg("comm"),
           py::arg("options"))
      .def("save", &PyAsyncSaver::save, py::arg("step"), py::arg("entries"), py::arg("metadata"))
      .def("fail", &PyAsyncSaver::fail, py::arg("step"), py::arg("reason"),
           "this rank votes no on step (its state_dict could not be converted)")
      .def("wait", &PyAsyncSaver::wait)
      .def_property_readonly("busy", &PyAsyncSaver::busy);

  m.attr("DTYPES") =
      py::make_tuple("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool");
}
