#pragma once
// Private HDF5 helpers: RAII handles, checked calls, the library-wide lock, dtype <-> HDF5 type.
#include <hdf5.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "elastrun/ckpt/dtype.hpp"
#include "elastrun/ckpt/errors.hpp"
#include "elastrun/ckpt/tensor.hpp"

namespace elastrun::ckpt::h5 {

// The Debian parallel HDF5 build is not thread-safe; every HDF5 call in this library happens
// under this lock (threads-as-ranks tests, the async writer thread). Never hold it across a
// Communicator call.
std::recursive_mutex& library_mutex();
using Lock = std::lock_guard<std::recursive_mutex>;
// In a fork() child only (single-threaded), when the forking thread held the lock: makes it a
// fresh, unlocked mutex. (A recursive mutex records its owner's kernel thread id, which differs
// in the child, so the child could neither re-lock nor unlock the inherited one.)
void reinitialize_library_mutex_in_child() noexcept;

// Owns one hid_t; closes it with the matching H5?close.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  ~Handle() { reset(); }
  Handle(Handle&& other) noexcept : id_(other.id_), closer_(other.closer_) { other.id_ = H5I_INVALID_HID; }
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = other.id_;
      closer_ = other.closer_;
      other.id_ = H5I_INVALID_HID;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports failure (file close is where buffered writes fail).
  void close_checked(std::string_view what);

 private:
  void reset() {
    if (id_ >= 0 && closer_ != nullptr) (void)closer_(id_);
    id_ = H5I_INVALID_HID;
  }
  hid_t id_ = H5I_INVALID_HID;
  Closer closer_ = nullptr;
};

// Throw CheckpointError("<what>: <HDF5 message>") when id < 0 / status < 0.
hid_t check_id(hid_t id, std::string_view what);
void check(herr_t status, std::string_view what);
// Innermost HDF5 error description of the current error stack (for messages).
std::string last_error();

inline Handle make_file(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Fclose); }
inline Handle make_group(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Gclose); }
inline Handle make_dataset(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Dclose); }
inline Handle make_space(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Sclose); }
inline Handle make_plist(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Pclose); }
inline Handle make_type(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Tclose); }
inline Handle make_attr(hid_t id, std::string_view what) { return Handle(check_id(id, what), H5Aclose); }

// Simple dataspace of `shape` (scalar dataspace for a 0-d shape).
Handle dataspace(const Shape& shape);
// The HDF5 type a dtype is stored as (same type in memory and file: little-endian hosts).
Handle storage_type(DType dtype);

// File access list: sec2 driver, optional alignment, file locking as requested.
Handle file_access(std::uint64_t alignment, std::uint64_t threshold, bool file_locking);
// Link creation list that creates intermediate groups ("model/layer1.weight").
Handle link_create_intermediate();
// Contiguous dataset, no fill value writes.
Handle contiguous_no_fill();

// Attribute writers (overwrite not supported: attributes are written once).
void write_attr_string(hid_t obj, const char* name, std::string_view value);
void write_attr_i64(hid_t obj, const char* name, std::int64_t value);
void write_attr_u64_array(hid_t obj, const char* name, const std::vector<std::uint64_t>& values,
                          const std::vector<hsize_t>& dims);
void write_attr_i32_array(hid_t obj, const char* name, const std::vector<std::int32_t>& values);
std::string read_attr_string(hid_t obj, const char* name);
bool has_attr(hid_t obj, const char* name);

// Escapes '%' for VDS source dataset names (printf-style patterns).
std::string escape_vds_name(std::string_view name);

}  // namespace elastrun::ckpt::h5
