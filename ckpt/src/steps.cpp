// Step directories under a checkpoint root: publishing a step (the commit point, `latest`),
// retiring steps, listing the committed ones (save and restore both use it), and the housekeeping
// after a commit (leftovers, retention). Format and protocol: docs/checkpoint-format.md.
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <map>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>

#include "elastrun/ckpt/checkpoint.hpp"
#include "internal.hpp"
#include "steps.hpp"

namespace elastrun::ckpt {

namespace fs = std::filesystem;

bool detail::path_exists(const fs::path& path) {
  struct stat info {};
  return ::lstat(path.c_str(), &info) == 0;
}

namespace {

// Makes `temporary` visible as `final_path`. If a step directory of that name exists it is
// swapped atomically (renameat2 RENAME_EXCHANGE): there is no moment without a complete copy of
// the step. Returns where the replaced copy now lives (empty if there was none). Throws if the
// new step did not become visible (then the old one, if any, is still in place).
fs::path publish(const fs::path& root, const fs::path& temporary, const fs::path& final_path, std::uint64_t step,
                 const std::string& generation) {
  if (!detail::path_exists(final_path)) {
    detail::rename_path(temporary, final_path);
    return {};
  }
  if (!detail::rename_exchange_disabled()) {
    if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
      return temporary;  // now holds the old copy
    }
    if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP) {
      throw CheckpointError(fmt::format("renameat2(RENAME_EXCHANGE) {} <-> {} failed: {}", temporary.string(),
                                        final_path.string(), std::strerror(errno)));
    }
  }
  // The filesystem cannot exchange: move the old copy aside first. A crash between the two
  // renames leaves step-<n>.replaced-<gen>, which list_steps() still treats as step n.
  const fs::path aside = root / (detail::step_name(step) + std::string(detail::kReplacedInfix) + generation);
  detail::rename_path(final_path, aside);
  detail::fault_point("commit.between_renames", 0);
  if (::rename(temporary.c_str(), final_path.c_str()) != 0) {
    const int saved = errno;
    (void)::rename(aside.c_str(), final_path.c_str());  // put the old copy back
    throw CheckpointError(
        fmt::format("rename {} -> {} failed: {}", temporary.string(), final_path.string(), std::strerror(saved)));
  }
  return aside;
}

}  // namespace

// Rank 0: removes a step directory that is no longer wanted (retention, a replaced copy). It is
// renamed synchronously to "step-<n>.deleting-<gen>", a name every reader ignores, so a crash
// mid-removal never leaves a half-deleted step under a name that counts; the deletion itself is
// slow (ext4 with `discard`, Lustre) and every rank waits for rank 0's commit, so a background
// thread does it. Killed first, the next save removes the leftover. Throws if the rename fails.
void detail::retire(const fs::path& root, std::uint64_t step, const fs::path& directory) {
  const fs::path doomed = root / (detail::step_name(step) + ".deleting-" + detail::generation_token());
  detail::rename_path(directory, doomed);
  detail::remove_in_background(doomed);
}

// Rank 0, after every rank voted yes: make the step durable and visible. Throws only if the
// step was not committed; problems after that point are returned as warnings (the save is
// committed and restore will use it).
std::vector<std::string> detail::commit(const fs::path& root, const fs::path& temporary, std::uint64_t step,
                                        const std::string& generation, const SaveOptions& options) {
  const fs::path final_path = root / detail::step_name(step);
  if (options.fsync) {
    detail::fsync_path(temporary / detail::kIndexFile, false);
    detail::fsync_path(temporary, true);
  }
  detail::fault_point("commit.before_publish", 0);
  // A node cut off from the quorum commits nothing; a step that is committed says by which round.
  if (const auto token = detail::fence_commit(final_path); !token.empty()) {
    const fs::path record = temporary / kCommitRecord;
    {
      std::ofstream out(record);
      out << nlohmann::json{{"fence_token", token}}.dump() << '\n';
      out.flush();
      if (!out)
        throw CheckpointError(fmt::format("{} not committed: cannot write {}", final_path.string(), record.string()));
    }
    if (options.fsync) {
      detail::fsync_path(record, false);
      detail::fsync_path(temporary, true);
    }
  }
  const fs::path replaced = publish(root, temporary, final_path, step, generation);
  // Committed. Nothing below may turn this into a reported failure.
  std::vector<std::string> warnings;
  auto attempt = [&](const char* what, const auto& action) {
    try {
      action();
    } catch (const std::exception& e) {
      warnings.push_back(fmt::format("step {} committed, but {} failed: {}", step, what, e.what()));
    }
  };
  attempt("post-commit hook", [&] { detail::fault_point("commit.published", 0); });
  if (options.fsync) attempt("fsync of the checkpoint directory", [&] { detail::fsync_path(root, true); });
  attempt("updating 'latest'", [&] {
    const fs::path link_temporary = root / (std::string(detail::kLatestLink) + ".tmp-" + generation);
    std::error_code ec;
    fs::create_symlink(detail::step_name(step), link_temporary, ec);
    if (ec) {
      throw CheckpointError(fmt::format("cannot create symlink {}: {}", link_temporary.string(), ec.message()));
    }
    try {
      detail::rename_path(link_temporary, root / detail::kLatestLink);
    } catch (...) {
      fs::remove(link_temporary, ec);
      throw;
    }
    if (options.fsync) detail::fsync_path(root, true);
  });
  if (!replaced.empty()) {
    attempt("removing the replaced copy", [&] {
      // list_steps() takes "step-<n>.replaced-<gen>" for step n when step-<n> is missing, so it
      // must not be deleted file by file under that name. If the rename fails (a warning), the
      // housekeeping after this commit removes the copy.
      detail::retire(root, step, replaced);
    });
  }
  return warnings;
}

