#include "h5.hpp"

#include <pthread.h>

#include <fmt/format.h>

#include <algorithm>

namespace elastrun::ckpt::h5 {

std::recursive_mutex& library_mutex() {
  static std::recursive_mutex mutex;
  // Errors become exceptions carrying HDF5's message; HDF5's own stderr dump is noise.
  static const bool silenced = [] {
    std::lock_guard lock(mutex);
    return H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr) >= 0;
  }();
  (void)silenced;
  return mutex;
}

void reinitialize_library_mutex_in_child() noexcept {
  pthread_mutexattr_t attributes;
  ::pthread_mutexattr_init(&attributes);
  ::pthread_mutexattr_settype(&attributes, PTHREAD_MUTEX_RECURSIVE);
  ::pthread_mutex_init(library_mutex().native_handle(), &attributes);
  ::pthread_mutexattr_destroy(&attributes);
}

namespace {
herr_t innermost_error(unsigned n, const H5E_error2_t* err, void* out) {
  if (n == 0 && err != nullptr && err->desc != nullptr) {
    *static_cast<std::string*>(out) = fmt::format("{} ({})", err->desc, err->func_name);
  }
  return 0;
}
}  // namespace

std::string last_error() {
  std::string message;
  (void)H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, innermost_error, &message);
  (void)H5Eclear2(H5E_DEFAULT);
  if (message.empty()) return "unknown HDF5 error";
  // HDF5's I/O errors embed a ctime() string and its newline ("time = Fri Dec  4 ...\n, filename
  // = ..."): errors are one line here (they end up in '[rank N] ...' log lines and events)
  std::string line;
  for (const char c : message) {
    if (c == '\n' || c == '\r') continue;
    line += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  }
  return line;
}

hid_t check_id(hid_t id, std::string_view what) {
  if (id < 0) throw CheckpointError(fmt::format("{}: {}", what, last_error()));
  return id;
}

void check(herr_t status, std::string_view what) {
  if (status < 0) throw CheckpointError(fmt::format("{}: {}", what, last_error()));
}

void Handle::close_checked(std::string_view what) {
  if (id_ < 0) return;
  const hid_t id = id_;
  id_ = H5I_INVALID_HID;
  check(closer_(id), what);
}

Handle dataspace(const Shape& shape) {
  if (shape.empty()) return make_space(H5Screate(H5S_SCALAR), "create scalar dataspace");
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  return make_space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "create dataspace");
}

Handle storage_type(DType dtype) {
  switch (dtype) {
    case DType::float16: {
      // IEEE binary16, the layout h5py maps to numpy.float16.
      Handle type = make_type(H5Tcopy(H5T_IEEE_F32LE), "copy float type");
      check(H5Tset_fields(type.get(), 15, 10, 5, 0, 10), "set float16 fields");
      check(H5Tset_size(type.get(), 2), "set float16 size");
      check(H5Tset_ebias(type.get(), 15), "set float16 exponent bias");
      return type;
    }
    case DType::bfloat16: return make_type(H5Tcopy(H5T_STD_U16LE), "copy uint16 type");
    case DType::float32: return make_type(H5Tcopy(H5T_IEEE_F32LE), "copy float32 type");
    case DType::float64: return make_type(H5Tcopy(H5T_IEEE_F64LE), "copy float64 type");
    case DType::int8: return make_type(H5Tcopy(H5T_STD_I8LE), "copy int8 type");
    case DType::int16: return make_type(H5Tcopy(H5T_STD_I16LE), "copy int16 type");
    case DType::int32: return make_type(H5Tcopy(H5T_STD_I32LE), "copy int32 type");
    case DType::int64: return make_type(H5Tcopy(H5T_STD_I64LE), "copy int64 type");
    case DType::uint8: return make_type(H5Tcopy(H5T_STD_U8LE), "copy uint8 type");
    case DType::boolean: {
      // h5py reads this enum as numpy.bool_.
      Handle type = make_type(H5Tenum_create(H5T_STD_I8LE), "create bool enum");
      const std::int8_t no = 0;
      const std::int8_t yes = 1;
      check(H5Tenum_insert(type.get(), "FALSE", &no), "insert FALSE");
      check(H5Tenum_insert(type.get(), "TRUE", &yes), "insert TRUE");
      return type;
    }
  }
  throw CheckpointError("unknown dtype");
}

Handle file_access(std::uint64_t alignment, std::uint64_t threshold, bool file_locking) {
  Handle fapl = make_plist(H5Pcreate(H5P_FILE_ACCESS), "create file access list");
  check(H5Pset_fapl_sec2(fapl.get()), "select sec2 driver");
  if (alignment > 1) check(H5Pset_alignment(fapl.get(), threshold, alignment), "set alignment");
  // ignore_when_disabled=true: filesystems without lock support do not fail opens.
  check(H5Pset_file_locking(fapl.get(), file_locking ? 1 : 0, 1), "set file locking");
  return fapl;
}

