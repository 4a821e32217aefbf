// elastrun-ckpt: list, inspect, verify, export and compare checkpoints; import and export
// PyTorch's formats through the Python package (elastrun.convert).
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <bit>
#include <charconv>
#include <cmath>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <set>
#include <string_view>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "elastrun/ckpt/checkpoint.hpp"
#include "elastrun/ckpt/safetensors.hpp"

namespace fs = std::filesystem;
using namespace elastrun::ckpt;

namespace {

// Error text can carry bytes from a damaged file: control characters (a newline above all)
// would split the one error line, so they are shown escaped.
std::string one_line(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (c == '\n')
      out += "\\n";
    else if (byte < 0x20 || byte == 0x7f)
      out += fmt::format("\\x{:02x}", byte);
    else
      out += c;
  }
  return out;
}

std::string human_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, units[unit]);
}

std::uint64_t directory_bytes(const fs::path& dir) {
  std::uint64_t total = 0;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::error_code entry_ec;
    if (it->is_regular_file(entry_ec)) {
      const auto size = it->file_size(entry_ec);
      if (!entry_ec) total += size;
    }
  }
  return total;
}

// Accepts a step directory, or a checkpoint root (uses its `latest`).
fs::path resolve_step(const fs::path& given) {
  std::error_code ec;
  if (!fs::exists(given, ec)) throw CheckpointError(given.string() + ": no such file or directory");
  if (!fs::is_directory(given, ec)) throw CheckpointError(given.string() + ": not a directory");
  if (!fs::exists(given / "index.h5", ec) && fs::exists(fs::symlink_status(given / "latest", ec)) &&
      !fs::is_symlink(given / "latest", ec)) {
    throw CheckpointError(
        fmt::format("{}/latest is not a link to a step (a damaged pointer); pass a step-N "
                    "directory ('elastrun-ckpt ls {}' lists them)",
                    given.string(), given.string()));
  }
  if (!fs::exists(given / "index.h5", ec) && fs::is_symlink(given / "latest", ec)) {
    if (!fs::exists(given / "latest", ec))
      throw CheckpointError(fmt::format(
          "{}/latest points to '{}', which does not exist or cannot be followed (a damaged pointer); pass a "
          "step-N directory ('elastrun-ckpt ls {}' lists them)",
          given.string(), fs::read_symlink(given / "latest", ec).string(), given.string()));
    return given / "latest";
  }
  if (!fs::exists(given / "index.h5", ec) && given.filename().string().starts_with("step-")) {
    throw CheckpointError(
        fmt::format("{}: missing: not a complete checkpoint step (damaged, or an interrupted "
                    "save; restore uses an older step)",
                    (given / "index.h5").string()));
  }
  if (!fs::exists(given / "index.h5", ec)) {
    throw CheckpointError(given.string() +
                          ": not a checkpoint step (no index.h5); pass a step-N "
                          "directory or a checkpoint directory with 'latest'");
  }
  return given;
}

// " (committed by rendezvous round G, requeue R)" from the step's fence token, "" without one.
std::string committed_by(const fs::path& step_dir) {
  const auto token = commit_token(step_dir);
  if (token.empty()) return "";
  std::uint64_t requeues = 0, generation = 0;
  const char* end = token.data() + token.size();
  const auto [dot, ec1] = std::from_chars(token.data(), end, requeues);
  if (ec1 != std::errc{} || dot == end || *dot != '.') return fmt::format(" (committed by round '{}')", token);
  const auto [rest, ec2] = std::from_chars(dot + 1, end, generation);
  if (ec2 != std::errc{} || rest != end) return fmt::format(" (committed by round '{}')", token);
  return fmt::format(" (committed by rendezvous round {}, requeue {})", generation, requeues);
}

