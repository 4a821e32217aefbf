#include "elastic.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "elastrun/rdzv/env.hpp"

namespace elastrun::spank {

bool safe_token(std::string_view text) {
  if (text.empty() || text.size() > 200 || text == "." || text == "..") return false;
  for (char c : text)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.') return false;
  return true;
}

bool srun_option_given(const std::vector<std::string>& srun_argv, const std::vector<std::string>& program_argv,
                       std::string_view option) {
  std::size_t options_end = srun_argv.size();
  if (!program_argv.empty() && program_argv.size() <= srun_argv.size() &&
      std::equal(program_argv.rbegin(), program_argv.rend(), srun_argv.rbegin()))
    options_end = srun_argv.size() - program_argv.size();
  for (std::size_t i = 1; i < options_end; ++i)
    if (srun_argv[i] == option || srun_argv[i].starts_with(std::string(option) + "=")) return true;
  return false;
}

std::vector<std::string> agent_flags(const AgentPlan& plan) {
  std::vector<std::string> flags;
  if (plan.range.min > 0)
    flags.push_back(plan.range.min == plan.range.max ? fmt::format("--nnodes={}", plan.range.min)
                                                     : fmt::format("--nnodes={}:{}", plan.range.min, plan.range.max));
  if (plan.nproc > 0) flags.push_back(fmt::format("--nproc-per-node={}", plan.nproc));
  flags.push_back("--rdzv-backend=c10d");
  flags.push_back(fmt::format("--rdzv-endpoint={}:{}", plan.store_host, plan.store_port));
  flags.push_back(fmt::format("--rdzv-id={}", plan.run_id));
  flags.push_back("--rdzv-conf=is_host=0");  // srun's store helper hosts it, no agent does
  flags.push_back("--rdzv-auth=token");
  flags.push_back(fmt::format("--log-dir={}", plan.log_dir));
  return flags;
}

std::string join_lines(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += '\n';
    out += item;
  }
  return out;
}

std::string elastic_run_id(std::uint32_t job, std::uint32_t step, std::string_view restart_count) {
  return rdzv::format_run_id(std::to_string(job), std::to_string(step), restart_count);
}

std::string step_dir_name(std::uint32_t job, std::uint32_t step, std::string_view node) {
  return fmt::format("elastrun-spank.{}.{}.{}", job, step, node);
}

bool is_job_dir_name(std::string_view name, std::uint32_t job) {
  const std::string prefix = fmt::format("elastrun-spank.{}.", job);
  if (!name.starts_with(prefix)) return false;
  const auto rest = name.substr(prefix.size());  // <step>.<node>
  const auto dot = rest.find('.');
  if (dot == 0 || dot == std::string_view::npos || dot + 1 >= rest.size()) return false;
  for (char c : rest.substr(0, dot))
    if (!std::isdigit(static_cast<unsigned char>(c))) return false;
  return true;
}

}  // namespace elastrun::spank
