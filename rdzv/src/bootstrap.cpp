#include "elastrun/rdzv/bootstrap.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <optional>
#include <thread>

#include "elastrun/rdzv/net.hpp"
#include "elastrun/rdzv/slurm_api.hpp"
#include "elastrun/slurm/api.hpp"
#include "elastrun/util/parse.hpp"

namespace elastrun::rdzv {
namespace {

std::string own_hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0) return "localhost";
  return buf;
}

std::pair<std::string, std::optional<std::uint16_t>> split_endpoint(const std::string& endpoint) {
  auto colon = endpoint.rfind(':');
  if (colon == std::string::npos) return {endpoint, std::nullopt};
  auto text = std::string_view(endpoint).substr(colon + 1);
  auto port = util::parse_integer_in<unsigned>(text, 1, 65535);
  if (!port) throw RendezvousError(fmt::format("--rdzv-endpoint={}: '{}' is not a port (1-65535)", endpoint, text));
  return {endpoint.substr(0, colon), static_cast<std::uint16_t>(*port)};
}

// Where this agent's stores listen: never on every address unless nothing better is known.
// Loopback for a loopback endpoint; else the address peers use: --local-addr, Slurm's NodeAddr,
// or what the host name resolves to -- unless that is a loopback address (Debian maps the host
// name to 127.0.1.1), which peers on other hosts cannot reach: then 0.0.0.0, with a note.
void choose_bind_address(BootstrapPlan& plan, const DetectedEnv& env, const BootstrapOverrides& o) {
  if (is_loopback_host(plan.store_host)) {
    plan.bind_address = "127.0.0.1";
    return;
  }
  std::optional<std::string> ip;
  std::string source;
  if (!o.local_addr.empty()) {
    ip = ipv4_address(o.local_addr), source = "--local-addr=" + o.local_addr;
  } else if (env.slurm) {
    auto node_addr = slurm::node_addr(plan.me.node_name).value_or(plan.me.address);
    ip = ipv4_address(node_addr), source = fmt::format("Slurm's NodeAddr {} of {}", node_addr, plan.me.node_name);
    if (ip) {
      plan.bind_address = *ip;  // even a loopback NodeAddr: that is where Slurm reaches the node
      return;
    }
  } else {
    ip = ipv4_address(plan.me.address), source = "host name " + plan.me.address;
  }
  if (ip && !is_loopback_host(*ip)) {
    plan.bind_address = *ip;
    return;
  }
  if (ip && !o.local_addr.empty()) {
    plan.bind_address = *ip;  // asked for
    return;
  }
  plan.bind_address = "0.0.0.0";
  plan.bind_note = fmt::format(
      "the stores listen on every address (0.0.0.0): {} {}; pass --local-addr=ADDR (the address other nodes "
      "reach this one at) to listen on one",
      source, ip ? fmt::format("resolves to the loopback address {}", *ip) : std::string("does not resolve"));
}

}  // namespace

BootstrapPlan plan_bootstrap(const DetectedEnv& env, const BootstrapOverrides& o) {
  BootstrapPlan plan;
  plan.me.nproc = o.nproc;
  plan.me.role = o.role;
  plan.me.pid = getpid();
  plan.me.node_name = own_hostname();
  if (env.slurm) {
    const auto& s = *env.slurm;
    if (!s.node_name.empty()) plan.me.node_name = s.node_name;
    const auto& order = s.job_nodes.empty() ? s.nodes : s.job_nodes;
    auto it = std::find(order.begin(), order.end(), plan.me.node_name);
    plan.me.node_index = it == order.end() ? env.placement.node_rank : static_cast<int>(it - order.begin());
    plan.me.het_component = std::max(0, s.het_component);
  }
  plan.me.address =
      !o.local_addr.empty() ? o.local_addr : resolve_node_address(plan.me.node_name).value_or(plan.me.node_name);
  plan.run_id = !o.run_id.empty() ? o.run_id : env.run_id;

  if (!o.endpoint.empty()) {
    auto [host, port] = split_endpoint(o.endpoint);
    plan.store_host = host;
    plan.store_port = port.value_or(29400);
    // torchrun's rule: an endpoint naming this machine (its name, localhost, 127.0.0.1) means
    // "host it here" -- and if another agent already does, join it as a client (start_agent_stores)
    plan.host_store = o.is_host.value_or(host == plan.me.node_name || host == own_hostname() || is_loopback_host(host));
    plan.host_store_inferred = !o.is_host;
  } else if (env.rdzv_endpoint) {
    plan.store_host = env.rdzv_endpoint->host;
    plan.store_port = env.rdzv_endpoint->port;
    plan.fallback_ports = env.rdzv_endpoint->fallback_ports;
    plan.host_store = o.is_host.value_or(plan.store_host == plan.me.node_name);
  } else {
    throw RendezvousError(
        "no rendezvous endpoint: not inside a Slurm step; pass --rdzv-endpoint=HOST:PORT (or "
        "--standalone for one machine)");
  }
  // torchrun's default --rdzv-id is "none": the static form (--master-addr/--master-port, no
  // --rdzv-id) must run as it does there. Under Slurm the id comes from the job.
  if (plan.run_id.empty()) plan.run_id = "none";
  auto address = resolve_node_address(plan.store_host);
  if (!address)
    throw RendezvousError(
        fmt::format("rendezvous host '{}' resolves neither in DNS nor as a Slurm node; "
                    "fix --rdzv-endpoint",
                    plan.store_host));
  plan.store_address = *address;
  choose_bind_address(plan, env, o);
  return plan;
}

