// The collective libraries' defaults for the workers (collective_env.hpp): NCCL's async error
// handling and, on a node with several interfaces, the one of the node's rendezvous address.
#include <gtest/gtest.h>

#include <algorithm>

#include "collective_env.hpp"

namespace elastrun::launcher {
namespace {

// a node as HPC clusters have them: loopback, the cluster network, a fast fabric and a docker bridge
const std::vector<NetworkInterface> kFourInterfaces{{"lo", "127.0.0.1", true},
                                                    {"eno1", "10.1.2.3", false},
                                                    {"ib0", "172.16.0.3", false},
                                                    {"docker0", "172.17.0.1", false}};

TEST(CollectiveEnv, OnANodeWithSeveralInterfacesTheOneHoldingTheRendezvousAddress) {
  auto chosen = choose_socket_interface("172.16.0.3", kFourInterfaces);
  EXPECT_EQ(chosen.ifname, "ib0");
  EXPECT_FALSE(chosen.warning);
  EXPECT_NE(chosen.note.find("ib0, the interface of this node's rendezvous address 172.16.0.3"), std::string::npos)
      << chosen.note;
  EXPECT_EQ(choose_socket_interface("10.1.2.3", kFourInterfaces).ifname, "eno1");
}

TEST(CollectiveEnv, NothingWithOneInterfaceOrALoopbackAddressOrNoAddress) {
  const std::vector<NetworkInterface> one{{"lo", "127.0.0.1", true}, {"eth0", "10.0.0.5", false}};
  for (const auto& [address, interfaces] :
       std::vector<std::pair<std::string, std::vector<NetworkInterface>>>{{"10.0.0.5", one},
                                                                          {"127.0.0.1", kFourInterfaces},
                                                                          {"127.0.1.1", kFourInterfaces},
                                                                          {"", kFourInterfaces},
                                                                          {"node7", kFourInterfaces}}) {
    const auto chosen = choose_socket_interface(address, interfaces);
    EXPECT_EQ(chosen.ifname, "") << address;
    EXPECT_EQ(chosen.note, "") << address;
  }
  // two addresses on one interface are one interface
  const std::vector<NetworkInterface> aliases{{"eth0", "10.0.0.5", false}, {"eth0", "10.0.0.6", false}};
  EXPECT_EQ(choose_socket_interface("10.0.0.6", aliases).ifname, "");
}

TEST(CollectiveEnv, AnAddressOnNoInterfaceIsAWarningAndSetsNothing) {
  const auto chosen = choose_socket_interface("10.9.9.9", kFourInterfaces);
  EXPECT_EQ(chosen.ifname, "");
  EXPECT_TRUE(chosen.warning);
  EXPECT_NE(chosen.note.find("10.9.9.9 is on none of its interfaces (docker0, eno1, ib0)"), std::string::npos)
      << chosen.note;
  EXPECT_NE(chosen.note.find("set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME"), std::string::npos);
}

TEST(CollectiveEnv, DefaultsGiveWayToWhatTheUserSet) {
  using Vars = std::vector<std::pair<std::string, std::string>>;
  EXPECT_EQ(collective_defaults("", {}),
            (Vars{{"NCCL_ASYNC_ERROR_HANDLING", "1"}, {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}}));
  EXPECT_EQ(collective_defaults("ib0", {"NCCL_ASYNC_ERROR_HANDLING=0", "GLOO_SOCKET_IFNAME=eno1", "NCCL_X=1"}),
            (Vars{{"TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"}, {"NCCL_SOCKET_IFNAME", "ib0"}}));
}

TEST(CollectiveEnv, ThisHostsInterfacesIncludeLoopback) {
  const auto found = network_interfaces();
  EXPECT_TRUE(std::any_of(found.begin(), found.end(),
                          [](const NetworkInterface& i) { return i.loopback && i.ipv4 == "127.0.0.1"; }));
}

}  // namespace
}  // namespace elastrun::launcher
