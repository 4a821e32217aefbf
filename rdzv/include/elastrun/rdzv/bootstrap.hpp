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
  bool host_store = false;  // this agent runs the embedded store
};

struct BootstrapOverrides {
  std::string endpoint;         // --rdzv-endpoint host[:port]
  std::string run_id;           // --rdzv-id
  std::optional<bool> is_host;  // --rdzv-conf is_host=1|0
  int nproc = 1;
  std::string role = "default";
};

// Throws RendezvousError with a one-line explanation (e.g. no Slurm and no endpoint).
BootstrapPlan plan_bootstrap(const DetectedEnv& env, const BootstrapOverrides& overrides);

// Connects to the store at plan.store_address, trying the port then each fallback (a store of
// another run refuses us and is skipped), retrying until `patience` runs out (the host may
// still be starting). Throws StoreError naming the endpoint.
std::unique_ptr<StoreClient> connect_store(const BootstrapPlan& plan, const AuthConfig& auth,
                                           Millis patience);

}  // namespace elastrun::rdzv
