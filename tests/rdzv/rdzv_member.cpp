// rdzv_member: one rendezvous member as a real process, for tests and benchmarks.
// Joins rounds and prints one JSON line per event on stdout:
//   {"v":1,"time":..,"node":..,"run_id":..,"event":"store","port":P}   this process hosts the store (schema v1)
//   {"event":"round","gen":G,"group_rank":..,...}    a round including us completed
//   {"event":"change","what":"member lost"}          something calls for a new round
//   {"event":"reconnected"}                          after "store lost": back on the same store
// With --slurm everything comes from the environment (zero flags), as the agent will do.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <chrono>

#include "elastrun/worker/events.hpp"

#include <iostream>

#include "elastrun/rdzv/bootstrap.hpp"
#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/hostlist.hpp"
#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/slurm_api.hpp"
#include "elastrun/slurm/api.hpp"
#include "elastrun/rdzv/store.hpp"

using namespace elastrun::rdzv;

namespace {
// Event lines of schema v1 (docs/events.md), the agent's format, on stdout.
std::string g_node = "local", g_run_id;
void emit(std::string_view event, const nlohmann::ordered_json& fields) {
  const auto now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::cout << elastrun::worker::event_line(now, g_node, g_run_id, event, std::nullopt, fields) << std::endl;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"rendezvous member (test tool)"};
  bool slurm = false, serve = false;
  std::string endpoint, run_id = "test", node, auth = "none";
  int index = 0, nproc = 1, min_nodes = 1, max_nodes = 1, rounds = 0;
  int hb_ms = 3000, last_call_ms = 500, join_timeout_ms = 60000, partition_timeout_ms = 0;
  app.add_flag("--slurm", slurm, "take identity and endpoint from the Slurm environment");
  app.add_flag("--serve", serve, "host the store here (default under --slurm: the first node)");
  app.add_option("--endpoint", endpoint, "store host:port");
  app.add_option("--run-id", run_id);
  app.add_option("--node", node, "node name (default: hostname / SLURMD_NODENAME)");
  app.add_option("--index", index, "node index (ordering)");
  app.add_option("--nproc", nproc);
  app.add_option("--min", min_nodes);
  app.add_option("--max", max_nodes);
  app.add_option("--rounds", rounds, "exit after this many rounds (0: run until closed)");
  app.add_option("--hb-ms", hb_ms, "heartbeat timeout");
  app.add_option("--last-call-ms", last_call_ms);
  app.add_option("--join-timeout-ms", join_timeout_ms);
  app.add_option("--partition-timeout-ms", partition_timeout_ms, "without quorum this long: exit 4 (0: join timeout)");
  app.add_option("--auth", auth, "munge|token|none|auto");
  bool confirm_slurm = false;
  app.add_flag("--confirm-slurm", confirm_slurm, "ask Slurm before declaring a silent node dead");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_default_logger(spdlog::stderr_color_st("rdzv_member"));  // stdout carries JSON
  spdlog::set_pattern(fmt::format("[node {}] %v", node.empty() ? "?" : node));

