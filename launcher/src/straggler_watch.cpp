#include "straggler_watch.hpp"

#include <algorithm>
#include <sstream>

#include <fmt/format.h>

namespace elastrun::launcher {

std::optional<ComputeWindows::Window> ComputeWindows::observe(long step, long compute_us) {
  if (window_steps_ < 1 || step < 0 || compute_us < 0) return std::nullopt;
  if (!start_ || step < start_->first || compute_us < start_->second) {  // the first, or a new worker
    start_ = {step, compute_us};
    return std::nullopt;
  }
  const long steps = step - start_->first;
  if (steps < window_steps_) return std::nullopt;
  Window w{step / window_steps_,
           static_cast<double>(compute_us - start_->second) / 1000.0 / static_cast<double>(steps)};
  start_ = {step, compute_us};
  return w;
}

std::string to_store_value(const NodeCompute& c) { return fmt::format("{} {} {:.6f}", c.index, c.rank, c.compute_ms); }

std::optional<NodeCompute> node_compute_from(const std::string& node, const std::string& value) {
  std::istringstream in(value);
  NodeCompute c;
  c.node = node;
  if (!(in >> c.index >> c.rank >> c.compute_ms) || c.compute_ms < 0) return std::nullopt;
  return c;
}

std::vector<StragglerScore::Named> StragglerScore::score(const std::vector<NodeCompute>& latest,
                                                         const std::vector<std::string>& members) {
  std::vector<const NodeCompute*> window;
  for (const auto& m : members) {
    const auto it = std::find_if(latest.begin(), latest.end(), [&](const NodeCompute& c) { return c.node == m; });
    if (it == latest.end() || it->index <= last_index_) return {};  // not every member has a new window yet
    window.push_back(&*it);
  }
  if (window.empty()) return {};
  long index = window.front()->index;
  std::vector<double> values;
  for (const auto* c : window) {
    index = std::min(index, c->index);
    values.push_back(c->compute_ms);
  }
  last_index_ = index;
  ++scored_;
  std::sort(values.begin(), values.end());
  const auto n = values.size();
  const double median = n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
  std::vector<Named> named;
  ratios_.clear();
  if (median <= 0) return named;  // nothing computed: nothing to compare
  for (const auto* c : window) {
    const double ratio = c->compute_ms / median;
    ratios_[c->node] = ratio;
    int& above = above_[c->node];
    above = ratio > config_.threshold ? above + 1 : 0;
    if (above >= config_.windows && !named_.contains(c->node)) {
      named_.insert(c->node);
      named.push_back({c->node, c->rank, ratio, c->compute_ms, median, above});
    }
  }
  return named;
}

}  // namespace elastrun::launcher
