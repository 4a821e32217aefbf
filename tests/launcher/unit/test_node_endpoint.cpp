// The node endpoint (launcher/src/node_endpoint.hpp): the protocol on a real Unix socket, its
// errors, nothing left behind; and the real agent answering a status query while it waits in
// RENDEZVOUS (a second node never comes), its workers given the address.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "elastrun/worker/contract.hpp"
#include "node_endpoint.hpp"
#include "temp_dir.hpp"

namespace elastrun::launcher {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test_support::TempDir;

std::string unique_address() { return fmt::format("@elastrun-test-{}-{}", ::getpid(), std::rand()); }

TEST(NodeEndpoint, AnswersRequestsWithTheProtocolVersion) {
  NodeEndpoint endpoint(unique_address(), [](const json& request) {
    if (request.at("op") == "status") return json{{"state", "MONITOR"}};
    throw std::invalid_argument("unknown op");
  });
  const auto reply = query_node(endpoint.address(), {{"v", 1}, {"op", "status"}});
  EXPECT_EQ(reply["v"], contract::kNodeProtocolVersion);
  EXPECT_EQ(reply["ok"], true);
  EXPECT_EQ(reply["state"], "MONITOR");
  const auto unknown = query_node(endpoint.address(), {{"v", 1}, {"op", "dance"}});
  EXPECT_EQ(unknown["ok"], false);
  EXPECT_EQ(unknown["error"], "unknown op");
  const auto newer = query_node(endpoint.address(), {{"v", 99}, {"op", "status"}});
  EXPECT_EQ(newer["ok"], false);
  EXPECT_NE(newer["error"].get<std::string>().find("newer"), std::string::npos);
  const auto no_op = query_node(endpoint.address(), {{"v", 1}});
  EXPECT_EQ(no_op["ok"], false);
}

// Connections are read concurrently: clients that connect and say nothing (each kept 2 s before
// being dropped) do not hold up a rank's request. Served one at a time, 5 silent clients delayed
// it 10 s; the bound is generous for 2 noisy cores. A half-sent request is answered once its line
// is complete, after the others.
TEST(NodeEndpoint, SilentClientsDelayNoOne) {
  NodeEndpoint endpoint(unique_address(), [](const json& request) { return json{{"op", request.at("op")}}; });
  const auto [sa, length] = worker::node_socket_address(endpoint.address());
  std::vector<util::UniqueFd> silent;
  for (int i = 0; i < 5; ++i) {
    silent.emplace_back(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    ASSERT_EQ(::connect(silent.back().get(), reinterpret_cast<const sockaddr*>(&sa), length), 0);
  }
  const std::string half = R"({"v":1,"op":"half")";
  ASSERT_EQ(::send(silent[0].get(), half.data(), half.size(), MSG_NOSIGNAL), static_cast<ssize_t>(half.size()));
  const auto asked = std::chrono::steady_clock::now();
  const auto reply = query_node(endpoint.address(), {{"v", 1}, {"op", "status"}}, std::chrono::seconds(20));
  EXPECT_EQ(reply["op"], "status");
  EXPECT_LT(std::chrono::steady_clock::now() - asked, std::chrono::seconds(5)) << "held up by silent clients";
  // the half-sent request completes and is answered
  ASSERT_EQ(::send(silent[0].get(), "}\n", 2, MSG_NOSIGNAL), 2);
  std::string line;
  ASSERT_TRUE(worker::receive_node_line(silent[0].get(), line, nullptr,
                                        std::chrono::steady_clock::now() + std::chrono::seconds(20)));
  EXPECT_EQ(json::parse(line)["op"], "half");
  // a silent one is dropped (EOF), and the endpoint still answers
  line.clear();
  ASSERT_FALSE(worker::receive_node_line(silent[1].get(), line, nullptr,
                                         std::chrono::steady_clock::now() + std::chrono::seconds(20)));
  EXPECT_EQ(query_node(endpoint.address(), {{"v", 1}, {"op", "again"}})["op"], "again");
}

TEST(NodeEndpoint, AbstractAddressIsGoneWithIt) {
  std::string address;
  {
    NodeEndpoint endpoint(unique_address(), [](const json&) { return json::object(); });
    address = endpoint.address();
    EXPECT_EQ(query_node(address, {{"op", "status"}})["ok"], true);
  }
  EXPECT_THROW(query_node(address, {{"op", "status"}}), std::runtime_error);
}

TEST(NodeEndpoint, PathAddressIsRemovedAndAStaleOneReplaced) {
  TempDir dir;
  const auto path = (dir.path() / "node.sock").string();
  std::ofstream(path) << "a socket file left by a killed agent";
  {
    NodeEndpoint endpoint(path, [](const json&) { return json{{"x", 1}}; });
    EXPECT_EQ(query_node(path, {{"op", "status"}})["x"], 1);
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_THROW(NodeEndpoint("@", [](const json&) { return json(); }), std::invalid_argument);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa);
  socklen_t len = sizeof sa;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  ::close(fd);
  return ntohs(sa.sin_port);
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The agent of a 2-node run whose second node never comes: it waits in RENDEZVOUS, and answers.
TEST(NodeEndpointAgent, StatusWhileInRendezvous) {
  TempDir dir;
  const auto err = dir.path() / "err";
  const pid_t agent = ::fork();
  ASSERT_GE(agent, 0);
  if (agent == 0) {
    for (const char* name : {"SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NODEID", "ELASTRUN_JOB_DIR"})
      ::unsetenv(name);
    std::freopen(err.c_str(), "w", stderr);
    std::freopen("/dev/null", "w", stdout);
    const std::string endpoint = fmt::format("--rdzv-endpoint=127.0.0.1:{}", free_port());
    ::execl(ELASTRUN_BIN, ELASTRUN_BIN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-id=endpoint-test",
            "--rdzv-conf=is_host=1", "--rdzv-auth=none", "--node-rank=0", endpoint.c_str(), TEST_WORKER_BIN, nullptr);
    ::_exit(127);
  }
  const std::regex announced("node endpoint (@elastrun-node-[0-9]+-[^ \n]+)");
  std::smatch found;
  std::string text;
  for (int i = 0; i < 400; ++i) {
    text = slurp(err);
    if (std::regex_search(text, found, announced) && text.find("state RENDEZVOUS") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(!found.empty()) << text;
  const std::string address = found[1];
  EXPECT_NE(address.find(fmt::format("-{}-", agent)), std::string::npos) << address;
  json status;
  for (int i = 0; i < 40; ++i) {  // the state is set just before the log line
    status = query_node(address, {{"v", 1}, {"op", "status"}});
    if (status.value("state", "") == "RENDEZVOUS") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(status["ok"], true) << status.dump();
  EXPECT_EQ(status["state"], "RENDEZVOUS") << status.dump();
  EXPECT_EQ(status["pid"], agent);
  EXPECT_EQ(status["run_id"], "endpoint-test");
  EXPECT_TRUE(status["worker_pids"].empty()) << status.dump();
  // the CLI verb asks the same
  const int cli =
      std::system(fmt::format("{} node-status {} >{}/cli", ELASTRUN_BIN, address, dir.path().string()).c_str());
  EXPECT_EQ(WEXITSTATUS(cli), 0);
  EXPECT_EQ(json::parse(slurp(dir.path() / "cli"))["state"], "RENDEZVOUS");
  ::kill(agent, SIGTERM);
  int wstatus = 0;
  ASSERT_EQ(::waitpid(agent, &wstatus, 0), agent);
  EXPECT_THROW(query_node(address, {{"op", "status"}}), std::runtime_error) << "gone with the agent";
  const int gone = std::system(fmt::format("{} node-status {} 2>/dev/null", ELASTRUN_BIN, address).c_str());
  EXPECT_EQ(WEXITSTATUS(gone), 1);
}

// A worker asks its own agent (ELASTRUN_NODE_SOCKET): MONITOR, and its pid among the workers'.
TEST(NodeEndpointAgent, WorkersAskTheirAgent) {
  TempDir dir;
  const auto cmd = fmt::format(
      "env -u SLURM_JOB_ID -u SLURM_STEP_ID -u SLURM_PROCID {0} --standalone --nproc-per-node=1 /bin/sh -c "
      "'echo $$ >{1}/pid; {0} node-status >{1}/status' >/dev/null 2>{1}/err",
      ELASTRUN_BIN, dir.path().string());
  const int rc = std::system(cmd.c_str());
  ASSERT_EQ(WEXITSTATUS(rc), 0) << slurp(dir.path() / "err");
  const auto status = json::parse(slurp(dir.path() / "status"));
  EXPECT_EQ(status["state"], "MONITOR") << status.dump();
  EXPECT_EQ(status["world_size"], 1);
  const int worker = std::stoi(slurp(dir.path() / "pid"));
  EXPECT_EQ(status["worker_pids"], json::array({worker})) << status.dump();
}

}  // namespace
}  // namespace elastrun::launcher
