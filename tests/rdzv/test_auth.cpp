// --rdzv-auth=auto (resolve_auth): never none; a user's token first; a generated token shared
// through a private file on one host; an error across hosts without munge. Also the literal
// loopback test and the bind address the bootstrap picks.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/bootstrap.hpp"
#include "elastrun/rdzv/net.hpp"

namespace fs = std::filesystem;
using namespace elastrun::rdzv;

namespace {

// A private $TMPDIR, no token variables and an unreachable munged, restored at the end.
class AutoAuth : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("elastrun-auth-test-" + std::to_string(::getpid()));
    fs::create_directories(dir_);
    for (const char* name : {"TMPDIR", "ELASTRUN_RDZV_TOKEN", "ELASTRUN_RDZV_TOKEN_FILE", "SLURM_ELASTRUN_TOKEN",
                             "ELASTRUN_MUNGE_SOCKET", "SLURM_CONF"})
      if (const char* v = std::getenv(name)) saved_.emplace_back(name, v);
    ::setenv("TMPDIR", dir_.c_str(), 1);
    ::setenv("ELASTRUN_MUNGE_SOCKET", (dir_ / "no-munged.socket").c_str(), 1);
    for (const char* name : {"ELASTRUN_RDZV_TOKEN", "ELASTRUN_RDZV_TOKEN_FILE", "SLURM_ELASTRUN_TOKEN", "SLURM_CONF"})
      ::unsetenv(name);
  }
  void TearDown() override {
    for (const char* name : {"TMPDIR", "ELASTRUN_MUNGE_SOCKET"}) ::unsetenv(name);
    for (const auto& [name, value] : saved_) ::setenv(name.c_str(), value.c_str(), 1);
    fs::remove_all(dir_);
  }
  fs::path dir_;
  std::vector<std::pair<std::string, std::string>> saved_;
};

TEST_F(AutoAuth, OneHostGeneratesOnePrivateTokenThatEveryAgentOfTheRunShares) {
  auto first = resolve_auth("auto", {.run_id = "r/1", .one_host = true});
  auto second = resolve_auth("auto", {.run_id = "r/1", .one_host = true});
  EXPECT_EQ(first.kind, AuthKind::Token);
  EXPECT_EQ(first.token.size(), 48u);
  EXPECT_EQ(second.token, first.token) << "the second agent must read the first one's token";
  EXPECT_EQ(first.token_file, token_file_path("r/1"));
  EXPECT_EQ(fs::path(first.token_file).filename(), "rdzv-r_1.token") << "a run id cannot leave the directory";
  struct stat st {};
  ASSERT_EQ(::stat(first.token_file.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(fs::path(first.token_file).parent_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  EXPECT_NE(resolve_auth("auto", {.run_id = "r2", .one_host = true}).token, first.token) << "one token per run";
}

TEST_F(AutoAuth, ADirectoryOthersCanEnterIsRefused) {
  const auto dir = dir_ / ("elastrun-" + std::to_string(::getuid()));
  fs::create_directories(dir);
  fs::permissions(dir, fs::perms::all);
  try {
    resolve_auth("auto", {.run_id = "r", .one_host = true});
    FAIL() << "a world-writable token directory was used";
  } catch (const AuthError& e) {
    EXPECT_NE(std::string(e.what()).find("not a private directory"), std::string::npos) << e.what();
  }
}

TEST_F(AutoAuth, AUsersTokenComesFirst) {
  ::setenv("ELASTRUN_RDZV_TOKEN", "given", 1);
  auto config = resolve_auth("auto", {.run_id = "r", .one_host = false});
  ::unsetenv("ELASTRUN_RDZV_TOKEN");
  EXPECT_EQ(config.kind, AuthKind::Token);
  EXPECT_EQ(config.token, "given");
  EXPECT_TRUE(config.token_file.empty());
  ::setenv("SLURM_ELASTRUN_TOKEN", "from-the-plugin", 1);
  EXPECT_EQ(resolve_auth("auto", {.run_id = "r", .one_host = true}).token, "from-the-plugin");
  ::unsetenv("SLURM_ELASTRUN_TOKEN");
}

TEST_F(AutoAuth, SeveralHostsWithoutMungeIsAnErrorNeverNone) {
  try {
    auto config = resolve_auth("auto", {.run_id = "r", .one_host = false});
    FAIL() << "auto resolved to " << to_string(config.kind) << " without munged";
  } catch (const AuthError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ELASTRUN_RDZV_TOKEN"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_EQ(resolve_auth("none", {.run_id = "r", .one_host = false}).kind, AuthKind::None) << "none when asked";
}

TEST(Net, LoopbackNamesAreLiteral) {
  for (const char* host : {"localhost", "127.0.0.1", "127.1.2.3", "::1"}) EXPECT_TRUE(is_loopback_host(host)) << host;
  for (const char* host : {"vm", "n1", "10.0.0.1", "128.0.0.1", ""}) EXPECT_FALSE(is_loopback_host(host)) << host;
  EXPECT_EQ(ipv4_address("127.0.0.1"), "127.0.0.1");
  EXPECT_FALSE(ipv4_address("no-such-host.invalid"));
}

BootstrapOverrides overrides(const std::string& endpoint, std::optional<bool> is_host = std::nullopt,
                             const std::string& local_addr = "") {
  return {
      .endpoint = endpoint, .run_id = "r", .is_host = is_host, .nproc = 1, .role = "default", .local_addr = local_addr};
}

TEST(Bootstrap, StoresListenOnLoopbackForALoopbackEndpointAndOnTheGivenLocalAddress) {
  DetectedEnv env;
  auto plan = plan_bootstrap(env, overrides("localhost:29400"));
  EXPECT_EQ(plan.bind_address, "127.0.0.1");
  EXPECT_TRUE(plan.host_store) << "torchrun: an endpoint naming this machine hosts the store";
  EXPECT_TRUE(plan.host_store_inferred);
  plan = plan_bootstrap(env, overrides("127.0.0.1:29400", false));
  EXPECT_FALSE(plan.host_store);
  EXPECT_FALSE(plan.host_store_inferred);
  plan = plan_bootstrap(env, overrides("192.0.2.7:29400", std::nullopt, "192.0.2.8"));
  EXPECT_EQ(plan.bind_address, "192.0.2.8");
  EXPECT_TRUE(plan.bind_note.empty());
  EXPECT_EQ(plan.me.address, "192.0.2.8");
}

TEST(Bootstrap, TheRunIdDefaultsToTorchrunsNoneOutsideSlurm) {
  DetectedEnv env;
  auto o = overrides("localhost:29500");
  o.run_id = "";
  EXPECT_EQ(plan_bootstrap(env, o).run_id, "none");
}

}  // namespace
