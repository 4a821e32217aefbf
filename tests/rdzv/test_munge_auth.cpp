// MUNGE authentication with a real munged (own key and socket, started and stopped by PID by
// this test): the job's user is admitted; a missing, forged, replayed or foreign-run credential,
// and a credential of another user, are refused on both sides with a clear reason.
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <thread>

#include "elastrun/rdzv/auth.hpp"
#include "elastrun/rdzv/store.hpp"
#include "support/daemon.hpp"

namespace {

using namespace elastrun::rdzv;
using namespace std::chrono_literals;

class Munged : public testing::Environment {
 public:
  static inline std::string socket;

  void SetUp() override {
    using elastrun::testing_support::Daemon;
    socket = (munged_.dir() / "sock").string();
    const auto key = (munged_.dir() / "key").string();
    if (elastrun::testing_support::run_command({"mungekey", "--create", "--keyfile=" + key}) != 0)
      Daemon::die("mungekey could not create " + key + " (install munge)");
    munged_.start({"munged", "--foreground", "--force", "--socket=" + socket, "--key-file=" + key,
                   "--pid-file=" + (munged_.dir() / "pid").string(), "--log-file=" + (munged_.dir() / "log").string(),
                   "--seed-file=" + (munged_.dir() / "seed").string()},
                  [] {
                    try {
                      make_credential(AuthConfig{AuthKind::Munge, "", socket, ""}, "probe");
                      return true;
                    } catch (const AuthError&) {
                      return false;
                    }
                  });
  }

 private:
  elastrun::testing_support::Daemon munged_{"munge"};
};

// gtest takes ownership of environments through a raw pointer.
const auto* const kMunged = testing::AddGlobalTestEnvironment(std::make_unique<Munged>().release());

AuthConfig munge() { return {AuthKind::Munge, "", Munged::socket, ""}; }

StoreServer server() {
  StoreServerOptions o;
  o.bind_address = "127.0.0.1";
  o.run_id = "job-42";
  o.auth = munge();
  return StoreServer(o);
}

TEST(MungeAuth, JobUserIsAdmitted) {
  auto s = server();
  StoreClient c("127.0.0.1", s.port(), munge(), "job-42");
  c.set("k", "v");
  EXPECT_EQ(c.get("k")->value, "v");
}

TEST(MungeAuth, MissingCredentialIsRefused) {
  auto s = server();
  try {
    StoreClient c("127.0.0.1", s.port(), AuthConfig{}, "job-42");
    FAIL() << "admitted without a credential";
  } catch (const StoreError& e) {
    EXPECT_EQ(e.kind(), StoreErrorKind::AuthFailed);
    EXPECT_EQ(std::string(e.what()).find("munge"), std::string::npos)
        << "the refusal names the store's auth: " << e.what();
  }
  EXPECT_EQ(s.stats().keys, 0u);
}

TEST(MungeAuth, CredentialIsCheckedForRunUserAndReplay) {
  auto config = munge();
  auto cred = make_credential(config, "job-42");
  EXPECT_FALSE(check_credential(config, "munge", cred, "job-42")) << "a fresh credential is valid";
  auto replay = check_credential(config, "munge", cred, "job-42");
  ASSERT_TRUE(replay) << "a replayed credential was accepted";
  EXPECT_NE(replay->find("MUNGE credential rejected"), std::string::npos) << *replay;

  auto other_run = check_credential(config, "munge", make_credential(config, "job-7"), "job-42");
  ASSERT_TRUE(other_run);
  EXPECT_NE(other_run->find("job-7"), std::string::npos) << *other_run;

  auto forged = check_credential(config, "munge", "MUNGE:not-a-credential:", "job-42");
  ASSERT_TRUE(forged);
}

TEST(MungeAuth, CredentialOfAnotherUserIsRefused) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to mint a credential as another user";
  auto* nobody = getpwnam("nobody");
  ASSERT_NE(nobody, nullptr);
  // Mint the credential in a child running as `nobody`, hand it back through a pipe.
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(fds[0]);
    if (setgid(nobody->pw_gid) != 0 || setuid(nobody->pw_uid) != 0) _exit(2);
    try {
      auto cred = make_credential(munge(), "job-42");
      if (write(fds[1], cred.data(), cred.size()) != static_cast<ssize_t>(cred.size())) _exit(3);
    } catch (...) {
      _exit(4);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string cred;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) cred.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  auto refusal = check_credential(munge(), "munge", cred, "job-42");
  ASSERT_TRUE(refusal) << "a credential of uid " << nobody->pw_uid << " was accepted by uid " << getuid();
  EXPECT_NE(refusal->find("uid"), std::string::npos) << *refusal;
}

}  // namespace
