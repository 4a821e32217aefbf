// Membership rounds over a KvBackend. Keys (P = "elastrun/<run id>/"):
//   P gen                      current generation (round number), advanced by compare-and-set
//   P closed                   the job is over; value = reason
//   P alive/<member>           liveness, bound to the member's lease (dies with it)
//   P waiting/<member>         a node waiting for the next round (bound to its lease)
//   P r/<gen>/join/<member>    joins of round <gen> (bound to the lease), value = member JSON
//   P r/<gen>/count            join counter: who reached min starts the last call, max closes
//   P r/<gen>/ctl/last_call    wall-clock deadline (ms) after which the round closes
//   P r/<gen>/ctl/roster       the closed round: JSON list of members (written once, by CAS)
//   P r/<gen>/ctl/master       "addr:port" of the workers' process group, from group rank 0
//   P r/<gen>/barrier/<name>   barrier counters
//   P counter/<name>           job-wide counters (restarts)
//   P probe/<gen>              after a local failure: "every agent of round <gen>, answer"
//   P base                     on a store moved to (failover, heal): the generation whose roster
//                              the movers brought along, the quorum's base there
//   elastrun/<run id>.ack/<gen>/<member>   the answers: outside P, so no one is woken by them
// Forming members watch only r/<gen>/ctl/, so N joins cost O(N) wake-ups, not O(N^2).
#include "elastrun/rdzv/rendezvous.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <signal.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <fstream>

#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/store.hpp"
#include "elastrun/util/parse.hpp"

namespace elastrun::rdzv {
namespace {

using Clock = std::chrono::steady_clock;

std::int64_t wall_ms() {
  return std::chrono::duration_cast<Millis>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<std::int64_t> to_i64(std::string_view s) { return util::parse_integer<std::int64_t>(s); }

// Members travel as one tab-separated line each (a roster is one line per member):
//   component  node-index  node-name  address  nproc  role  pid  master-port  store-port
// Parsing a 1024-member roster this way costs microseconds where JSON cost milliseconds, and
// lines are kept short because every member receives the whole roster (the default role is
// written empty).
std::string member_line(const MemberInfo& m) {
  return fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}", m.het_component, m.node_index, m.node_name, m.address,
                     m.nproc, m.role == "default" ? "" : m.role, m.pid, m.master_port, m.store_port);
}

constexpr std::size_t kMemberFields = 9;

std::array<std::string_view, kMemberFields> split_member(std::string_view line) {
  std::array<std::string_view, kMemberFields> f;
  std::size_t n = 0, start = 0;
  while (n < f.size()) {
    auto tab = line.find('\t', start);
    f[n++] = line.substr(start, tab == std::string_view::npos ? std::string_view::npos : tab - start);
    if (tab == std::string_view::npos) break;
    start = tab + 1;
  }
  if (n != f.size()) throw RendezvousError(fmt::format("corrupt member record '{}'", line));
  return f;
}

MemberInfo member_from(std::string_view line) {
  auto f = split_member(line);
  MemberInfo m;
  m.het_component = static_cast<int>(to_i64(f[0]).value_or(0));
  m.node_index = static_cast<int>(to_i64(f[1]).value_or(0));
  m.node_name = std::string(f[2]);
  m.address = std::string(f[3]);
  m.nproc = static_cast<int>(to_i64(f[4]).value_or(1));
  m.role = f[5].empty() ? "default" : std::string(f[5]);
  m.pid = to_i64(f[6]).value_or(0);
  m.master_port = static_cast<std::uint16_t>(to_i64(f[7]).value_or(0));
  m.store_port = static_cast<std::uint16_t>(to_i64(f[8]).value_or(0));
  return m;
}

template <typename F>
void for_each_line(std::string_view text, F&& f) {
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto nl = text.find('\n', pos);
    f(text.substr(pos, nl == std::string_view::npos ? std::string_view::npos : nl - pos));
    if (nl == std::string_view::npos) break;
    pos = nl + 1;
  }
}

// The start of `me`'s roster line: (component, node index, node name). Comparing line prefixes
// skips most members without parsing their numbers; the pid (field 6) completes the identity.
std::string identity_prefix(const MemberInfo& me) {
  return fmt::format("{}\t{}\t{}\t", me.het_component, me.node_index, me.node_name);
}

// The het component at the front of a member key ("0001.0000002.n3.…"), -1 if unreadable.
int component_of_key(std::string_view member_key) {
  auto dot = member_key.find('.');
  return static_cast<int>(to_i64(member_key.substr(0, dot)).value_or(-1));
}

// A member on this host (its address is ours or loopback) whose agent process no longer exists
// is gone for certain: the kernel says so, no network can hide it.
bool process_gone_here(const MemberInfo& m, const MemberInfo& me) {
  if (m.pid <= 0 || m.pid == me.pid) return false;
  const bool here =
      m.address == me.address || m.address.starts_with("127.") || m.address == "::1" || m.address == "localhost";
  if (!here) return false;
  if (::kill(static_cast<pid_t>(m.pid), 0) != 0) return errno == ESRCH;
  // A zombie is gone too: killed with its parent (a node crash takes slurmstepd along), it waits
  // to be reaped by whoever adopted it, which may take long. The state follows the last ')'.
  std::ifstream stat(fmt::format("/proc/{}/stat", m.pid));
  std::string line;
  std::getline(stat, line);
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// Rounds that never formed (waits without quorum) leave gaps in the generations: this many are
// looked at below a round for the one before it.
constexpr std::uint64_t kBaseScan = 64;

}  // namespace

QuorumVerdict decide_quorum(const std::vector<MemberInfo>& base, const std::function<bool(const MemberInfo&)>& joined,
                            const std::function<bool(const MemberInfo&)>& gone) {
  QuorumVerdict v;
  v.members = static_cast<int>(base.size());
  std::vector<const MemberInfo*> absent;
  for (const auto& m : base)
    if (joined(m))
      ++v.present;
    else
      absent.push_back(&m);
  if (base.empty() || 2 * v.present > v.members) return v;
  for (const auto* m : absent)
    if (!gone(*m)) v.unreachable.push_back(m->node_name);
  v.ok = v.unreachable.empty();
  return v;
}

