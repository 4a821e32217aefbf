#include "elastrun/rdzv/hostlist.hpp"

#include "elastrun/rdzv/env.hpp"

#include "elastrun/slurm/api.hpp"

namespace elastrun::rdzv {
namespace {

// libslurm accepts some malformed input ("n[1-" expands to "n]") and logs others to stderr
// itself; a node list we cannot trust must be rejected, quietly, with our own one-line error.
// So bracket ranges are checked before handing the text to libslurm: balanced, not nested, and
// each range "lo" or "lo-hi" with lo <= hi. The expansion itself stays libslurm's.
bool ranges_well_formed(std::string_view text) {
  std::size_t pos = 0;
  while ((pos = text.find_first_of("[]", pos)) != std::string_view::npos) {
    if (text[pos] == ']') return false;
    auto close = text.find(']', pos);
    if (close == std::string_view::npos) return false;
    auto body = text.substr(pos + 1, close - pos - 1);
    if (body.empty() || body.find('[') != std::string_view::npos) return false;
    std::size_t start = 0;
    while (start <= body.size()) {
      auto comma = body.find(',', start);
      auto range = body.substr(start, comma == std::string_view::npos ? body.npos : comma - start);
      auto dash = range.find('-');
      auto lo = range.substr(0, dash);
      auto hi = dash == std::string_view::npos ? lo : range.substr(dash + 1);
      auto digits = [](std::string_view d) {
        return !d.empty() && d.size() < 10 && d.find_first_not_of("0123456789") == d.npos;
      };
      if (!digits(lo) || !digits(hi) || std::stoul(std::string(lo)) > std::stoul(std::string(hi))) return false;
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    pos = close + 1;
  }
  return true;
}

}  // namespace

std::optional<std::vector<std::string>> expand_hostlist(std::string_view expression) {
  const std::string text(expression);
  // libslurm accepts an empty string as an empty list; an empty node list is an error for us.
  if (text.find_first_not_of(" \t,") == std::string::npos) return std::nullopt;
  if (!ranges_well_formed(text)) return std::nullopt;
  if (auto n = hostlist_size(text); !n || *n > kMaxHostlistNodes) return std::nullopt;  // never expand 10^8 names
  return slurm::hostlist_expand(text);
}

std::string compress_hostlist(const std::vector<std::string>& hosts) { return slurm::hostlist_compress(hosts); }

}  // namespace elastrun::rdzv
