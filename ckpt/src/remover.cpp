// Background removal of retired checkpoint directories (see remove_in_background in
// internal.hpp). Unlinking a step's shard files can take rank 0 a large part of a second (ext4
// mounted with `discard`, Lustre), and every rank waits for rank 0's commit broadcast; so the
// save only renames a retired step to a name readers ignore, and this thread deletes it.
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

#include "internal.hpp"

namespace elastrun::ckpt::detail {

namespace fs = std::filesystem;

namespace {

// The key under which a path is queued: removal_pending() must recognise it whether the caller
// spelled the root as "ckpt", "./ckpt/" or absolute. Lexical only (no stat: the path is being
// deleted); a root reached through a different symlink is not recognised, which costs only a
// redundant, harmless remove_all in remove_partial_directories.
fs::path removal_key(const fs::path& path) {
  std::error_code ec;
  fs::path absolute = fs::absolute(path, ec);
  if (ec) absolute = path;
  return absolute.lexically_normal();
}

void remove_now(const fs::path& doomed) noexcept {
  std::error_code ec;
  // Errors are ignored: the directory keeps its partial name, so restore ignores it and the next
  // save's remove_partial_directories retries.
  fs::remove_all(doomed, ec);
}

class Remover {
 public:
  Remover() = default;
  Remover(const Remover&) = delete;
  Remover& operator=(const Remover&) = delete;

  // Process exit: finish what was queued (no leftovers in the normal case), then join.
  ~Remover() {
    if (!owned_by_this_process()) {
      // exit() in a child forked from the owner: the worker thread exists only in the parent,
      // which goes on removing; joining here would wait forever.
      if (worker_.joinable()) worker_.detach();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_.notify_all();
    // worker_ (the last member) is joined first among the members, after it drained the queue.
  }

  void enqueue(const fs::path& doomed) {
    if (!owned_by_this_process()) {
      // A forked child must not touch the mutex (another thread of the parent may have held it
      // at fork()) nor rely on a worker thread it does not have: remove synchronously, as before.
      remove_now(doomed);
      return;
    }
    try {
      Item item{doomed, removal_key(doomed)};
      std::lock_guard lock(mutex_);
      if (!worker_.joinable()) {
        // Started lazily: processes that never retire a step never get the thread.
        worker_ = std::jthread([this] { run(); });
      }
      queue_.push_back(std::move(item));
    } catch (...) {
      // No thread or no memory for the queue: fall back to removing it here, as before.
      remove_now(doomed);
      return;
    }
    work_.notify_one();
  }

  bool pending(const fs::path& path) {
    if (!owned_by_this_process()) return false;  // this child queued nothing
    const fs::path key = removal_key(path);
    std::lock_guard lock(mutex_);
    if (current_ && *current_ == key) return true;
    for (const auto& item : queue_) {
      if (item.key == key) return true;
    }
    return false;
  }

  void wait_idle() {
    if (!owned_by_this_process()) return;
    std::unique_lock lock(mutex_);
    idle_.wait(lock, [&] { return queue_.empty() && !current_; });
  }

 private:
  struct Item {
    fs::path path;
    fs::path key;
  };

  bool owned_by_this_process() const { return ::getpid() == owner_; }

  // The worker: removes queued paths one at a time until told to stop with an empty queue.
  // Nothing escapes it (an exception leaving a thread function calls std::terminate).
  void run() noexcept {
    std::unique_lock lock(mutex_);
    while (true) {
      work_.wait(lock, [&] { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;  // stopping, and everything queued is done
      Item item = std::move(queue_.front());
      queue_.pop_front();
      current_ = std::move(item.key);  // still "pending" while it is being removed
      lock.unlock();
      try {
        // Tests block or fail a removal here. A throwing hook skips this removal, as a failed
        // removal would: the directory keeps its partial name and the next save removes it.
        fault_point("remover.before_remove", 0);
        remove_now(item.path);
      } catch (...) {
      }
      lock.lock();
      current_.reset();
      if (queue_.empty()) idle_.notify_all();
    }
  }

  const pid_t owner_ = ::getpid();  // the process whose static this is (see enqueue)
  std::mutex mutex_;
  std::condition_variable work_;  // queue_ gained an item, or stopping_
  std::condition_variable idle_;  // queue_ empty and nothing in progress
  std::deque<Item> queue_;
  std::optional<fs::path> current_;  // key of the path being removed now
  bool stopping_ = false;
  std::jthread worker_;  // last: destroyed (joined) before the state it uses
};

// Set by the first remove_in_background. Until then nothing can be pending, and the other
// entry points do not create the Remover: a process that forks before it ever retired a step
// (the crash tests, a snapshot writer) leaves its children free to start their own worker.
std::atomic<bool> remover_used{false};

Remover& remover() {
  // Function-local static: constructed on first use, destroyed at exit (draining the queue).
  static Remover instance;
  return instance;
}

}  // namespace

void remove_in_background(const fs::path& doomed) {
  remover_used = true;
  remover().enqueue(doomed);
}

bool removal_pending(const fs::path& path) { return remover_used && remover().pending(path); }

void wait_for_background_removals() {
  if (remover_used) remover().wait_idle();
}

}  // namespace elastrun::ckpt::detail