std::string_view to_string(Change change) {
  switch (change) {
    case Change::None: return "none";
    case Change::MemberLost: return "member lost";
    case Change::MemberWaiting: return "member waiting (scale up)";
    case Change::Reform: return "new round requested";
    case Change::Fenced: return "fenced (declared dead)";
    case Change::Closed: return "closed";
    case Change::StoreLost: return "store lost";
  }
  return "unknown";
}

std::string MemberInfo::sort_key() const {
  return fmt::format("{:04d}.{:07d}.{}.{:010d}", het_component, node_index, node_name, pid);
}

RendezvousClosed::RendezvousClosed(const std::string& run_id, std::string reason)
    : RendezvousError(fmt::format("rendezvous '{}' is closed: {}", run_id, reason)), reason_(std::move(reason)) {}

Rendezvous::Rendezvous(std::unique_ptr<KvBackend> kv, std::unique_ptr<KvBackend> heartbeat_kv, RendezvousConfig config,
                       MemberInfo me, StoreConnector connector)
    : kv_(std::move(kv)),
      heartbeat_kv_(std::move(heartbeat_kv)),
      config_(std::move(config)),
      me_(std::move(me)),
      prefix_("elastrun/" + config_.run_id + "/"),
      my_key_(me_.sort_key()) {
  connector_ = std::move(connector);
  if (config_.min_nodes < 1 || config_.max_nodes < config_.min_nodes)
    throw RendezvousError(fmt::format("--nnodes={}:{} is not a valid MIN:MAX (need 1 <= MIN <= MAX)", config_.min_nodes,
                                      config_.max_nodes));
  for (const auto& b : config_.component_bounds)
    if (b.min < 1 || b.max < b.min)
      throw RendezvousError(
          fmt::format("--het-nnodes: {}:{} is not a valid MIN:MAX (need 1 <= MIN <= MAX)", b.min, b.max));
  if (!config_.component_bounds.empty() &&
      (me_.het_component < 0 || me_.het_component >= static_cast<int>(config_.component_bounds.size())))
    throw RendezvousError(fmt::format("--het-nnodes gives bounds for {} component(s) but this agent is in component {}",
                                      config_.component_bounds.size(), me_.het_component));
  if (config_.partition_timeout <= Millis(0)) config_.partition_timeout = config_.join_timeout;
  store_address_ = config_.primary_address;
  heartbeat_kv_->set_reply_timeout(keep_alive_patience());
  ensure_alive();
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

Rendezvous::~Rendezvous() {
  {
    std::lock_guard lock(stop_mutex_);
    stop_ = true;
  }
  stop_cv_.notify_all();
  if (heartbeat_.joinable()) heartbeat_.join();
  try {
    std::lock_guard lock(heartbeat_mutex_);
    if (lease_ && !fenced_) heartbeat_kv_->revoke_lease(lease_);  // leave at once, not after a timeout
  } catch (const std::exception&) {
    // the store may be gone already; the lease then dies with our connection
  }
}

void Rendezvous::heartbeat_loop() {
  const auto interval = std::max(Millis(10), config_.heartbeat_timeout / 4);
  while (true) {
    {
      // Sleep a whole interval (1024 members in one process must not wake every few ms), but
      // wake at once when the destructor asks us to stop.
      std::unique_lock wait_lock(stop_mutex_);
      if (stop_cv_.wait_for(wait_lock, interval, [this] { return stop_.load(); })) break;
    }
    std::lock_guard lock(heartbeat_mutex_);
    try {
      if (lease_ && !fenced_ && !store_lost_ && !heartbeat_kv_->keep_alive(lease_)) {
        spdlog::warn("[rdzv] our lease {} is gone: the others declared this node dead", lease_);
        fenced_ = true;
      }
    } catch (const StoreError& e) {
      if (e.kind() == StoreErrorKind::ConnectionLost) {
        if (!store_lost_)
          spdlog::warn(
              "[rdzv] heartbeat: {}: the store is unreachable from this node; stopping work before the others "
              "can declare it dead",
              e.what());
        store_lost_ = true;
        // Fence on our own clock: a call of the main thread blocked on the protocol connection
        // fails now, not after its own reply timeout, so the agent stops its workers within
        // about 3/4 of the heartbeat timeout of its last renewal (docs/rendezvous.md).
        kv_->interrupt();
      } else {
        spdlog::warn("[rdzv] heartbeat failed: {}", e.what());
        fenced_ = true;
      }
    } catch (const std::exception& e) {
      spdlog::warn("[rdzv] heartbeat failed: {}", e.what());
      fenced_ = true;
    }
  }
}

void Rendezvous::ensure_alive() {
  std::lock_guard lock(heartbeat_mutex_);
  if (lease_ && !fenced_) return;
  lease_ = heartbeat_kv_->grant_lease(config_.heartbeat_timeout, me_.node_name);
  fenced_ = false;
  kv_->set(prefix_ + "alive/" + my_key_, member_line(me_), lease_);
}

std::uint64_t Rendezvous::current_generation() {
  const auto key = prefix_ + "gen";
  if (auto kv = kv_->get(key)) return static_cast<std::uint64_t>(to_i64(kv->value).value_or(1));
  std::optional<std::string> current;
  if (kv_->compare_and_set(key, std::nullopt, "1", 0, &current)) return 1;
  return static_cast<std::uint64_t>(to_i64(current.value_or("1")).value_or(1));
}

bool Rendezvous::advance_generation(std::uint64_t from) {
  return kv_->compare_and_set(prefix_ + "gen", std::to_string(from), std::to_string(from + 1));
}

const RoundResult& Rendezvous::next_round() {
  join_deadline_ = Clock::now() + config_.join_timeout;
  std::uint64_t gen = 0;
  while (true) {
    try {
      if (store_lost_) fail_over();
      if (auto closed = kv_->get(prefix_ + "closed")) throw RendezvousClosed(config_.run_id, closed->value);
      ensure_alive();
      gen = current_generation();
      // A generation we already ran is over: move everyone to the next one.
      if (gen <= round_.generation) {
        advance_generation(gen);
        continue;
      }
      if (auto result = try_form(gen)) {
        round_ = std::move(*result);
        failed_over_ = false;
        if (no_quorum_since_) {
          QuorumVerdict v;
          v.members = v.present = round_.group_world_size;
          tell_quorum_wait(false, v);
          no_quorum_since_.reset();
        }
        return round_;
      }
    } catch (const StoreError& e) {
      if (e.kind() == StoreErrorKind::NoSuchLease) {
        // Our lease died while we were not looking: we are fenced; rejoin as a new member.
        fenced_ = true;
      } else if (e.kind() == StoreErrorKind::ConnectionLost && connector_ &&
                 (round_.generation > 0 || !standbys_.empty())) {
        spdlog::warn("[rdzv] {}", e.what());
        store_lost_ = true;
      } else {
        throw;
      }
    }
    if (Clock::now() > join_deadline_ && !no_quorum_since_)  // without quorum: --partition-timeout
      throw RendezvousError(
          fmt::format("only some of the required {} nodes joined round {} within {} s (--rdzv-conf join_timeout)",
                      config_.min_nodes, gen, config_.join_timeout.count() / 1000));
  }
}

// Joins round `gen`; returns its result if we are in it, std::nullopt if the round closed
// without us (we then waited for the next generation) or the generation moved on.
// Costs about six requests per member and no per-join wake-ups of the others.
std::optional<RoundResult> Rendezvous::try_form(std::uint64_t gen) {
  const auto round = fmt::format("{}r/{}/", prefix_, gen);
  const auto ctl = round + "ctl/";
  const auto roster_key = ctl + "roster";
  // Each member reserves a port for the workers' process group when it joins; the port of
  // whoever becomes group rank 0 is the round's MASTER_PORT (never a fixed 29500).
  me_.master_port = listen_tcp("0.0.0.0", 0).port;
  kv_->set(round + "join/" + my_key_, member_line(me_), lease_);
  auto joined = kv_->add(round + "count", 1);
  // A re-form (we were in a round before) closes as soon as every live agent of the job is in:
  // the last call is for members that may still come, and after a loss none will. Only the last
  // few joiners look (each look reads every live member's key: O(N) per look).
  constexpr int kQuickFormLooks = 8;
  // Not on a standby store we just moved to: the survivors that have not moved yet are not
  // in its alive/ list, and would be left out.
  const bool may_be_last = round_.generation > 0 && !failed_over_ && joined + kQuickFormLooks > round_.group_world_size;
  if (joined >= config_.max_nodes)
    try_close(gen);
  else if (joined >= config_.min_nodes && may_be_last && every_live_agent_joined(gen) && try_close(gen))
    spdlog::debug("[rdzv] round {}: every live agent joined; formed without the last call", gen);
  else if (joined >= config_.min_nodes)
    kv_->compare_and_set(ctl + "last_call", std::nullopt,
                         std::to_string(wall_ms() + config_.last_call_timeout.count()));

  const auto join_deadline = Clock::now() + config_.join_timeout;
  std::uint64_t rev = 0;
  std::optional<std::string> roster, last_call;
  auto control = kv_->get_prefix(ctl, &rev);
  for (auto& kv : control) {
    if (kv.key == roster_key) roster = std::move(kv.value);
    if (kv.key == ctl + "last_call") last_call = std::move(kv.value);
  }
  while (true) {
    if (roster) {
      if (auto result = finish_round(gen, std::move(*roster), rev)) return result;
      kv_->remove(round + "join/" + my_key_);
      wait_as_late_joiner(gen);
      // however long we waited as a spare, the next round gets a whole join timeout
      join_deadline_ = Clock::now() + config_.join_timeout;
      return std::nullopt;
    }
    if (fenced_) return std::nullopt;
    // without quorum the wait is --partition-timeout's (try_close), and other stores are probed
    Millis wait = no_quorum_since_ ? Millis(1000)
                                   : std::chrono::ceil<Millis>(std::max(join_deadline, join_deadline_) - Clock::now());
    bool idle_check = false;
    if (last_call) {
      auto left = to_i64(*last_call).value_or(0) - wall_ms();
      if (left <= 0) {
        if (try_close(gen)) {
          if (auto r = kv_->get(roster_key)) roster = r->value, rev = std::max(rev, r->revision);
          continue;
        }
        last_call.reset();  // too few live members now: wait for more joins
        wait = Millis(200);
      } else {
        wait = Millis(left);
      }
    } else {
      wait = std::min(wait, Millis(1000));
      idle_check = true;
    }
    if (wait <= Millis(0)) return std::nullopt;  // join timeout; next_round() reports it
    auto events = kv_->watch(ctl, rev, wait, &rev);
    for (auto& e : events) {
      if (e.key == roster_key && e.type == WatchEvent::Type::Put) roster = std::move(e.value);
      if (e.key == ctl + "last_call")
        last_call = e.type == WatchEvent::Type::Put ? std::optional<std::string>(std::move(e.value)) : std::nullopt;
    }
    if (events.empty() && idle_check) {
      // Nothing for a while: has the generation moved on, or did the member that reached
      // min die before starting the last call? (try_close checks who is really alive.)
      if (current_generation() != gen) return std::nullopt;
      // Fewer than MIN here never reach try_close: a node cut off alone must still say so, probe
      // for the job and give up after --partition-timeout.
      if (round_.generation > 0) quorum_for(gen, kv_->get_prefix(round + "join/"));
      if (no_quorum_since_ && Clock::now() >= next_probe_ && move_if_the_job_is_elsewhere()) return std::nullopt;
      auto count = kv_->get(round + "count");
      if (count && to_i64(count->value).value_or(0) >= config_.min_nodes)
        kv_->compare_and_set(ctl + "last_call", std::nullopt,
                             std::to_string(wall_ms() + config_.last_call_timeout.count()));
      if (auto r = kv_->get(roster_key)) roster = r->value;
      if (auto lc = kv_->get(ctl + "last_call")) last_call = lc->value;
    }
  }
}

bool Rendezvous::every_live_agent_joined(std::uint64_t gen) {
  const auto round = fmt::format("{}r/{}/", prefix_, gen);
  const auto live = prefix_ + "alive/";
  auto joins = kv_->get_prefix(round + "join/");
  std::vector<std::string_view> joined;
  joined.reserve(joins.size());
  for (const auto& kv : joins) joined.push_back(std::string_view(kv.key).substr(round.size() + 5));
  std::sort(joined.begin(), joined.end());
  // a member whose lease still runs but has not joined (lost, not yet
  // expired) or a spare not yet in makes this false, and the last call waits for them
  for (const auto& kv : kv_->get_prefix(live))
    if (!std::binary_search(joined.begin(), joined.end(), std::string_view(kv.key).substr(live.size()))) return false;
  return true;
}

bool Rendezvous::try_close(std::uint64_t gen) {
  const auto round = fmt::format("{}r/{}/", prefix_, gen);
  auto joins = kv_->get_prefix(round + "join/");  // only live members: dead ones' keys are gone
  if (static_cast<int>(joins.size()) < config_.min_nodes) {
    kv_->remove(round + "ctl/last_call");
    return false;
  }
  std::string roster;
  int taken = 0;
  const auto& bounds = config_.component_bounds;
  std::vector<int> per_component(bounds.size(), 0);
  for (const auto& kv : joins) {
    if (taken == config_.max_nodes) break;
    if (!bounds.empty()) {
      // join keys sort by component first (MemberInfo::sort_key), so each component's first
      // MAX joiners are taken and the others wait as its spares
      const int c = component_of_key(std::string_view(kv.key).substr(round.size() + 5));
      if (c < 0 || c >= static_cast<int>(bounds.size()) || per_component[c] == bounds[c].max) continue;
      ++per_component[c];
    }
    ++taken;
    if (!roster.empty()) roster += '\n';
    roster += kv.value;
  }
  for (std::size_t c = 0; c < bounds.size(); ++c)
    if (per_component[c] < bounds[c].min) {
      // a component below its MIN: no round yet (the job-wide count may well be enough)
      kv_->remove(round + "ctl/last_call");
      return false;
    }
  if (!quorum_for(gen, joins)) {
    kv_->remove(round + "ctl/last_call");
    return false;
  }
  kv_->compare_and_set(round + "ctl/roster", std::nullopt, roster);
  return true;  // closed by us or by someone else
}

void Rendezvous::wait_as_late_joiner(std::uint64_t gen) {
  // The round closed without us: wait in the wait list; running members see us and re-form.
  const auto waiting = prefix_ + "waiting/" + my_key_;
  kv_->set(waiting, member_line(me_), lease_);
  spdlog::info("[rdzv] round {} is running without this node; waiting for the next round", gen);
  // The running round's members are our failover candidates should the store's host die.
  if (auto roster = kv_->get(fmt::format("{}r/{}/ctl/roster", prefix_, gen))) {
    standbys_.clear();
    for_each_line(roster->value, [&](std::string_view line) { standbys_.push_back(member_from(line)); });
  }
  std::uint64_t rev = 0;
  kv_->get_prefix(prefix_ + "gen", &rev);
  while (!fenced_ && !store_lost_) {
    auto gen_kv = kv_->get(prefix_ + "gen");
    if (!gen_kv || to_i64(gen_kv->value).value_or(0) != static_cast<std::int64_t>(gen)) break;
    if (kv_->get(prefix_ + "closed")) break;
    kv_->watch(prefix_, rev, Millis(1000), &rev);  // any change: look at gen and closed again
  }
  kv_->remove(waiting);
}

std::optional<RoundResult> Rendezvous::finish_round(std::uint64_t gen, std::string roster, std::uint64_t revision) {
  RoundResult r;
  r.generation = gen;
  // One pass over the lines, fields as views: no per-member allocation. Every member parses
  // the whole roster, so this is O(N) per member and O(N^2) for a simulated job.
  const std::string_view my_role = me_.role == "default" ? std::string_view() : std::string_view(me_.role);
  const std::string me = identity_prefix(me_);
  const std::string my_pid = std::to_string(me_.pid);
  bool found = false;
  for_each_line(roster, [&](std::string_view line) {
    auto f = split_member(line);
    const int nproc = static_cast<int>(to_i64(f[4]).value_or(1));
    if (r.group_world_size == 0) {
      r.master_addr = std::string(f[3]);
      r.master_port = static_cast<std::uint16_t>(to_i64(f[7]).value_or(0));
    }
    if (!found && line.starts_with(me) && f[6] == my_pid) {
      found = true;
      r.group_rank = r.group_world_size;
      r.rank_offset = r.world_size;
      r.role_rank_offset = r.role_world_size;
    }
    ++r.group_world_size;
    r.world_size += nproc;
    if (f[5] == my_role) r.role_world_size += nproc;
  });
  if (!found) return std::nullopt;  // the round closed without us
  r.roster = std::move(roster);
  // Changes after the roster concern the running round.
  watch_revision_ = revision;
  spdlog::info("[rdzv] round {} complete: {} nodes, {} workers, this node is group rank {}", gen, r.group_world_size,
               r.world_size, r.group_rank);
  return r;
}

const std::vector<MemberInfo>& RoundResult::members() const {
  if (!parsed_members_) {
    std::vector<MemberInfo> out;
    for_each_line(roster, [&](std::string_view line) { out.push_back(member_from(line)); });
    parsed_members_ = std::move(out);
  }
  return *parsed_members_;
}

// The store is gone (its host died, or this node is cut off from it). Every member of the last
// round runs a standby store; the survivors all try the members' standbys in round order and
// meet at the first that answers (the lowest surviving member's, the same for everyone), where
// the next round rebuilds the state. Generations continue from the last one so fencing stays
// monotonic, and the last round's roster comes along: the next round there needs a quorum of it
// (a node cut off alone reaches only its own standby, and waits there).
void Rendezvous::fail_over() {
  if (!connector_) throw RendezvousError("the rendezvous store is lost and no standby is configured");
  failed_over_ = true;
  const auto deadline = Clock::now() + std::max(config_.heartbeat_timeout * 4, Millis(10000));
  std::string last_error = "no member of the last round runs a standby store";
  while (Clock::now() < deadline) {
    // The last round's members, or (in the wait list) those of the round we waited for.
    for (const auto& m : round_.generation == 0 ? standbys_ : round_.members()) {
      if (m.store_port == 0) continue;
      try {
        auto kv = connector_(m.address, m.store_port);
        auto hb = connector_(m.address, m.store_port);
        switch_store(std::move(kv), std::move(hb), m.node_name, m.address, m.store_port);
        spdlog::warn("[rdzv] failed over to the standby store of {} ({}:{})", m.node_name, m.address, m.store_port);
        return;
      } catch (const StoreError& e) {
        last_error = e.what();
      }
    }
    std::this_thread::sleep_for(Millis(100));
  }
  throw RendezvousError(fmt::format("the rendezvous store is lost and no standby answered: {}", last_error));
}

void Rendezvous::switch_store(std::unique_ptr<KvBackend> kv, std::unique_ptr<KvBackend> hb, const std::string& node,
                              const std::string& address, std::uint16_t port) {
  hb->set_reply_timeout(keep_alive_patience());
  {
    std::lock_guard lock(heartbeat_mutex_);
    kv_ = std::move(kv);
    heartbeat_kv_ = std::move(hb);
    lease_ = 0;
    fenced_ = false;
    store_lost_ = false;
  }
  store_node_ = node;
  store_address_ = address;
  store_port_ = port;
  seed_base();
  kv_->compare_and_set(prefix_ + "gen", std::nullopt, std::to_string(round_.generation + 1));
}

void Rendezvous::seed_base() {
  if (round_.generation == 0) return;  // never in a round: nothing to bring
  const auto gen = std::to_string(round_.generation);
  kv_->compare_and_set(fmt::format("{}r/{}/ctl/roster", prefix_, round_.generation), std::nullopt, round_.roster);
  // the newest base wins: movers from different rounds may arrive in any order
  std::optional<std::string> current;
  while (!kv_->compare_and_set(prefix_ + "base", current, gen, 0, &current))
    if (!current || to_i64(*current).value_or(0) >= static_cast<std::int64_t>(round_.generation)) break;
}

std::uint64_t Rendezvous::latest_formed(KvBackend& kv, std::uint64_t from) {
  const auto floor_kv = kv.get(prefix_ + "base");
  const std::uint64_t floor = floor_kv ? static_cast<std::uint64_t>(to_i64(floor_kv->value).value_or(0)) : 0;
  for (std::uint64_t g = from, looked = 0; g >= 1 && g >= floor && looked < kBaseScan; --g, ++looked)
    if (kv.get(fmt::format("{}r/{}/ctl/roster", prefix_, g))) return g;
  return floor <= from ? floor : 0;
}

bool Rendezvous::gone(const MemberInfo& m) {
  const auto key = m.sort_key();
  if (std::find(gone_.begin(), gone_.end(), key) != gone_.end()) return true;
  if (!process_gone_here(m, me_) && !(config_.confirmed_gone && config_.confirmed_gone(m))) return false;
  gone_.push_back(key);
  return true;
}

bool Rendezvous::quorum_for(std::uint64_t gen, const std::vector<KeyValue>& joins) {
  const auto base_gen = latest_formed(*kv_, gen - 1);
  if (base_gen == 0) return true;  // the first round: --nnodes MIN decides alone
  auto base = kv_->get(fmt::format("{}r/{}/ctl/roster", prefix_, base_gen));
  if (!base) return true;
  std::vector<MemberInfo> members;
  for_each_line(base->value, [&](std::string_view line) { members.push_back(member_from(line)); });
  const auto round = fmt::format("{}r/{}/join/", prefix_, gen);
  std::vector<std::string_view> joined;
  for (const auto& kv : joins) joined.push_back(std::string_view(kv.key).substr(round.size()));
  std::sort(joined.begin(), joined.end());
  auto verdict = decide_quorum(
      members, [&](const MemberInfo& m) { return std::binary_search(joined.begin(), joined.end(), m.sort_key()); },
      [&](const MemberInfo& m) { return gone(m); });
  if (verdict.ok) {
    // A majority again, or the others confirmed gone: from here --rdzv-conf join_timeout applies
    // afresh (a lone survivor below --nnodes MIN then fails with "only some ... joined": class
    // node; after a heal the others have that long to come back).
    if (no_quorum_since_) {
      tell_quorum_wait(false, verdict);
      no_quorum_since_.reset();
      join_deadline_ = Clock::now() + config_.join_timeout;
    }
    return true;
  }
  if (!no_quorum_since_) {
    // Absent members still alive on this store (their leases live) are on their way -- still
    // stopping their workers after the re-form was called -- not cut off: wait for them without a
    // word and without the partition timer. One cut off from this store loses its lease within a
    // heartbeat timeout and then counts as unreachable.
    const auto alive_prefix = prefix_ + "alive/";
    std::vector<std::string> alive;
    for (const auto& kv : kv_->get_prefix(alive_prefix)) alive.push_back(kv.key.substr(alive_prefix.size()));
    std::sort(alive.begin(), alive.end());
    const bool all_coming = std::all_of(members.begin(), members.end(), [&](const MemberInfo& m) {
      const auto key = m.sort_key();
      return std::binary_search(joined.begin(), joined.end(), key) || gone(m) ||
             std::binary_search(alive.begin(), alive.end(), key);
    });
    if (all_coming) return false;
  }
  const auto now = Clock::now();
  if (!no_quorum_since_) {
    no_quorum_since_ = now;
    next_probe_ = now + Millis(2000);
  }
  if (verdict.unreachable != told_unreachable_) tell_quorum_wait(true, verdict);
  if (now - *no_quorum_since_ > config_.partition_timeout)
    throw NoQuorum(
        fmt::format("partitioned from {} of {} members ({}) for {} s; no quorum; giving up (--partition-timeout)",
                    verdict.unreachable.size(), verdict.members, fmt::join(verdict.unreachable, ", "),
                    std::chrono::duration_cast<std::chrono::seconds>(now - *no_quorum_since_).count()));
  return false;
}

void Rendezvous::tell_quorum_wait(bool waiting, const QuorumVerdict& v) {
  QuorumWait w{
      .waiting = waiting,
      .members = v.members,
      .present = v.present,
      .unreachable = v.unreachable,
      .store_node = store_node_,
      .waited_ms = no_quorum_since_ ? std::chrono::duration_cast<Millis>(Clock::now() - *no_quorum_since_).count() : 0};
  if (waiting)
    spdlog::warn("[rdzv] partitioned from {} of {} members ({}); no quorum; waiting", v.unreachable.size(), v.members,
                 fmt::join(v.unreachable, ", "));
  else
    spdlog::info("[rdzv] quorum again after {} ms: {} of {} members here{}", w.waited_ms, v.present, v.members,
                 2 * v.present > v.members ? "" : ", the others gone");
  told_unreachable_ = waiting ? v.unreachable : std::vector<std::string>{};
  if (config_.on_quorum_wait) config_.on_quorum_wait(w);
}

// While this side has no quorum: is the job going on elsewhere, or has the partition healed?
// The candidates are the first store and the standbys of our last round's members, in that
// order. A store whose newest round is newer than ours holds the job (a majority formed it
// there): move there and rejoin. Else the most preferred store that answers, if it comes
// before ours: after a heal both halves of a symmetric split meet there.
bool Rendezvous::move_if_the_job_is_elsewhere() {
  next_probe_ = Clock::now() + std::max(Millis(2000), config_.heartbeat_timeout);
  if (!connector_) return false;
  struct Candidate {
    std::string node, address;
    std::uint16_t port;
  };
  std::vector<Candidate> candidates;
  if (config_.primary_port) candidates.push_back({"", config_.primary_address, config_.primary_port});
  for (const auto& m : round_.generation == 0 ? standbys_ : round_.members())
    if (m.store_port) candidates.push_back({m.node_name, m.address, m.store_port});
  const auto current_port = store_port_ ? store_port_ : config_.primary_port;
  const auto is_current = [&](const Candidate& c) { return c.address == store_address_ && c.port == current_port; };
  // the store host's member line names the first store itself: one candidate per endpoint
  std::vector<Candidate> unique;
  for (auto& c : candidates)
    if (std::none_of(unique.begin(), unique.end(),
                     [&](const Candidate& u) { return u.address == c.address && u.port == c.port; }))
      unique.push_back(std::move(c));
  candidates = std::move(unique);
  std::size_t current_index = candidates.size();
  for (std::size_t i = 0; i < candidates.size(); ++i)
    if (is_current(candidates[i])) current_index = i;
  const auto ours = latest_formed(*kv_, current_generation());
  std::optional<std::size_t> best;
  std::uint64_t best_formed = ours;
  std::unique_ptr<KvBackend> best_kv;
  for (std::size_t i = 0; i < candidates.size(); ++i) {
    if (i == current_index) continue;
    try {
      auto kv = connector_(candidates[i].address, candidates[i].port);
      const auto gen_kv = kv->get(prefix_ + "gen");
      if (!gen_kv) continue;  // a standby nobody moved to
      const auto formed = latest_formed(*kv, static_cast<std::uint64_t>(to_i64(gen_kv->value).value_or(0)));
      if (formed > best_formed || (formed == best_formed && !best && i < current_index)) {
        best = i;
        best_formed = formed;
        best_kv = std::move(kv);
      }
    } catch (const StoreError&) {
      // unreachable (still cut off) or gone: not a candidate now
    }
  }
  if (!best) return false;
  const auto& c = candidates[*best];
  try {
    auto hb = connector_(c.address, c.port);
    spdlog::warn("[rdzv] the job is reachable again at the store of {} ({}:{}, newest round {}); moving there",
                 c.node.empty() ? "the first node" : c.node, c.address, c.port, best_formed);
    switch_store(std::move(best_kv), std::move(hb), c.node, c.address, c.port);
    failed_over_ = true;
    return true;
  } catch (const StoreError& e) {
    spdlog::warn("[rdzv] moving to the store at {}:{}: {}", c.address, c.port, e.what());
    return false;
  }
}

bool Rendezvous::reconnect_to_the_same_store() {
  if (!store_lost_ || !connector_ || round_.generation == 0) return false;
  const auto address = store_port_ ? store_address_ : config_.primary_address;
  const auto port = store_port_ ? store_port_ : config_.primary_port;
  if (address.empty() || port == 0) return false;
  // A link that flaps: try again while the cut may last, for up to a heartbeat timeout (by then
  // the others have declared this node dead, and the failover's probing finds the job again after
  // a heal). One attempt is about a second whatever happens (the connector's connect timeout, then
  // the keep-alive patience for the reply), so a link cut again cannot hold the agent here. A
  // refusal ends it at once: nothing listens there (the store's host or agent is gone), or the
  // store is not the job's any more.
  constexpr Millis kPause{100};
  const auto deadline = Clock::now() + config_.heartbeat_timeout;
  for (int attempt = 1;; ++attempt) {
    try {
      auto kv = connector_(address, port);
      kv->set_reply_timeout(keep_alive_patience());
      if (!kv->get(prefix_ + "gen")) return false;  // not the job's store any more: fail over as usual
      auto hb = connector_(address, port);
      switch_store(std::move(kv), std::move(hb), store_node_, address, port);
      ensure_alive();
      kv_->set_reply_timeout(kStoreReplyTimeout);  // back to the protocol connection's own
      spdlog::warn("[rdzv] reconnected to the store at {}:{} with a new lease{}", address, port,
                   attempt > 1 ? fmt::format(" (attempt {})", attempt) : std::string());
      return true;
    } catch (const StoreError& e) {
      store_lost_ = true;
      const bool may_come_back =
          (e.kind() == StoreErrorKind::ConnectionLost && !e.refused()) || e.kind() == StoreErrorKind::Timeout;
      if (!may_come_back || Clock::now() + kPause >= deadline) {
        spdlog::info("[rdzv] the store at {}:{} does not answer ({}; {} attempt(s)): failing over", address, port,
                     e.what(), attempt);
        return false;
      }
      std::this_thread::sleep_for(kPause);
    }
  }
}

Change Rendezvous::wait_for_change(Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (fenced_) return Change::Fenced;
    if (store_lost_) return Change::StoreLost;
    auto left = std::chrono::ceil<Millis>(deadline - Clock::now());
    if (left <= Millis(0)) return Change::None;
    std::uint64_t rev = 0;
    std::vector<WatchEvent> events;
    try {
      events = kv_->watch(prefix_, watch_revision_, std::min(left, Millis(500)), &rev);
    } catch (const StoreError& e) {
      if (e.kind() == StoreErrorKind::ConnectionLost && connector_) {
        spdlog::warn("[rdzv] {}", e.what());
        store_lost_ = true;
        return Change::StoreLost;
      }
      // History we missed (compacted) or a store hiccup: re-forming is always safe.
      spdlog::warn("[rdzv] watching the round failed ({}); re-forming", e.what());
      return Change::Reform;
    }
    for (const auto& e : events) {
      watch_revision_ = std::max(watch_revision_, e.revision);
      std::string_view key(e.key);
      key.remove_prefix(prefix_.size());
      if (key == "closed" && e.type == WatchEvent::Type::Put) return Change::Closed;
      if (key == "gen" && e.type == WatchEvent::Type::Put &&
          to_i64(e.value).value_or(0) != static_cast<std::int64_t>(round_.generation))
        return Change::Reform;
      if (key.starts_with("alive/") && e.type == WatchEvent::Type::Delete) {
        auto who = key.substr(6);
        if (who == my_key_) {
          spdlog::warn("[rdzv] the others declared this node dead (missed heartbeats)");
          fenced_ = true;
          return Change::Fenced;
        }
        for (const auto& m : round_.members())
          if (m.sort_key() == who) {
            spdlog::warn("[rdzv] member {} (node {}) lost", who, m.node_name);
            last_loss_ = MemberLoss{m.node_name, {}, std::nullopt};
            // the embedded store says how the lease ended (store_server.cpp, revoke)
            auto j = nlohmann::json::parse(e.value, nullptr, /*allow_exceptions=*/false);
            if (j.is_object()) {
              last_loss_->how = j.value("lease_end", std::string());
              if (auto it = j.find("since_renewal_ms"); it != j.end() && it->is_number_integer())
                last_loss_->since_heartbeat_ms = it->get<std::int64_t>();
            }
            return Change::MemberLost;
          }
      }
      if (key.starts_with("probe/") && e.type == WatchEvent::Type::Put &&
          to_i64(key.substr(6)).value_or(-1) == static_cast<std::int64_t>(round_.generation))
        answer_probe(round_.generation);
      if (key.starts_with("waiting/") && e.type == WatchEvent::Type::Put &&
          round_.group_world_size < config_.max_nodes && component_has_room(component_of_key(key.substr(8))))
        return Change::MemberWaiting;
    }
  }
}