BootstrapPlan plan_standalone(const DetectedEnv& env, const BootstrapOverrides& o) {
  BootstrapPlan plan;
  plan.run_id = o.run_id.empty() ? fmt::format("standalone-{}", getpid()) : o.run_id;
  plan.me.node_name = env.hostname.empty() ? "localhost" : env.hostname;
  plan.me.address = "127.0.0.1";
  plan.me.pid = getpid();
  plan.me.nproc = o.nproc;
  plan.me.role = o.role;
  plan.store_host = plan.store_address = "127.0.0.1";
  plan.bind_address = "127.0.0.1";
  plan.host_store = true;
  return plan;
}

AgentStores start_agent_stores(BootstrapPlan& plan, const AuthConfig& auth) {
  AgentStores stores;
  StoreServerOptions so;
  so.bind_address = plan.bind_address;
  so.run_id = plan.run_id;
  so.auth = auth;
  if (plan.host_store) {
    so.port = plan.store_port;
    so.fallback_ports = plan.fallback_ports;
    try {
      stores.primary = std::make_unique<StoreServer>(so);
      plan.me.store_port = stores.primary->port();
      return stores;
    } catch (const StoreError& e) {
      // Two agents started alike on one host (torchrun's tests do that): the first hosts the
      // store, the second finds the port taken and joins it. Not with Slurm's derived ports,
      // which have fallbacks of their own, nor when --rdzv-conf is_host=1 was explicit.
      if (e.kind() != StoreErrorKind::AddressInUse || !plan.host_store_inferred || !plan.fallback_ports.empty()) throw;
      spdlog::info("[rdzv] port {} is taken (another agent of this run hosts the store?): joining it as a client",
                   plan.store_port);
      plan.host_store = false;
    }
  }
  so.port = 0;  // a standby store: any free port, announced in our roster line
  so.fallback_ports.clear();
  stores.standby = std::make_unique<StoreServer>(so);
  plan.me.store_port = stores.standby->port();
  return stores;
}

StoreConnector store_connector(const AuthConfig& auth, const std::string& run_id) {
  return [auth, run_id](const std::string& address, std::uint16_t port) -> std::unique_ptr<KvBackend> {
    return std::make_unique<StoreClient>(address, port, auth, run_id, Millis(1000));
  };
}

std::unique_ptr<StoreClient> connect_store(const BootstrapPlan& plan, const AuthConfig& auth, Millis patience) {
  std::vector<std::uint16_t> ports{plan.store_port};
  ports.insert(ports.end(), plan.fallback_ports.begin(), plan.fallback_ports.end());
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + patience;
  auto next_report = start + std::chrono::seconds(3);
  std::string last_error;
  // A refused credential is final for that port (wrong credentials stay wrong), but with Slurm's
  // derived ports the store there may be another job's (a neighbouring cluster's job with the same
  // id, on the same host): ours may be on a fallback port that is not up yet. Other ports get
  // kRefusalGrace; then, or when every port refused, the refusal is the error.
  constexpr auto kRefusalGrace = std::chrono::seconds(10);
  std::vector<bool> refused(ports.size(), false);
  std::optional<StoreError> refusal;
  std::chrono::steady_clock::time_point refused_at{};
  for (int attempt = 0;; ++attempt) {
    if (const auto now = std::chrono::steady_clock::now(); attempt > 0 && now >= next_report) {
      // Say so within seconds, not at join_timeout: nobody may be hosting the store at all.
      spdlog::warn(
          "[rdzv] still no rendezvous store for run '{}' at {}:{} after {} s ({}); the agent on {} hosts it "
          "(or the one with --rdzv-conf is_host=1); retrying until {} s",
          plan.run_id, plan.store_host, plan.store_port,
          std::chrono::duration_cast<std::chrono::seconds>(now - start).count(), last_error, plan.store_host,
          std::chrono::duration_cast<std::chrono::seconds>(patience).count());
      next_report = now + std::chrono::seconds(10);
    }
    for (std::size_t i = 0; i < ports.size(); ++i) {
      if (refused[i]) continue;
      try {
        return std::make_unique<StoreClient>(plan.store_address, ports[i], auth, plan.run_id, Millis(2000));
      } catch (const StoreError& e) {
        last_error = e.what();
        if (e.kind() == StoreErrorKind::AuthFailed) {
          refused[i] = true;
          if (!refusal) {
            refusal = e;
            refused_at = std::chrono::steady_clock::now();
          }
        }
        // any other error: a store of another run (a stale port) may yet make way for ours
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (refusal &&
        (std::all_of(refused.begin(), refused.end(), [](bool r) { return r; }) || now - refused_at > kRefusalGrace))
      throw *refusal;
    if (now > deadline)
      throw StoreError(StoreErrorKind::ConnectionLost,
                       fmt::format("no rendezvous store for run '{}' at {} ({}) ports {}..{} after {} s: {}",
                                   plan.run_id, plan.store_host, plan.store_address, ports.front(), ports.back(),
                                   patience.count() / 1000, last_error));
    std::this_thread::sleep_for(Millis(std::min(50 * (attempt + 1), 500)));
  }
}

}  // namespace elastrun::rdzv
