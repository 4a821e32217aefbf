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
// Forming members watch only r/<gen>/ctl/, so N joins cost O(N) wake-ups, not O(N^2).
#include "elastrun/rdzv/rendezvous.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>

#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/store.hpp"

namespace elastrun::rdzv {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

std::int64_t wall_ms() {
  return std::chrono::duration_cast<Millis>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::optional<std::int64_t> to_i64(std::string_view s) {
  std::int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || p != s.data() + s.size()) return std::nullopt;
  return v;
}

json member_json(const MemberInfo& m) {
  return {{"node", m.node_name}, {"addr", m.address}, {"component", m.het_component},
          {"index", m.node_index}, {"nproc", m.nproc}, {"role", m.role}, {"pid", m.pid}};
}

MemberInfo member_from(const json& j) {
  MemberInfo m;
  m.node_name = j.at("node").get<std::string>();
  m.address = j.at("addr").get<std::string>();
  m.het_component = j.at("component").get<int>();
  m.node_index = j.at("index").get<int>();
  m.nproc = j.at("nproc").get<int>();
  m.role = j.at("role").get<std::string>();
  m.pid = j.at("pid").get<std::int64_t>();
  return m;
}

}  // namespace

std::string_view to_string(Change change) {
  switch (change) {
    case Change::None: return "none";
    case Change::MemberLost: return "member lost";
    case Change::MemberWaiting: return "member waiting (scale up)";
    case Change::Reform: return "new round requested";
    case Change::Fenced: return "fenced (declared dead)";
    case Change::Closed: return "closed";
  }
  return "unknown";
}

std::string MemberInfo::sort_key() const {
  return fmt::format("{:04d}.{:07d}.{}", het_component, node_index, node_name);
}

