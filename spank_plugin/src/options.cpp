#include "options.hpp"

#include <fmt/format.h>

#include <cctype>

#include "elastrun/util/parse.hpp"

namespace elastrun::spank {
namespace {

std::optional<int> parse_positive(std::string_view text, int max) { return util::parse_integer_in(text, 1, max); }

std::string lower(std::string_view text) {
  std::string out(text);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::optional<bool> parse_bool(std::string_view text) { return util::parse_boolean(text); }

constexpr int kMaxNodes = 1'000'000;

// An option given without its optional argument. sbatch/salloc 22.05 forward such an option to
// the job's srun steps as SLURM_SPANK__SLURM_SPANK_OPTION_<plugin>_<option>=(null) (printf of a
// NULL optarg; verified on the testbed), so "(null)" means the bare flag too.
bool bare(const char* optarg) { return optarg == nullptr || *optarg == '\0' || std::string_view(optarg) == "(null)"; }

}  // namespace

std::string_view to_string(MasterAddrMode mode) {
  switch (mode) {
    case MasterAddrMode::Auto: return "auto";
    case MasterAddrMode::Hostname: return "hostname";
    case MasterAddrMode::NodeAddr: return "nodeaddr";
  }
  return "?";
}

std::string_view to_string(RunIdMode mode) {
  switch (mode) {
    case RunIdMode::Step: return "step";
    case RunIdMode::Job: return "job";
  }
  return "?";
}

SiteConfig parse_site_args(const std::vector<std::string>& args) {
  SiteConfig config;
  for (const auto& arg : args) {
    const auto eq = arg.find('=');
    if (eq == std::string::npos || eq == 0)
      throw OptionError(
          fmt::format("site argument '{}' in plugstack.conf is not key=value; known keys: torch_env, "
                      "master_addr, run_id, agent, tmpdir (see docs/spank.md)",
                      arg));
    const std::string_view key = std::string_view(arg).substr(0, eq);
    const std::string_view value = std::string_view(arg).substr(eq + 1);
    if (key == "torch_env") {
      auto b = parse_bool(value);
      if (!b) throw OptionError(fmt::format("site argument torch_env='{}' in plugstack.conf must be yes or no", value));
      config.torch_env = *b;
    } else if (key == "master_addr") {
      const std::string v = lower(value);
      if (v == "auto")
        config.master_addr = MasterAddrMode::Auto;
      else if (v == "hostname")
        config.master_addr = MasterAddrMode::Hostname;
      else if (v == "nodeaddr")
        config.master_addr = MasterAddrMode::NodeAddr;
      else
        throw OptionError(
            fmt::format("site argument master_addr='{}' in plugstack.conf must be auto, hostname or nodeaddr", value));
    } else if (key == "run_id") {
      const std::string v = lower(value);
      if (v == "step")
        config.run_id = RunIdMode::Step;
      else if (v == "job")
        config.run_id = RunIdMode::Job;
      else
        throw OptionError(fmt::format("site argument run_id='{}' in plugstack.conf must be step or job", value));
    } else if (key == "agent" || key == "tmpdir") {
      if (value.empty() || value.front() != '/')
        throw OptionError(fmt::format("site argument {}='{}' in plugstack.conf must be an absolute path", key, value));
      (key == "agent" ? config.agent : config.tmpdir) = std::string(value);
    } else {
      throw OptionError(
          fmt::format("unknown site argument '{}' in plugstack.conf; known keys: torch_env, master_addr, "
                      "run_id, agent, tmpdir (see docs/spank.md)",
                      key));
    }
  }
  return config;
}

bool parse_torch_env(const char* optarg) {
  if (bare(optarg)) return true;
  auto b = parse_bool(optarg);
  if (!b)
    throw OptionError(
        fmt::format("--torch-env='{}' is not yes or no; use --torch-env (same as --torch-env=yes) or "
                    "--torch-env=no",
                    optarg));
  return *b;
}

ElasticRange parse_elastic(const char* optarg) {
  if (bare(optarg)) return {};
  const std::string_view text(optarg);
  const auto colon = text.find(':');
  const std::string_view min_text = text.substr(0, colon);
  const std::string_view max_text = colon == std::string_view::npos ? min_text : text.substr(colon + 1);
  auto min = parse_positive(min_text, kMaxNodes);
  auto max = parse_positive(max_text, kMaxNodes);
  if (!min || !max)
    throw OptionError(
        fmt::format("--elastic='{}' is not MIN:MAX or N with positive node counts; e.g. --elastic=2:4", text));
  if (*min > *max)
    throw OptionError(
        fmt::format("--elastic={}: MIN ({}) is greater than MAX ({}); use --elastic=MIN:MAX with MIN <= MAX, "
                    "e.g. --elastic={}:{}",
                    text, *min, *max, *max, *min));
  return {*min, *max};
}

int parse_elastic_nproc(const char* optarg) {
  const std::string_view text = optarg ? optarg : "";
  auto n = parse_positive(text, kMaxNproc);
  if (!n)
    throw OptionError(fmt::format(
        "--elastic-nproc='{}' is not a number of workers per node (1-{}); e.g. --elastic-nproc=4", text, kMaxNproc));
  return *n;
}

std::string option_env_name(std::string_view plugin, std::string_view option) {
  std::string name = "SLURM_SPANK__SLURM_SPANK_OPTION_";
  auto append = [&](std::string_view part) {
    for (char c : part) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
  };
  append(plugin);
  name += '_';
  append(option);
  return name;
}

}  // namespace elastrun::spank
