// Partner copies of the memory checkpoint tier between agents (docs/launcher.md, "Partner
// copies"). Each agent with --memory-checkpoints in a job of two or more nodes listens on a TCP
// port of its node's address (published in the rendezvous store as memory-peer/<member key>)
// and, for the whole job:
//   - sends each snapshot its workers commit to its partner, the next member of the round in
//     round order (one thread; a newer step of a rank replaces an older one still queued), which
//     keeps it as a replica (MemorySegments::Origin::Replica);
//   - after each round forms, makes sure it holds, for each of its new ranks, the snapshot of
//     the newest step that is complete job-wide (every rank of that step's world held by some
//     live member): a replica it holds becomes its own, anything else is fetched from a peer
//     that holds it. Its workers' memory requests wait for that (a bounded wait), so their
//     restore finds the snapshots here as if their own node had written them.
// One request per connection, authenticated like the rendezvous store (token or munge, the
// run's): a JSON line {"v","op","run","auth","credential",...}, a JSON line back, the segment's
// bytes after it where the operation moves one.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "elastrun/rdzv/auth.hpp"
#include "elastrun/util/unique_fd.hpp"
#include "memory_segments.hpp"

namespace elastrun::launcher {

struct PeerCredentials {
  rdzv::AuthConfig auth;
  std::string run_id;
};

// What a node does after a re-form so that each of its ranks finds its snapshot of `step` here.
struct FetchPlan {
  std::uint64_t step = 0;        // the newest step usable job-wide
  std::uint64_t generation = 0;  // the round that wrote it
  int world = 0;                 // the world size that wrote it
  std::vector<int> adopt;        // ranks of `step` held here as replicas: they become this node's
  // ranks of `step` to fetch, each with the peers that hold it (indices into `peers`), best first
  std::vector<std::pair<int, std::vector<std::size_t>>> fetch;
  std::vector<int> stale;  // ranks of `step` held here from another round: dropped before the fetch
};

// The pure decision, unit-tested with canned holdings. `mine`: this node's committed segments;
// `peers[i]`: peer i's (empty if it did not answer); `local_ranks`: this node's ranks in the new
// round, `new_world` its world size. A step is usable when every rank the new world restores
// from is held by someone -- every rank of the world that wrote it, or its first `new_world` when
// the world shrank (replicated state; sharded state restores from memory at the same world only) --
// all written in one round (snapshots of one step from two rounds are two histories: never
// mixed). A rank beyond the step's world takes rank % world's snapshot (replicated state).
// std::nullopt when no step is usable.
std::optional<FetchPlan> plan_fetches(const std::vector<MemorySegments::Held>& mine,
                                      const std::vector<std::vector<MemorySegments::Held>>& peers,
                                      const std::vector<int>& local_ranks, int new_world);

// The client side, one request per call; each throws std::runtime_error naming the peer.
std::vector<MemorySegments::Held> peer_list(const std::string& address, const PeerCredentials& credentials,
                                            std::chrono::milliseconds timeout);
// Sends a pinned segment; false when the peer holds it already.
bool peer_push(const std::string& address, const PeerCredentials& credentials, const MemorySegments::Pinned& segment,
               std::chrono::milliseconds timeout);
// Fetches (step, rank) into `into` with `origin`; false when this node holds it already. With
// `generation`, a copy written in another round is refused (throws).
bool peer_fetch(const std::string& address, const PeerCredentials& credentials, std::uint64_t step, int rank,
                MemorySegments& into, MemorySegments::Origin origin, std::chrono::milliseconds timeout,
                std::optional<std::uint64_t> generation = std::nullopt);

class MemoryPeers {
 public:
  // Listens on bind_address (any free port). Throws std::system_error when it cannot.
  MemoryPeers(MemorySegments& segments, PeerCredentials credentials, const std::string& bind_address);
  ~MemoryPeers();  // stops both threads; open transfers end at their next read or write
  MemoryPeers(const MemoryPeers&) = delete;
  MemoryPeers& operator=(const MemoryPeers&) = delete;

  const std::string& address() const { return address_; }  // host:port

  struct Round {
    std::uint64_t generation = 0;
    std::vector<std::string> peers;  // the other members' addresses in round order, starting after us
    std::vector<int> local_ranks;
    int world_size = 0;  // the round's
  };
  // A new round: the partner is peers[0]; queued copies of the last round are dropped; the fetch
  // for local_ranks starts (memory requests of the workers wait for it: wait_for_fetch).
  void new_round(Round round);
  // A worker committed (step, rank): it is sent to the partner in the background.
  void committed(std::uint64_t step, int rank);
  // Until this round's fetch is done, at most `timeout`.
  void wait_for_fetch(std::chrono::milliseconds timeout);
  // The copy of (step, rank) here failed its checksum (a reader says so): replaced by a peer's copy
  // of the same round, if a member of the round holds one. Throws std::runtime_error saying why not.
  void refetch(std::uint64_t step, int rank);

  // Copies this agent sent and received (status, tests).
  struct Counts {
    std::uint64_t pushed = 0, received = 0, fetched = 0, adopted = 0, push_failures = 0;
  };
  Counts counts() const;

 private:
  void serve();
  void serve_one(int fd);
  void work();
  void fetch_for(const Round& round);
  void push_pending();
  bool peer_list_has(const std::string& peer, std::uint64_t step, int rank, std::uint64_t generation);

  MemorySegments& segments_;
  const PeerCredentials credentials_;
  util::UniqueFd listener_;
  std::string address_;
  util::UniqueFd wake_read_, wake_write_;

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  bool stopping_ = false;
  std::optional<Round> round_to_fetch_;
  bool fetching_ = false;
  std::string partner_;
  std::vector<std::string> peers_;  // the round's other members
  // tests only (ELASTRUN_TEST_FLIP_MEMORY_STEP): once sent to the partner, this node's own segments of
  // that step get one byte flipped -- a copy here that fails its checksum while the partner's is good
  std::optional<std::uint64_t> flip_step_;
  std::uint64_t generation_ = 0;
  std::map<int, std::uint64_t> to_push_;  // rank -> newest committed step not yet sent
  std::string failing_partner_;           // the partner whose last copy failed (logged once)
  Counts counts_;

  struct Handler {
    std::thread thread;
    util::UniqueFd socket;  // closed once its thread is joined
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::mutex handlers_mutex_;
  std::vector<Handler> handlers_;  // one per open connection (bounded); the finished ones joined at the next accept
  std::thread server_;
  std::thread worker_;
};

}  // namespace elastrun::launcher