Rendezvous::Rendezvous(std::unique_ptr<KvBackend> kv, std::unique_ptr<KvBackend> heartbeat_kv,
                       RendezvousConfig config, MemberInfo me)
    : kv_(std::move(kv)),
      heartbeat_kv_(std::move(heartbeat_kv)),
      config_(std::move(config)),
      me_(std::move(me)),
      prefix_("elastrun/" + config_.run_id + "/"),
      my_key_(me_.sort_key()) {
  if (config_.min_nodes < 1 || config_.max_nodes < config_.min_nodes)
    throw RendezvousError(fmt::format("--nnodes={}:{} is not a valid MIN:MAX (need 1 <= MIN <= MAX)",
                                      config_.min_nodes, config_.max_nodes));
  ensure_alive();
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

Rendezvous::~Rendezvous() {
  stop_ = true;
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
  while (!stop_) {
    auto until = Clock::now() + interval;
    while (!stop_ && Clock::now() < until) std::this_thread::sleep_for(std::min(Millis(20), interval));
    if (stop_) break;
    std::lock_guard lock(heartbeat_mutex_);
    try {
      if (lease_ && !fenced_ && !heartbeat_kv_->keep_alive(lease_)) {
        spdlog::warn("[rdzv] our lease {} is gone: the others declared this node dead", lease_);
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
  lease_ = heartbeat_kv_->grant_lease(config_.heartbeat_timeout);
  fenced_ = false;
  kv_->set(prefix_ + "alive/" + my_key_, member_json(me_).dump(), lease_);
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

RoundResult Rendezvous::next_round() {
  const auto join_deadline = Clock::now() + config_.join_timeout;
  while (true) {
    if (auto closed = kv_->get(prefix_ + "closed"))
      throw RendezvousClosed(fmt::format("rendezvous '{}' is closed: {}", config_.run_id, closed->value));
    ensure_alive();
    const auto gen = current_generation();
    // A generation we already ran is over: move everyone to the next one.
    if (gen <= round_.generation) {
      advance_generation(gen);
      continue;
    }
    try {
      if (auto result = try_form(gen)) {
        round_ = std::move(*result);
        return round_;
      }
    } catch (const StoreError& e) {
      // Our lease died while we were not looking: we are fenced; rejoin as a new member.
      if (e.status() != protocol::Status::NoSuchLease) throw;
      fenced_ = true;
    }
    if (Clock::now() > join_deadline)
      throw RendezvousError(fmt::format(
          "only some of the required {} nodes joined round {} within {} s (--rdzv-conf join_timeout)",
          config_.min_nodes, gen, config_.join_timeout.count() / 1000));
  }
}

// Joins round `gen`; returns its result if we are in it, std::nullopt if the round closed
// without us (we then waited for the next generation) or the generation moved on.
std::optional<RoundResult> Rendezvous::try_form(std::uint64_t gen) {
  const auto round = fmt::format("{}r/{}/", prefix_, gen);
  const auto ctl = round + "ctl/";
  if (auto roster = kv_->get(ctl + "roster")) {
    auto members = json::parse(roster->value);
    for (const auto& m : members)
      if (member_from(m).sort_key() == my_key_) return finish_round(gen, roster->value);
    wait_as_late_joiner(gen);
    return std::nullopt;
  }
  kv_->set(round + "join/" + my_key_, member_json(me_).dump(), lease_);
  auto joined = kv_->add(round + "count", 1);
  if (joined >= config_.max_nodes) try_close(gen);
  else if (joined >= config_.min_nodes)
    kv_->compare_and_set(ctl + "last_call", std::nullopt,
                         std::to_string(wall_ms() + config_.last_call_timeout.count()));

  const auto join_deadline = Clock::now() + config_.join_timeout;
  std::uint64_t rev = 0;
  while (true) {
    auto control = kv_->get_prefix(ctl, &rev);
    std::optional<std::string> roster, last_call;
    for (auto& kv : control) {
      if (kv.key == ctl + "roster") roster = std::move(kv.value);
      if (kv.key == ctl + "last_call") last_call = std::move(kv.value);
    }
    if (roster) {
      for (const auto& m : json::parse(*roster))
        if (member_from(m).sort_key() == my_key_) return finish_round(gen, *roster);
      kv_->remove(round + "join/" + my_key_);
      wait_as_late_joiner(gen);
      return std::nullopt;
    }
    if (current_generation() != gen) return std::nullopt;
    if (fenced_) return std::nullopt;
    Millis wait = std::chrono::ceil<Millis>(join_deadline - Clock::now());
    if (last_call) {
      auto deadline = to_i64(*last_call).value_or(0);
      auto left = deadline - wall_ms();
      if (left <= 0) {
        if (try_close(gen)) continue;
        wait = Millis(200);  // too few live members now: wait for more joins
      } else {
        wait = Millis(left);
      }
    } else {
      // The member that reached min may have died before starting the last call; a periodic
      // look at the live joins covers that.
      auto live = kv_->get_prefix(round + "join/").size();
      if (static_cast<int>(live) >= config_.min_nodes) {
        kv_->compare_and_set(ctl + "last_call", std::nullopt,
                             std::to_string(wall_ms() + config_.last_call_timeout.count()));
        continue;
      }
      wait = std::min(wait, Millis(1000));
    }
    if (wait <= Millis(0)) {
      if (!last_call) return std::nullopt;  // join timeout; next_round() reports it
      wait = Millis(1);
    }
    kv_->watch(ctl, rev, wait);
  }
}

bool Rendezvous::try_close(std::uint64_t gen) {
  const auto round = fmt::format("{}r/{}/", prefix_, gen);
  auto joins = kv_->get_prefix(round + "join/");  // only live members: dead ones' keys are gone
  if (static_cast<int>(joins.size()) < config_.min_nodes) {
    kv_->remove(round + "ctl/last_call");
    return false;
  }
  json roster = json::array();
  for (const auto& kv : joins) {
    if (static_cast<int>(roster.size()) == config_.max_nodes) break;
    roster.push_back(json::parse(kv.value));
  }
  kv_->compare_and_set(round + "ctl/roster", std::nullopt, roster.dump());
  return true;  // closed by us or by someone else
}

void Rendezvous::wait_as_late_joiner(std::uint64_t gen) {
  // The round closed without us: wait in the wait list; running members see us and re-form.
  const auto waiting = prefix_ + "waiting/" + my_key_;
  kv_->set(waiting, member_json(me_).dump(), lease_);
  spdlog::info("[rdzv] round {} is running without this node; waiting for the next round", gen);
  std::uint64_t rev = 0;
  while (!fenced_) {
    auto gen_kv = kv_->get(prefix_ + "gen");
    if (!gen_kv || to_i64(gen_kv->value).value_or(0) != static_cast<std::int64_t>(gen)) break;
    if (kv_->get(prefix_ + "closed")) break;
    rev = std::max(rev, gen_kv->revision);
    kv_->watch(prefix_ + "gen", rev, Millis(1000));
    kv_->watch(prefix_ + "closed", rev, Millis(1));
  }
  kv_->remove(waiting);
}

RoundResult Rendezvous::finish_round(std::uint64_t gen, const std::string& roster_json) {
  RoundResult r;
  r.generation = gen;
  for (const auto& m : json::parse(roster_json)) r.members.push_back(member_from(m));
  r.group_world_size = static_cast<int>(r.members.size());
  for (int i = 0; i < r.group_world_size; ++i) {
    const auto& m = r.members[static_cast<std::size_t>(i)];
    if (m.sort_key() == my_key_) {
      r.group_rank = i;
      r.rank_offset = r.world_size;
      r.role_rank_offset = r.role_world_size;
    }
    r.world_size += m.nproc;
    if (m.role == me_.role) r.role_world_size += m.nproc;
  }
  // Group rank 0 hosts the workers' process group on a port the kernel picked (never a fixed
  // 29500 that collides with other jobs) and publishes it.
  const auto master_key = fmt::format("{}r/{}/ctl/master", prefix_, gen);
  if (r.group_rank == 0) {
    auto probe = listen_tcp("0.0.0.0", 0);
    kv_->compare_and_set(master_key, std::nullopt, fmt::format("{}:{}", me_.address, probe.port));
  }
  std::uint64_t rev = 0;
  const auto deadline = Clock::now() + config_.join_timeout;
  while (true) {
    auto control = kv_->get_prefix(master_key, &rev);
    if (!control.empty()) {
      const auto& v = control.front().value;
      auto colon = v.rfind(':');
      r.master_addr = v.substr(0, colon);
      r.master_port = static_cast<std::uint16_t>(to_i64(v.substr(colon + 1)).value_or(0));
      break;
    }
    if (Clock::now() > deadline || current_generation() != gen)
      throw RendezvousError(fmt::format("group rank 0 ({}) never published the master port of round {}",
                                        r.members.front().node_name, gen));
    kv_->watch(master_key, rev, Millis(1000));
  }
  // Changes after this revision concern the running round.
  kv_->get_prefix(prefix_ + "gen", &watch_revision_);
  spdlog::info("[rdzv] round {} complete: {} nodes, {} workers, this node is group rank {}", gen,
               r.group_world_size, r.world_size, r.group_rank);
  return r;
}

Change Rendezvous::wait_for_change(Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  while (true) {
    if (fenced_) return Change::Fenced;
    auto left = std::chrono::ceil<Millis>(deadline - Clock::now());
    if (left <= Millis(0)) return Change::None;
    std::uint64_t rev = 0;
    std::vector<WatchEvent> events;
    try {
      events = kv_->watch(prefix_, watch_revision_, std::min(left, Millis(500)), &rev);
    } catch (const std::exception& e) {
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
        for (const auto& m : round_.members)
          if (m.sort_key() == who && who != my_key_) {
            spdlog::warn("[rdzv] member {} (node {}) lost", who, m.node_name);
            return Change::MemberLost;
          }
      }
      if (key.starts_with("waiting/") && e.type == WatchEvent::Type::Put &&
          round_.group_world_size < config_.max_nodes)
        return Change::MemberWaiting;
    }
  }
}

void Rendezvous::request_new_round() { advance_generation(round_.generation); }

void Rendezvous::close(std::string_view reason) {
  kv_->compare_and_set(prefix_ + "closed", std::nullopt, reason);
}

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

}  // namespace elastrun::rdzv