int command_ls(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    throw CheckpointError(root.string() +
                          ": not a checkpoint directory (does not exist or is "
                          "not a directory)");
  }
  std::string latest;
  if (fs::is_symlink(root / "latest", ec)) latest = fs::read_symlink(root / "latest", ec).string();
  const auto steps = list_steps(root);
  if (steps.empty()) throw CheckpointError(root.string() + ": no checkpoint steps here (no step-N directory)");
  // ls reads each step's index and checks its files and sizes; only `verify` hashes the contents.
  fmt::print("{:<16} {:>10} {:>6}  {}\n", "STEP", "SIZE", "WORLD",
             "STATUS (index and file sizes; 'verify' checks contents)");
  // Every step gets a line: a damaged one is shown as INVALID with the reason, never aborts.
  std::set<fs::path> listed;
  for (const auto& entry : steps) {
    listed.insert(entry.path);
    std::string status = "ok";
    std::string world = "?";
    try {
      Checkpoint checkpoint(entry.path);
      world = std::to_string(checkpoint.world_size());
      checkpoint.check_files();
    } catch (const std::exception& e) {
      status = std::string("INVALID: ") + e.what();
    }
    std::replace(status.begin(), status.end(), '\n', ' ');
    const std::string name = entry.path.filename().string();
    if (name != elastrun::ckpt::step_directory("", entry.step).string()) {
      status += fmt::format(" (recovered copy {})", name);
    }
    if (fs::exists(entry.path / kRejectedMarker, ec))
      status += fmt::format(" (a restore rejected it: {}; retention keeps it)", kRejectedMarker);
    fmt::print("{:<16} {:>10} {:>6}  {}{}{}\n", entry.step, human_bytes(directory_bytes(entry.path)), world, status,
               name == latest ? " (latest)" : "", committed_by(entry.path));
  }
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (listed.contains(entry.path())) continue;
    if (name.rfind("step-", 0) == 0 && name.find('.') != std::string::npos) {
      // Retired steps are renamed to step-N.deleting-<gen> and removed by the saving process in
      // the background; anything else with a suffix is left over from an interrupted save.
      const bool retired = name.find(".deleting-") != std::string::npos;
      fmt::print("{:<16} {:>10} {:>6}  {}\n", name, human_bytes(directory_bytes(entry.path())), "-",
                 retired ? "retired (being deleted, ignored; else removed by the next save)"
                         : "partial (interrupted save, ignored; removed by the next save)");
    }
  }
  return 0;
}

int command_inspect(const fs::path& given, bool show_shards) {
  Checkpoint checkpoint(resolve_step(given));
  fmt::print(
      "path:       {}\nstep:       {}\nworld size: {}\nlayout:     {}\ntensors:    {} "
      "({})\nmetadata:   {}\n",
      checkpoint.path().string(), checkpoint.step(), checkpoint.world_size(), checkpoint.layout(),
      checkpoint.tensors().size(), human_bytes(checkpoint.total_bytes()), checkpoint.metadata().dump());
  fmt::print("{:<40} {:<9} {:<18} {:<10} {:>6} {:>10}\n", "NAME", "DTYPE", "SHAPE", "PLACEMENT", "SHARDS", "SIZE");
  for (const auto& t : checkpoint.tensors()) {
    fmt::print("{:<40} {:<9} {:<18} {:<10} {:>6} {:>10}\n", t.name, dtype_name(t.dtype),
               fmt::format("[{}]", fmt::join(t.shape, ",")),
               t.placement == Placement::sharded ? "sharded" : "replicated", t.shards.size(), human_bytes(t.bytes()));
    if (show_shards) {
      for (const auto& s : t.shards) {
        fmt::print("    rank {:>5} {} offset [{}] extent [{}] xxh3 {:016x}\n", s.rank, s.file, fmt::join(s.offset, ","),
                   fmt::join(s.extent, ","), s.xxh3);
      }
    }
  }
  return 0;
}

int command_verify(const fs::path& given) {
  Checkpoint checkpoint(resolve_step(given));
  const auto problems = checkpoint.verify_all();
  if (problems.size() == 1) {
    std::cerr << "elastrun-ckpt: " << one_line(problems.front()) << "; this checkpoint must not be used\n";
    return 1;
  }
  for (const auto& problem : problems) std::cerr << "elastrun-ckpt: " << one_line(problem) << "\n";
  if (!problems.empty()) {
    fmt::print(stderr, "elastrun-ckpt: {}: {} problems; this checkpoint must not be used\n", checkpoint.path().string(),
               problems.size());
    return 1;
  }
  std::size_t shards = 0;
  for (const auto& t : checkpoint.tensors()) shards += t.shards.size();
  fmt::print("{}: ok ({} tensors, {} shard datasets, {} verified with xxh3_64)\n", checkpoint.path().string(),
             checkpoint.tensors().size(), shards, human_bytes(checkpoint.total_bytes()));
  return 0;
}