  try {
    BootstrapPlan plan;
    if (slurm) {
      auto env = detect_environment(current_environment(), expand_hostlist);
      plan = plan_bootstrap(env, {.endpoint = endpoint,
                                  .run_id = "",
                                  .is_host = std::nullopt,
                                  .nproc = nproc,
                                  .role = "default",
                                  .local_addr = ""});
      if (!node.empty()) plan.me.node_name = node;
    } else {
      auto colon = endpoint.rfind(':');
      plan.store_host = plan.store_address = endpoint.substr(0, colon);
      plan.store_port = static_cast<std::uint16_t>(std::stoi(endpoint.substr(colon + 1)));
      plan.run_id = run_id;
      plan.me.node_name = node.empty() ? "local" : node;
      plan.me.address = "127.0.0.1";
      plan.me.node_index = index;
      plan.me.nproc = nproc;
      plan.me.pid = getpid();
      plan.host_store = serve;
    }
    spdlog::set_pattern(fmt::format("[node {}] %v", plan.me.node_name));
    g_node = plan.me.node_name;
    g_run_id = plan.run_id;
    auto auth_config = resolve_auth(auth, {.run_id = plan.run_id, .one_host = false});
    std::unique_ptr<StoreServer> server;
    if (plan.host_store || serve) {
      StoreServerOptions options;
      options.port = plan.store_port;
      options.fallback_ports = plan.fallback_ports;
      options.run_id = plan.run_id;
      options.auth = auth_config;
      if (confirm_slurm) options.holder_is_down = elastrun::slurm::node_is_down;
      server = std::make_unique<StoreServer>(options);
      emit("store", {{"port", server->port()}});
    }
    // Every member also runs a standby store on a free port: if the store's host dies, the
    // survivors fail over to the first standby of the last round (no single point of failure).
    std::unique_ptr<StoreServer> standby;
    if (!server) {
      StoreServerOptions options;
      options.run_id = plan.run_id;
      options.auth = auth_config;
      if (confirm_slurm) options.holder_is_down = elastrun::slurm::node_is_down;
      standby = std::make_unique<StoreServer>(options);
    }
    plan.me.store_port = server ? server->port() : standby->port();
    StoreConnector connector = [&](const std::string& address, std::uint16_t port) -> std::unique_ptr<KvBackend> {
      return std::make_unique<StoreClient>(address, port, auth_config, plan.run_id, Millis(1000));
    };
    auto kv = connect_store(plan, auth_config, Millis(join_timeout_ms));
    auto hb = connect_store(plan, auth_config, Millis(join_timeout_ms));
    RendezvousConfig config;
    config.run_id = plan.run_id;
    config.min_nodes = min_nodes;
    config.max_nodes = max_nodes;
    config.join_timeout = Millis(join_timeout_ms);
    config.last_call_timeout = Millis(last_call_ms);
    config.heartbeat_timeout = Millis(hb_ms);
    config.partition_timeout = Millis(partition_timeout_ms);
    config.primary_address = plan.store_address;
    config.primary_port = plan.store_port;
    if (confirm_slurm)
      config.confirmed_gone = [](const MemberInfo& m) {
        return elastrun::slurm::node_is_down(m.node_name).value_or(false);
      };
    config.on_quorum_wait = [](const QuorumWait& w) {
      emit(w.waiting ? "no_quorum" : "quorum",
           {{"members", w.members}, {"present", w.present}, {"unreachable", w.unreachable}, {"store", w.store_node}});
    };
    Rendezvous rdzv(std::move(kv), std::move(hb), config, plan.me, connector);
    for (int done = 0; rounds == 0 || done < rounds; ++done) {
      auto r = rdzv.next_round();
      nlohmann::json members = nlohmann::json::array();
      for (const auto& m : r.members()) members.push_back(m.node_name);
      emit("round", {{"gen", r.generation},
                     {"group_rank", r.group_rank},
                     {"group_world_size", r.group_world_size},
                     {"world_size", r.world_size},
                     {"rank_offset", r.rank_offset},
                     {"members", members},
                     {"master", fmt::format("{}:{}", r.master_addr, r.master_port)}});
      if (rounds != 0 && done + 1 == rounds) break;
      Change change = Change::None;
      while (change == Change::None) change = rdzv.wait_for_change(Millis(60000));
      emit("change", {{"what", std::string(to_string(change))}});
      if (change == Change::Closed) return 0;
      // as the agent does while its workers stop (launcher/src/agent.cpp, membership_changed)
      if (change == Change::StoreLost && rdzv.reconnect_to_the_same_store()) emit("reconnected", {});
    }
    return 0;
  } catch (const RendezvousClosed& e) {
    emit("closed", {{"what", e.what()}});
    return 0;
  } catch (const NoQuorum& e) {
    emit("gave_up", {{"what", e.what()}});
    return 4;
  } catch (const std::exception& e) {
    fmt::print(stderr, "rdzv_member: error: {}\n", e.what());
    return 3;
  }
}