bool Rendezvous::component_has_room(int component) const {
  const auto& bounds = config_.component_bounds;
  if (bounds.empty()) return true;
  if (component < 0 || component >= static_cast<int>(bounds.size())) return false;
  int members = 0;
  for (const auto& m : round_.members()) members += m.het_component == component;
  return members < bounds[component].max;
}

std::string Rendezvous::answers_prefix(std::uint64_t gen) const {
  return fmt::format("elastrun/{}.ack/{}/", config_.run_id, gen);
}

void Rendezvous::answer_probe(std::uint64_t gen) {
  try {
    kv_->set(answers_prefix(gen) + my_key_, "1", lease_);
  } catch (const StoreError& e) {
    // unanswered, we count as lost for the asker: the same as the store losing us
    spdlog::warn("[rdzv] answering a liveness probe of round {}: {}", gen, e.what());
    if (e.kind() == StoreErrorKind::ConnectionLost && connector_) store_lost_ = true;
  }
}

Rendezvous::Confirmation Rendezvous::confirm_members(Millis timeout) {
  Confirmation out;
  const auto& members = round_.members();
  if (members.size() <= 1) return out;
  const auto gen = round_.generation;
  const auto answers = answers_prefix(gen);
  const auto deadline = Clock::now() + timeout;
  try {
    // one probe per round, whoever asks first; later askers read the same answers
    kv_->compare_and_set(prefix_ + "probe/" + std::to_string(gen), std::nullopt, std::to_string(wall_ms()));
    answer_probe(gen);
    while (true) {
      std::vector<std::string> answered;
      for (auto& kv : kv_->get_prefix(answers)) answered.push_back(std::move(kv.key));
      std::sort(answered.begin(), answered.end());
      out.unconfirmed.clear();
      for (const auto& m : members)
        if (!std::binary_search(answered.begin(), answered.end(), answers + m.sort_key()))
          out.unconfirmed.push_back(m.node_name);
      const auto left = std::chrono::ceil<Millis>(deadline - Clock::now());
      if (out.unconfirmed.empty() || left <= Millis(0)) return out;
      // answers the others' probes too, and sees a loss the store reports meanwhile
      out.change = wait_for_change(std::min(left, Millis(100)));
      if (out.change != Change::None && out.change != Change::MemberWaiting) {
        out.unconfirmed.clear();
        return out;
      }
      out.change = Change::None;
    }
  } catch (const StoreError& e) {
    if (e.kind() != StoreErrorKind::ConnectionLost || !connector_) throw;
    spdlog::warn("[rdzv] {}", e.what());
    store_lost_ = true;
    out.change = Change::StoreLost;
    out.unconfirmed.clear();
    return out;
  }
}