// Never write into a checkpoint: `--to STEP/index.h5` once overwrote the index it was reading.
void refuse_output_inside(const Checkpoint& checkpoint, const fs::path& output) {
  std::error_code ec;
  const fs::path target = fs::weakly_canonical(fs::absolute(output), ec);
  const fs::path step_dir = fs::weakly_canonical(checkpoint.path(), ec);
  const fs::path root = step_dir.parent_path();
  const bool root_is_checkpoint = fs::is_symlink(root / "latest", ec);  // else a loose step directory
  for (const fs::path& inside : {step_dir, root}) {
    const auto rel = target.lexically_relative(inside);
    if (rel.empty() || *rel.begin() == ".." || (inside == root && !root_is_checkpoint)) continue;
    throw CheckpointError(fmt::format("--to {}: inside the checkpoint directory {}; write the export elsewhere",
                                      output.string(), inside.string()));
  }
}

// torch.save files and DCP directories are pickles that only torch reads: this tool links no
// torch, so `import` and `export --format torch|dcp` run `python -m elastrun.convert` in its
// place -- $ELASTRUN_PYTHON, else the interpreter the package was built for, with the build
// tree's package (bin/../python) first on its path when this binary runs from a build tree.
int hand_over_to_python(const std::vector<std::string>& convert_args) {
  const char* from_env = std::getenv("ELASTRUN_PYTHON");
  const std::string python = from_env && *from_env ? from_env : ELASTRUN_PYTHON_EXECUTABLE;
  std::error_code ec;
  const fs::path package_dir = fs::read_symlink("/proc/self/exe", ec).parent_path().parent_path() / "python";
  if (!ec && fs::exists(package_dir / "elastrun" / "convert.py", ec)) {
    const char* old_path = std::getenv("PYTHONPATH");
    const std::string path = old_path && *old_path ? package_dir.string() + ":" + old_path : package_dir.string();
    if (setenv("PYTHONPATH", path.c_str(), 1) != 0) {
      fmt::print(stderr, "elastrun-ckpt: setenv PYTHONPATH: {}\n", std::strerror(errno));
      return 1;
    }
  }
  std::vector<std::string> args{python, "-m", "elastrun.convert"};
  args.insert(args.end(), convert_args.begin(), convert_args.end());
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  execvp(argv[0], argv.data());
  fmt::print(stderr, "elastrun-ckpt: cannot run {} for this format ({}); set ELASTRUN_PYTHON to a python3 with torch\n",
             python, std::strerror(errno));
  return 1;
}

// The export format: --format, else from the file name (.pt/.pth/.tar: torch's), else safetensors.
std::string export_format(const std::string& given, const fs::path& output) {
  if (!given.empty()) return given;
  const std::string name = output.filename().string();
  for (const std::string_view suffix : {".pt", ".pth", ".tar"})
    if (name.ends_with(suffix)) return "torch";
  return "safetensors";
}

int command_export(const fs::path& given, const fs::path& output, const std::string& format) {
  Checkpoint checkpoint(resolve_step(given));
  refuse_output_inside(checkpoint, output);
  if (format != "safetensors")
    return hand_over_to_python({"export", checkpoint.path().string(), "--to", output.string(), "--format", format});
  export_safetensors(checkpoint, output);
  fmt::print("wrote {} ({} tensors, {})\n", output.string(), checkpoint.tensors().size(),
             human_bytes(checkpoint.total_bytes()));
  return 0;
}

// ---- diff --------------------------------------------------------------------------------------

// Exit status of diff when the checkpoints cannot be compared at all (usage, unreadable step),
// as cmp(1)/diff(1) do: 1 means "they differ".
constexpr int kDiffTrouble = 2;

double half_to_double(std::uint16_t h) {
  const int sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double value;
  if (exponent == 0)
    value = std::ldexp(mantissa, -24);  // zero, subnormal
  else if (exponent == 31)
    value = mantissa ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    value = std::ldexp(mantissa + 1024, exponent - 25);
  return sign ? -value : value;
}

// Element `i` of a buffer of `dtype` as a double.
double element(const std::byte* data, DType dtype, std::size_t i) {
  auto load = [&]<typename T>(T) {
    T v;
    std::memcpy(&v, data + i * sizeof(T), sizeof(T));
    return v;
  };
  switch (dtype) {
    case DType::float16: return half_to_double(load(std::uint16_t{}));
    case DType::bfloat16: return std::bit_cast<float>(static_cast<std::uint32_t>(load(std::uint16_t{})) << 16);
    case DType::float32: return load(float{});
    case DType::float64: return load(double{});
    case DType::int8: return load(std::int8_t{});
    case DType::int16: return load(std::int16_t{});
    case DType::int32: return load(std::int32_t{});
    case DType::int64: return static_cast<double>(load(std::int64_t{}));
    case DType::uint8: return load(std::uint8_t{});
    case DType::boolean: return load(std::uint8_t{}) != 0 ? 1.0 : 0.0;
  }
  return 0;
}

