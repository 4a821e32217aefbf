#include "run_spec.hpp"

#include <fmt/format.h>

#include <cctype>
#include <filesystem>
#include <map>

#include "elastrun/util/parse.hpp"

namespace elastrun::jobs {

namespace {

// A flag and its value: `--flag VALUE` or `--flag=VALUE` (one word).
struct Words {
  const std::vector<std::string>& all;
  std::size_t at = 0;

  bool done() const { return at >= all.size(); }
  const std::string& peek() const { return all[at]; }
  // If the current word is one of `names` (with or without `=VALUE`), consumes it and its value.
  bool take(std::initializer_list<const char*> names, std::string& value) {
    const std::string& w = all[at];
    for (const char* name : names) {
      const std::string n = name;
      if (w == n) {
        if (at + 1 >= all.size()) throw UsageError(fmt::format("{} needs a value", n));
        value = all[at + 1];
        at += 2;
        return true;
      }
      if (w.starts_with(n + "=")) {
        value = w.substr(n.size() + 1);
        at += 1;
        return true;
      }
    }
    return false;
  }
  bool flag(std::initializer_list<const char*> names) {
    for (const char* name : names)
      if (all[at] == name) {
        ++at;
        return true;
      }
    return false;
  }
};

int count_of(const std::string& text, const std::string& what, int lo) {
  auto v = util::parse_integer_in<int>(text, lo, 1 << 20);
  if (!v) throw UsageError(fmt::format("{} '{}' is not a whole number >= {}", what, text, lo));
  return *v;
}

void parse_component_options(Words& w, RunSpec& s) {
  const bool ddp = s.component == "dist.ddp";
  const bool python = s.component == "utils.python";
  bool shape_given = false;  // a -j seen
  std::string v;
  while (!w.done()) {
    const std::string& word = w.peek();
    if (word == "--") {  // the script's own arguments
      s.script_args.insert(s.script_args.end(), w.all.begin() + static_cast<long>(w.at) + 1, w.all.end());
      w.at = w.all.size();
      return;
    }
    if (!word.starts_with("-") || word == "-") {
      if (s.component == "utils.sh") {  // the command and all its words
        s.command.assign(w.all.begin() + static_cast<long>(w.at), w.all.end());
        w.at = w.all.size();
        return;
      }
      // TorchX's components take the script's arguments as trailing words too
      s.script_args.push_back(word);
      ++w.at;
      continue;
    }
    if (w.take({"--name"}, s.name)) continue;
    if (w.take({"--env"}, v)) {
      for (auto& kv : parse_pairs(v, "--env")) s.env.push_back(std::move(kv));
      continue;
    }
    if ((ddp || python) && w.take({"--script"}, s.script)) continue;
    if ((ddp || python) && w.take({"-m", "--m"}, s.module)) continue;
    if (python && w.take({"-c"}, s.code)) continue;
    if (ddp) {
      if (w.take({"-j", "--j"}, v)) {
        shape_given = true;
        // with --het every -j is a component (a comma list is several); else the last one counts
        std::size_t start = 0;
        do {
          auto end = v.find(',', start);
          if (end == std::string::npos) end = v.size();
          const auto shape = parse_job_shape(v.substr(start, end - start));
          if (end < v.size() && !s.het_requested)
            throw UsageError(fmt::format("bad -j '{}': a list of components needs --het (before -j)", v));
          if (s.het_requested) s.het.push_back(shape);
          s.min_nodes = s.het.empty() ? shape.min_nodes : s.het.front().min_nodes;
          s.max_nodes = s.het.empty() ? shape.max_nodes : s.het.front().max_nodes;
          s.nproc_per_node = s.het.empty() ? shape.nproc_per_node : s.het.front().nproc_per_node;
          start = end + 1;
        } while (start <= v.size());
        continue;
      }
      if (w.flag({"--het"})) {
        if (shape_given) throw UsageError("--het goes before the components' -j options");
        s.het_requested = true;
        continue;
      }
      if (w.take({"--max_retries", "--max-retries"}, v)) {
        s.max_retries = count_of(v, "--max_retries", 0);
        continue;
      }
      if (w.take({"--max-restarts", "--max_restarts"}, v)) {
        s.max_restarts = count_of(v, "--max-restarts", 0);
        continue;
      }
      if (w.take({"--checkpoint-dir", "--checkpoint_dir"}, s.checkpoint_dir)) continue;
      if (w.take({"--spares"}, v)) {
        s.spares = count_of(v, "--spares", 0);
        continue;
      }
      if (w.take({"--preload"}, s.preload)) continue;
      if (word == "--memory-checkpoints") {
        s.memory_checkpoints = "";
        ++w.at;
        continue;
      }
      if (w.take({"--memory-checkpoints"}, v)) {
        if (!util::parse_byte_size(v))
          throw UsageError(fmt::format("--memory-checkpoints='{}' is not a size (e.g. 8G, 512M)", v));
        s.memory_checkpoints = v;
        continue;
      }
      if (w.take({"--signal"}, s.signal)) continue;
      if (w.take({"--cpu"}, v)) {
        s.cpus_per_node = count_of(v, "--cpu", 1);
        continue;
      }
      if (w.take({"--gpu"}, v)) {
        s.gpus_per_node = count_of(v, "--gpu", 0);
        continue;
      }
      if (w.take({"--memMB", "--mem_mb"}, v)) {
        s.mem_mb = count_of(v, "--memMB", 1);
        continue;
      }
    }
    throw UsageError(
        fmt::format("unknown option '{}' for {} (see elastrun run {} --help)", word, s.component, s.component));
  }
}

void check(const RunSpec& s) {
  if (s.het_requested) {
    if (s.het.size() < 2)
      throw UsageError("--het needs one -j per component, two or more (e.g. --het -j 2:3x2 -j 1x1)");
    if (s.spares > 0)
      throw UsageError("--spares does not go with --het: give a component more nodes than its MAX needs instead");
    if (s.scheduler == "local") throw UsageError("--het is a Slurm heterogeneous job: not with -s local");
  }
  if (s.component == "utils.sh") {
    if (s.command.empty()) throw UsageError("utils.sh needs a command: elastrun run utils.sh COMMAND [ARGS...]");
    return;
  }
  const int given = !s.script.empty() + !s.module.empty() + !s.code.empty();
  if (given == 0) {
    if (s.component == "utils.python") throw UsageError("utils.python needs --script FILE, -m MODULE or -c CODE");
    throw UsageError("dist.ddp needs --script FILE or -m MODULE");
  }
  if (given > 1) throw UsageError(fmt::format("{}: give one of --script, -m and -c, not several", s.component));
}

}  // namespace

JobShape parse_job_shape(const std::string& text) {
  const auto bad = [&] {
    return UsageError(fmt::format("bad -j '{}': expected [MIN:]MAXxNPROC, e.g. 2x8 or 2:4x8", text));
  };
  std::string nodes = text, nproc = "1";
  if (const auto x = text.find('x'); x != std::string::npos) {
    nodes = text.substr(0, x);
    nproc = text.substr(x + 1);
  }
  std::string lo = nodes, hi = nodes;
  if (const auto c = nodes.find(':'); c != std::string::npos) {
    lo = nodes.substr(0, c);
    hi = nodes.substr(c + 1);
  }
  const auto a = util::parse_integer_in<int>(lo, 1, 1 << 20);
  const auto b = util::parse_integer_in<int>(hi, 1, 1 << 20);
  const auto n = util::parse_integer_in<int>(nproc, 1, 1 << 16);
  if (!a || !b || !n) throw bad();
  if (*a > *b) throw UsageError(fmt::format("bad -j '{}': MIN {} is above MAX {}", text, *a, *b));
  return {*a, *b, *n};
}

std::vector<std::pair<std::string, std::string>> parse_pairs(const std::string& text, const std::string& what) {
  std::vector<std::pair<std::string, std::string>> pairs;
  std::size_t start = 0;
  while (start <= text.size()) {
    auto end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      throw UsageError(fmt::format("bad {} item '{}': expected KEY=VALUE", what, item));
    pairs.emplace_back(item.substr(0, eq), item.substr(eq + 1));
    start = end + 1;
  }
  return pairs;
}

RunSpec parse_run(const std::vector<std::string>& words) {
  RunSpec s;
  s.words = words;
  Words w{words};
  std::string v;
  while (!w.done() && s.component.empty()) {
    const std::string& word = w.peek();
    if (w.take({"-s", "--scheduler"}, v)) {
      if (v == "local_cwd" || v == "local") {
        s.scheduler = "local";
      } else if (v == "slurm") {
        s.scheduler = "slurm";
      } else {
        throw UsageError(fmt::format("unknown scheduler '{}': slurm, local (or local_cwd)", v));
      }
      continue;
    }
    if (w.take({"-cfg", "--cfg", "--scheduler_args", "--scheduler-args"}, v)) {
      for (auto& kv : parse_pairs(v, "-cfg")) s.cfg.push_back(std::move(kv));
      continue;
    }
    if (w.flag({"--dryrun", "--dry-run"})) {
      s.dryrun = true;
      continue;
    }
    if (w.flag({"--wait"})) {
      s.wait = true;
      continue;
    }
    if (word.starts_with("-")) throw UsageError(fmt::format("unknown option '{}' for elastrun run", word));
    if (word != "dist.ddp" && word != "utils.python" && word != "utils.sh")
      throw UsageError(fmt::format("unknown component '{}': one of {}", word, kComponents));
    s.component = word;
    ++w.at;
  }
  if (s.component.empty())
    throw UsageError(fmt::format("no component: elastrun run [-s slurm|local] COMPONENT ... ({})", kComponents));
  parse_component_options(w, s);
  check(s);
  for (const auto& [key, value] : s.cfg) {
    if (key.empty() || key.starts_with("-") || key.find_first_of(" \t\n'\"") != std::string::npos)
      throw UsageError(fmt::format("bad -cfg key '{}': a Slurm option name without dashes, e.g. partition=debug", key));
    (void)value;
  }
  for (const auto& [key, value] : s.env) {
    const bool ok =
        !key.empty() && !std::isdigit(static_cast<unsigned char>(key[0])) &&
        key.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_") == std::string::npos;
    if (!ok) throw UsageError(fmt::format("bad --env name '{}': letters, digits and _ only", key));
    (void)value;
  }
  return s;
}

namespace {

std::string raw_name(const RunSpec& spec) {
  if (!spec.name.empty()) return spec.name;
  if (!spec.script.empty()) return std::filesystem::path(spec.script).stem().string();
  if (!spec.module.empty()) {
    const auto dot = spec.module.rfind('.');
    return dot == std::string::npos ? spec.module : spec.module.substr(dot + 1);
  }
  if (!spec.command.empty()) {
    const std::string first = spec.command.front().substr(0, spec.command.front().find(' '));
    return std::filesystem::path(first).filename().string();
  }
  return spec.component == "utils.python" ? "python" : "elastrun";
}

}  // namespace

std::string job_name(const RunSpec& spec) {
  // a file name and a Slurm job name: letters, digits, '.', '_', '-' only
  std::string name = raw_name(spec);
  for (char& c : name)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '_';
  return name.empty() || name.front() == '.' ? "job" + name : name;
}

}  // namespace elastrun::jobs
