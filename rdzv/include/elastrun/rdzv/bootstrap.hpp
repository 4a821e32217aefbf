// From a detected environment to "who am I in the rendezvous and where is the store": the
// zero-configuration path under Slurm, overridable the way torchrun's flags are.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "elastrun/rdzv/env.hpp"
#include "elastrun/rdzv/rendezvous.hpp"
#include "elastrun/rdzv/store.hpp"

namespace elastrun::rdzv {

struct BootstrapPlan {
  MemberInfo me;
  std::string run_id;
  std::string store_host;     // node name or host given by --rdzv-endpoint
  std::string store_address;  // what clients connect to
  std::uint16_t store_port = 0;
  std::vector<std::uint16_t> fallback_ports;
  bool host_store = false;               // this agent runs the embedded store
  bool host_store_inferred = false;      // from the endpoint naming this host, not is_host=1
  std::string bind_address = "0.0.0.0";  // where a hosted or standby store listens
  std::string bind_note;                 // why bind_address is 0.0.0.0 (for a warning), if it is
};

struct BootstrapOverrides {
  std::string endpoint;         // --rdzv-endpoint host[:port]
  std::string run_id;           // --rdzv-id
  std::optional<bool> is_host;  // --rdzv-conf is_host=1|0
  int nproc = 1;
  std::string role = "default";
  std::string local_addr;  // --local-addr: how peers reach this node (also where its stores listen)
};

// Throws RendezvousError with a one-line explanation (e.g. no Slurm and no endpoint).
BootstrapPlan plan_bootstrap(const DetectedEnv& env, const BootstrapOverrides& overrides);

// --standalone: one node, a store on 127.0.0.1 hosted by this agent (run id defaults to
// "standalone-<pid>").
BootstrapPlan plan_standalone(const DetectedEnv& env, const BootstrapOverrides& overrides);

// The stores an agent serves: the embedded store when the plan says it hosts it, otherwise a
// standby store on any free port, to which the survivors fail over if the store host dies
// (docs/rendezvous.md, "No single point of failure"). Sets plan.me.store_port to the port the
// store got (for a hosted store, plan.store_port or one of the fallbacks). When the plan only
// inferred hosting (an endpoint naming this host) and the port is taken, the agent joins as a
// client instead (plan.host_store becomes false). Throws StoreError.
struct AgentStores {
  std::unique_ptr<StoreServer> primary;  // this agent hosts the run's store
  std::unique_ptr<StoreServer> standby;
};
AgentStores start_agent_stores(BootstrapPlan& plan, const AuthConfig& auth);

// Opens store connections for Rendezvous's failover (StoreConnector).
StoreConnector store_connector(const AuthConfig& auth, const std::string& run_id);

// Connects to the store at plan.store_address, trying the port then each fallback (a store of
// another run refuses us and is skipped), retrying until `patience` runs out (the host may
// still be starting). Throws StoreError naming the endpoint.
std::unique_ptr<StoreClient> connect_store(const BootstrapPlan& plan, const AuthConfig& auth, Millis patience);

}  // namespace elastrun::rdzv