void Rendezvous::request_new_round() { advance_generation(round_.generation); }

void Rendezvous::close(std::string_view reason) { kv_->compare_and_set(prefix_ + "closed", std::nullopt, reason); }

std::int64_t Rendezvous::add_to_counter(std::string_view name, std::int64_t delta) {
  return kv_->add(prefix_ + "counter/" + std::string(name), delta);
}

bool Rendezvous::barrier(std::string_view name, Millis timeout) {
  const auto key = fmt::format("{}r/{}/barrier/{}", prefix_, round_.generation, name);
  kv_->add(key, 1);
  const auto deadline = Clock::now() + timeout;
  std::uint64_t rev = 0;
  while (true) {
    auto kvs = kv_->get_prefix(key, &rev);
    if (!kvs.empty() && to_i64(kvs.front().value).value_or(0) >= round_.group_world_size) return true;
    auto left = std::chrono::ceil<Millis>(deadline - Clock::now());
    if (left <= Millis(0)) return false;
    kv_->watch(key, rev, left);
  }
}

// ---- fenced commits ----------------------------------------------------------------------------

CommitFence Rendezvous::commit_fence(std::uint64_t requeues) const {
  CommitFence f;
  f.store_address = store_port_ ? store_address_ : std::string();
  f.store_port = store_port_;
  f.prefix = prefix_;
  f.generation = round_.generation;
  f.lease = lease_;
  f.token = fmt::format("{:06d}.{:012d}", requeues, round_.generation);  // fixed width: text order is round order
  for (const auto& m : round_.members()) f.member_keys.push_back(m.sort_key());
  return f;
}