// |a - b| where equal infinities and two NaNs count as equal, one NaN as infinitely far.
double distance(double a, double b) {
  if (std::isnan(a) || std::isnan(b))
    return std::isnan(a) && std::isnan(b) ? 0.0 : std::numeric_limits<double>::infinity();
  if (a == b) return 0.0;  // also equal infinities
  return std::fabs(a - b);
}

// max |a - b| over a tensor present in both checkpoints with the same dtype and shape, read in
// blocks of rows of at most ~16 MiB per side (every piece is hash-verified on first read).
double tensor_distance(Checkpoint& a, Checkpoint& b, const TensorInfo& t) {
  const std::uint64_t count = element_count(t.shape);
  if (count == 0) return 0.0;
  const std::size_t esize = dtype_size(t.dtype);
  const std::uint64_t rows = t.shape.empty() ? 1 : t.shape[0];
  const std::uint64_t row_elements = t.shape.empty() ? 1 : count / rows;
  const std::uint64_t block_rows =
      std::max<std::uint64_t>(1, (16u << 20) / std::max<std::uint64_t>(1, row_elements * esize));
  std::vector<std::byte> ba, bb;
  double worst = 0.0;
  for (std::uint64_t r = 0; r < rows; r += block_rows) {
    const std::uint64_t n = std::min(block_rows, rows - r);
    Shape offset(t.shape.size(), 0), extent = t.shape;
    if (!t.shape.empty()) {
      offset[0] = r;
      extent[0] = n;
    }
    const std::size_t elements = n * row_elements;
    ba.resize(elements * esize);
    bb.resize(elements * esize);
    a.read(TensorTarget::box(t.name, t.dtype, offset, extent, ba.data()));
    b.read(TensorTarget::box(t.name, t.dtype, offset, extent, bb.data()));
    for (std::size_t i = 0; i < elements; ++i)
      worst = std::max(worst, distance(element(ba.data(), t.dtype, i), element(bb.data(), t.dtype, i)));
  }
  return worst;
}

std::string shape_text(const Shape& shape) { return fmt::format("[{}]", fmt::join(shape, ",")); }