fs::path step_directory(const fs::path& root, std::uint64_t step) { return root / detail::step_name(step); }

namespace {
// "step-<n>.replaced-<gen>" -> n
std::optional<std::uint64_t> parse_replaced_name(std::string_view name) {
  const auto infix = name.find(detail::kReplacedInfix);
  if (infix == std::string_view::npos) return std::nullopt;
  return detail::parse_step_name(name.substr(0, infix));
}
}  // namespace

std::vector<StepEntry> list_steps(const fs::path& root) {
  std::map<std::uint64_t, fs::path> steps;
  std::map<std::uint64_t, fs::path> replaced;
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return {};
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory(ec)) continue;
    if (auto step = detail::parse_step_name(name)) {
      steps[*step] = entry.path();
    } else if (auto old = parse_replaced_name(name)) {
      replaced.emplace(*old, entry.path());
    }
  }
  // A crash between the two renames of a non-atomic replacement left only the old copy.
  for (const auto& [step, path] : replaced) steps.try_emplace(step, path);
  std::vector<StepEntry> result;
  result.reserve(steps.size());
  for (const auto& [step, path] : steps) result.push_back({step, path});
  return result;
}

void remove_partial_directories(const fs::path& root) {
  std::error_code ec;
  fs::directory_iterator it(root, ec);
  if (ec) return;
  std::vector<fs::path> stale;
  std::vector<std::pair<fs::path, fs::path>> restore;  // replaced copy -> its step name
  std::set<std::uint64_t> restored_steps;
  for (const auto& entry : it) {
    const std::string name = entry.path().filename().string();
    if (auto old = parse_replaced_name(name)) {
      const fs::path step_path = root / detail::step_name(*old);
      if (!detail::path_exists(step_path) && restored_steps.insert(*old).second) {
        restore.emplace_back(entry.path(), step_path);
        continue;
      }
    }
    if (detail::is_partial_name(name) || name.rfind(std::string(detail::kLatestLink) + ".tmp-", 0) == 0) {
      stale.push_back(entry.path());
    }
  }
  for (const auto& [from, to] : restore) {
    if (::rename(from.c_str(), to.c_str()) != 0) continue;  // retried by the next save
  }
  for (const auto& path : stale) {
    // Being removed by this process's background remover (an earlier save retired it): not a
    // crash leftover, leave it to that thread. The rest are rare leftovers of a killed process.
    if (detail::removal_pending(path)) continue;
    fs::remove_all(path, ec);
  }
}

void apply_retention(const fs::path& root, std::uint64_t committed, int keep_last, std::uint64_t keep_every) {
  std::vector<StepEntry> older;
  for (const auto& entry : list_steps(root)) {
    if (entry.step > committed) {
      // A step numbered above the one just committed belongs to an abandoned timeline (the run
      // restarted from an older step). Restore picks the highest step, so it is set aside —
      // never deleted automatically: it may be the only copy of someone's data.
      const fs::path aside = root / ("abandoned-" + detail::step_name(entry.step) + "-" + detail::generation_token());
      detail::rename_path(entry.path, aside);
    } else if (entry.step < committed) {
      older.push_back(entry);
    }
  }
  if (keep_last <= 0) return;
  // The step just committed counts as one of the K kept, and is never a candidate for removal.
  const std::size_t keep_older = static_cast<std::size_t>(keep_last - 1);
  const std::size_t remove_count = older.size() > keep_older ? older.size() - keep_older : 0;
  for (std::size_t i = 0; i < remove_count; ++i) {
    if (keep_every > 0 && older[i].step % keep_every == 0) continue;
    // a step some restore could not read stays for inspection: it may be the history someone
    // needs back once the cause (a node without the filesystem, a bad disk) is fixed
    std::error_code ec;
    if (fs::exists(older[i].path / kRejectedMarker, ec)) continue;
    detail::retire(root, older[i].step, older[i].path);
  }
}

}  // namespace elastrun::ckpt