std::string fence_commit(KvBackend& kv, const CommitFence& fence, std::string_view what) {
  try {
    if (fence.generation == 0) return "this node is in no round";
    const auto gen = kv.get(fence.prefix + "gen");
    if (!gen || to_i64(gen->value).value_or(0) != static_cast<std::int64_t>(fence.generation))
      return fmt::format("round {} is over on the store (generation {} there)", fence.generation,
                         gen ? gen->value : std::string("unset"));
    const auto alive_prefix = fence.prefix + "alive/";
    std::size_t alive = 0;
    for (const auto& kv_alive : kv.get_prefix(alive_prefix)) {
      const auto key = std::string_view(kv_alive.key).substr(alive_prefix.size());
      alive += std::find(fence.member_keys.begin(), fence.member_keys.end(), key) != fence.member_keys.end();
    }
    if (2 * alive <= fence.member_keys.size())
      return fmt::format("only {} of the round's {} members are alive on the store: no quorum", alive,
                         fence.member_keys.size());
    // Outside the watched prefix ("elastrun/<run>.commits/", like the probe answers): a commit
    // wakes no agent. Our lease still live: a write under it is refused once we were declared dead.
    const auto records = fence.prefix.substr(0, fence.prefix.size() - 1) + ".commits/";
    kv.set(records + "fence/" + fence.token, std::string(what), fence.lease);
    const auto record = records + "step/" + std::string(what);
    std::optional<std::string> current;
    while (!kv.compare_and_set(record, current, fence.token, 0, &current)) {
      if (current && *current > fence.token)
        return fmt::format("a newer round ({}) committed {} already", *current, what);
    }
    return "";
  } catch (const StoreError& e) {
    if (e.kind() == StoreErrorKind::NoSuchLease) return "this node was declared dead (its lease is gone)";
    return fmt::format("the rendezvous store cannot confirm the round: {}", e.what());
  }
}