Handle link_create_intermediate() {
  Handle lcpl = make_plist(H5Pcreate(H5P_LINK_CREATE), "create link list");
  check(H5Pset_create_intermediate_group(lcpl.get(), 1), "enable intermediate groups");
  return lcpl;
}

Handle contiguous_no_fill() {
  Handle dcpl = make_plist(H5Pcreate(H5P_DATASET_CREATE), "create dataset list");
  check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), "set contiguous layout");
  check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER), "disable fill writes");
  return dcpl;
}

namespace {
Handle string_type(std::size_t length) {
  Handle type = make_type(H5Tcopy(H5T_C_S1), "copy string type");
  check(H5Tset_size(type.get(), std::max<std::size_t>(length, 1)), "set string size");
  check(H5Tset_strpad(type.get(), H5T_STR_NULLPAD), "set string padding");
  check(H5Tset_cset(type.get(), H5T_CSET_UTF8), "set string charset");
  return type;
}
}  // namespace

void write_attr_string(hid_t obj, const char* name, std::string_view value) {
  Handle type = string_type(value.size());
  Handle space = make_space(H5Screate(H5S_SCALAR), "create scalar dataspace");
  Handle attr = make_attr(H5Acreate2(obj, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT),
                          fmt::format("create attribute {}", name));
  std::string padded(value);
  if (padded.empty()) padded.push_back('\0');
  check(H5Awrite(attr.get(), type.get(), padded.data()), fmt::format("write attribute {}", name));
}

void write_attr_i64(hid_t obj, const char* name, std::int64_t value) {
  Handle space = make_space(H5Screate(H5S_SCALAR), "create scalar dataspace");
  Handle attr = make_attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                          fmt::format("create attribute {}", name));
  check(H5Awrite(attr.get(), H5T_NATIVE_INT64, &value), fmt::format("write attribute {}", name));
}

void write_attr_u64_array(hid_t obj, const char* name, const std::vector<std::uint64_t>& values,
                          const std::vector<hsize_t>& dims) {
  if (values.empty()) return;  // HDF5 attributes cannot have zero-sized dataspaces portably
  Handle space =
      make_space(H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), "create attribute dataspace");
  Handle attr = make_attr(H5Acreate2(obj, name, H5T_STD_U64LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                          fmt::format("create attribute {}", name));
  check(H5Awrite(attr.get(), H5T_NATIVE_UINT64, values.data()), fmt::format("write attribute {}", name));
}

void write_attr_i32_array(hid_t obj, const char* name, const std::vector<std::int32_t>& values) {
  if (values.empty()) return;
  const hsize_t dims[1] = {values.size()};
  Handle space = make_space(H5Screate_simple(1, dims, nullptr), "create attribute dataspace");
  Handle attr = make_attr(H5Acreate2(obj, name, H5T_STD_I32LE, space.get(), H5P_DEFAULT, H5P_DEFAULT),
                          fmt::format("create attribute {}", name));
  check(H5Awrite(attr.get(), H5T_NATIVE_INT32, values.data()), fmt::format("write attribute {}", name));
}

bool has_attr(hid_t obj, const char* name) {
  const htri_t exists = H5Aexists(obj, name);
  check(exists, fmt::format("look up attribute {}", name));
  return exists > 0;
}

std::string read_attr_string(hid_t obj, const char* name) {
  Handle attr = make_attr(H5Aopen(obj, name, H5P_DEFAULT), fmt::format("open attribute {}", name));
  Handle type = make_type(H5Aget_type(attr.get()), fmt::format("type of attribute {}", name));
  if (H5Tget_class(type.get()) != H5T_STRING || H5Tis_variable_str(type.get()) != 0) {
    throw CheckpointError(fmt::format("attribute {} is not a fixed-length string", name));
  }
  const std::size_t size = H5Tget_size(type.get());
  std::string value(size, '\0');
  check(H5Aread(attr.get(), type.get(), value.data()), fmt::format("read attribute {}", name));
  value.resize(value.find('\0') == std::string::npos ? value.size() : value.find('\0'));
  return value;
}

std::string escape_vds_name(std::string_view name) {
  std::string escaped;
  escaped.reserve(name.size());
  for (char c : name) {
    escaped.push_back(c);
    if (c == '%') escaped.push_back('%');
  }
  return escaped;
}

}  // namespace elastrun::ckpt::h5