// Compares every tensor of two checkpoints by name. Exit 0: same tensors, every max |Δ| <= tol;
// 1: some tensor above tol, or missing/extra tensors, or a dtype/shape mismatch (one stderr
// line each); 2: a checkpoint cannot be read.
int command_diff(const fs::path& given_a, const fs::path& given_b, double tol) {
  // Any exception (unreadable or damaged checkpoint) is exit 2, by the caller.
  std::optional<Checkpoint> a(resolve_step(given_a)), b(resolve_step(given_b));
  fmt::print("a: {} (step {}, world size {})\nb: {} (step {}, world size {})\n", a->path().string(), a->step(),
             a->world_size(), b->path().string(), b->step(), b->world_size());
  std::map<std::string, const TensorInfo*> in_a, in_b;
  for (const auto& t : a->tensors()) in_a[t.name] = &t;
  for (const auto& t : b->tensors()) in_b[t.name] = &t;
  int mismatches = 0;
  for (const auto& [name, t] : in_b) {
    if (!in_a.contains(name)) {
      fmt::print(stderr, "elastrun-ckpt: tensor '{}' is only in b ({})\n", name, b->path().string());
      ++mismatches;
    }
  }
  double worst = 0.0;
  std::size_t compared = 0;
  for (const auto& [name, ta] : in_a) {
    const auto it = in_b.find(name);
    if (it == in_b.end()) {
      fmt::print(stderr, "elastrun-ckpt: tensor '{}' is only in a ({})\n", name, a->path().string());
      ++mismatches;
      continue;
    }
    const TensorInfo* tb = it->second;
    if (ta->dtype != tb->dtype || ta->shape != tb->shape) {
      fmt::print(stderr, "elastrun-ckpt: tensor '{}' differs in type: {} {} in a, {} {} in b\n", name,
                 dtype_name(ta->dtype), shape_text(ta->shape), dtype_name(tb->dtype), shape_text(tb->shape));
      ++mismatches;
      continue;
    }
    const double d = tensor_distance(*a, *b, *ta);
    fmt::print("{} {:.6e}{}\n", name, d, d > tol ? "  ABOVE TOLERANCE" : "");
    worst = std::max(worst, d);
    ++compared;
  }
  fmt::print("max |Δ| = {:.6e} over {} tensors (tol {:g}){}\n", worst, compared, tol,
             mismatches ? fmt::format("; {} tensor(s) not comparable", mismatches) : "");
  // NaN never passes a tolerance.
  return mismatches == 0 && worst <= tol ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect, verify, export and import elastrun HDF5 checkpoints", "elastrun-ckpt"};
  app.require_subcommand(1);
  fs::path path;
  fs::path output;
  bool show_shards = false;
  auto* ls = app.add_subcommand("ls", "List the steps of a checkpoint directory");
  ls->add_option("DIR", path, "Checkpoint directory (holds step-*/ and latest)")->required();
  auto* inspect = app.add_subcommand("inspect", "Show tensors, shapes, dtypes and shards");
  inspect->add_option("STEP", path, "Step directory, or a checkpoint directory for latest")->required();
  inspect->add_flag("--shards", show_shards, "List every shard of every tensor");
  auto* verify = app.add_subcommand("verify", "Check every shard's content hash (exit 1 if bad)");
  verify->add_option("STEP", path, "Step directory, or a checkpoint directory for latest")->required();
  std::string format;
  auto* export_cmd = app.add_subcommand(
      "export", "Write the checkpoint as one safetensors file, torch.save file(s) or a DCP directory");
  export_cmd->add_option("STEP", path, "Step directory, or a checkpoint directory for latest")->required();
  export_cmd
      ->add_option("--to", output,
                   "Output: .safetensors file; torch.save file ({rank} in it: one file per imported rank); DCP "
                   "directory (new)")
      ->required();
  export_cmd
      ->add_option("--format", format, "safetensors, torch or dcp (default: torch for .pt/.pth/.tar, else safetensors)")
      ->check(CLI::IsMember({"safetensors", "torch", "dcp"}));
  std::vector<std::string> sources;
  std::string import_to;
  std::string import_step;
  auto* import_cmd = app.add_subcommand(
      "import", "Turn torch.save files (one, or one per rank) or a DCP directory into a checkpoint step");
  import_cmd->add_option("SOURCE", sources, "torch.save file(s), or one torch.distributed.checkpoint directory")
      ->required();
  import_cmd->add_option("--to", import_to, "Checkpoint directory to create (or one without steps)")->required();
  import_cmd->add_option("--step", import_step, "Step number (default: a top-level step/global_step/iteration, else 0)")
      ->check(CLI::NonNegativeNumber);
  fs::path other;
  double tol = 1e-4;
  auto* diff = app.add_subcommand(
      "diff", "Max abs difference per tensor of two checkpoints (exit 0 if all <= tol, 1 if not, 2 on errors)");
  diff->add_option("A", path, "Step directory, or a checkpoint directory for latest")->required();
  diff->add_option("B", other, "Step directory, or a checkpoint directory for latest")->required();
  diff->add_option("--tol", tol, "Largest allowed max |a - b| of any element (default 1e-4)")
      ->check(CLI::Validator(
          [](const std::string& text) {
            std::size_t used = 0;
            double value = -1;
            try {
              value = std::stod(text, &used);
            } catch (const std::exception&) {
            }
            return used == text.size() && value >= 0 ? std::string() : "must be a number >= 0, not '" + text + "'";
          },
          "TOL"));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help (rc 0) or the usage error
    return rc == 0 ? 0 : 2;
  }
  try {
    if (*diff) {
      try {
        return command_diff(path, other, tol);
      } catch (const std::exception& e) {
        std::cerr << "elastrun-ckpt: " << one_line(e.what()) << "\n";
        return kDiffTrouble;
      }
    }
    if (*ls) return command_ls(path);
    if (*inspect) return command_inspect(path, show_shards);
    if (*verify) return command_verify(path);
    if (*export_cmd) return command_export(path, output, export_format(format, output));
    if (*import_cmd) {
      std::vector<std::string> args{"import", "--to", import_to};
      if (!import_step.empty()) args.insert(args.end(), {"--step", import_step});
      args.push_back("--");
      args.insert(args.end(), sources.begin(), sources.end());
      return hand_over_to_python(args);
    }
  } catch (const std::exception& e) {
    std::cerr << "elastrun-ckpt: " << one_line(e.what()) << "\n";
    return 1;
  }
  return 2;
}