// ---- published records ---------------------------------------------------------------------

bool Rendezvous::publish(std::string_view key, std::string_view value, bool only_if_absent) {
  const auto full = prefix_ + "pub/" + std::string(key);
  if (only_if_absent) return kv_->compare_and_set(full, std::nullopt, value);
  kv_->set(full, value);
  return true;
}

std::optional<std::string> Rendezvous::read(std::string_view key) {
  auto kv = kv_->get(prefix_ + "pub/" + std::string(key));
  if (!kv) return std::nullopt;
  return kv->value;
}

std::optional<std::string> Rendezvous::closed_reason() {
  auto kv = kv_->get(prefix_ + "closed");
  if (!kv) return std::nullopt;
  return kv->value;
}

std::optional<Rendezvous::ClockReading> Rendezvous::store_clock() {
  const auto wall_ms = [] {
    return std::chrono::duration_cast<Millis>(std::chrono::system_clock::now().time_since_epoch()).count();
  };
  ClockReading r;
  r.before_ms = wall_ms();
  const auto store = kv_->wall_clock_ms();
  r.after_ms = wall_ms();
  if (!store) return std::nullopt;
  r.store_ms = *store;
  return r;
}

std::vector<std::pair<std::string, std::string>> Rendezvous::read_prefix(std::string_view key_prefix) {
  const auto base = prefix_ + "pub/";
  std::vector<std::pair<std::string, std::string>> out;
  for (auto& kv : kv_->get_prefix(base + std::string(key_prefix)))
    out.emplace_back(kv.key.substr(base.size()), std::move(kv.value));
  return out;
}

}  // namespace elastrun::rdzv
