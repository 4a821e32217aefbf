// Elastic membership: agents (one per node) meet in numbered rounds ("generations") through a
// KvBackend, agree on the members, get stable ranks, and re-form when a member is lost or a
// new one waits. The protocol and its keys are described in docs/rendezvous.md.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "elastrun/rdzv/kv.hpp"

namespace elastrun::rdzv {

class RendezvousError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The job is over (an agent closed the rendezvous after success or a final failure).
// what(): "rendezvous '<run>' is closed: <reason>"; reason(): what the closing agent gave.
class RendezvousClosed : public RendezvousError {
 public:
  RendezvousClosed(const std::string& run_id, std::string reason);
  const std::string& reason() const { return reason_; }

 private:
  std::string reason_;
};

// No round could form for `--partition-timeout`: this side of a partition never had a quorum
// (docs/rendezvous.md, "Partitions"). what(): "partitioned from N of M members for S s; ...".
class NoQuorum : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

// MIN:MAX nodes of one component of a heterogeneous job.
struct NodeBounds {
  int min = 1;
  int max = 1;
};

struct MemberInfo;

// A wait without quorum, as told to RendezvousConfig::on_quorum_wait.
struct QuorumWait {
  bool waiting = true;                   // false: a round formed again after the wait
  int members = 0;                       // of the last round formed (the base of the quorum)
  int present = 0;                       // of those, in this round
  std::vector<std::string> unreachable;  // node names: absent and not confirmed gone
  std::string store_node;                // whose store this side is on ("" the first one)
  std::int64_t waited_ms = 0;
};

struct RendezvousConfig {
  std::string run_id;
  int min_nodes = 1;
  int max_nodes = 1;
  Millis join_timeout{600'000};    // until `min_nodes` have joined
  Millis last_call_timeout{1000};  // after `min_nodes` joined, wait this long for more
  Millis heartbeat_timeout{3000};  // a member silent this long is declared dead
  // Heterogeneous jobs (--het-nnodes): bounds per het component, indexed by component. A round
  // then closes only with at least MIN members of every component, takes at most MAX of each
  // (the rest wait as that component's spares), and a waiting member triggers a scale-up only
  // when its own component has room. Empty: only the job-wide min_nodes/max_nodes apply.
  std::vector<NodeBounds> component_bounds;
  // Partitions (docs/rendezvous.md): a round after the first closes only with a strict majority
  // of the last round's members, or when every absent member is confirmed gone -- its agent's
  // process is known dead (a member on this host: kill(pid, 0)) or `confirmed_gone` says so (the
  // launcher asks Slurm: node DOWN, NOT_RESPONDING, FAIL or no longer in the job).
  std::function<bool(const MemberInfo&)> confirmed_gone;
  // Without a quorum for this long, next_round() throws NoQuorum. 0: join_timeout.
  Millis partition_timeout{0};
  // Told when a wait without quorum begins or who is unreachable changes (waiting), and when a
  // round forms again after one (!waiting). Called on the thread that called next_round().
  std::function<void(const QuorumWait&)> on_quorum_wait;
  // The first store, where the halves of a healed partition meet again (standbys are known
  // from the rosters). Empty: not probed.
  std::string primary_address;
  std::uint16_t primary_port = 0;
};

// One agent as the others see it. Order in a round: (het component, node index, node name, pid),
// never host name sort, so group ranks follow SLURM_NODEID and survivors keep their order. The
// pid makes the identity one per agent process, not one per host: two agents on one node (two
// tasks per node after a requeue, or torchrun-style agents on one box without --node-rank) are
// two members, never one world formed twice with the same ranks.
struct MemberInfo {
  std::string node_name;  // e.g. SLURMD_NODENAME
  std::string address;    // how peers reach this node (IP or resolvable name)
  int het_component = 0;
  int node_index = 0;  // index in the job's node list
  int nproc = 1;       // workers on this node
  std::string role = "default";
  std::int64_t pid = 0;           // the agent's; part of the identity
  std::uint16_t master_port = 0;  // reserved at join; group rank 0's becomes MASTER_PORT
  std::uint16_t store_port = 0;   // this agent's standby store (0: none), for failover

  std::string sort_key() const;  // fixed-width, so key order is round order
};

struct RoundResult {
  std::uint64_t generation = 0;
  // The round's members, one line each in group-rank order (format in docs/rendezvous.md).
  // An agent needs only its own ranks, computed without materialising the list; members()
  // parses it on first use (at 1024 nodes the parsed copy is ~130 KB per agent).
  std::string roster;
  const std::vector<MemberInfo>& members() const;
  int group_rank = 0;
  int group_world_size = 0;
  int rank_offset = 0;  // global rank of this node's first worker
  int world_size = 0;   // total workers
  int role_rank_offset = 0;
  int role_world_size = 0;
  std::string master_addr;
  std::uint16_t master_port = 0;

 private:
  mutable std::optional<std::vector<MemberInfo>> parsed_members_;
};

// The quorum rule, a pure function (unit-tested with canned members): may a round close that
// `joined` members of `base` (the last round formed) joined? Yes for a first formation (empty
// base), with a strict majority of base, or when every absent member is `gone`. `gone` is asked
// only when there is no majority (it may ask slurmctld).
struct QuorumVerdict {
  bool ok = true;
  int present = 0;
  int members = 0;
  std::vector<std::string> unreachable;  // absent and not gone (node names)
};
QuorumVerdict decide_quorum(const std::vector<MemberInfo>& base, const std::function<bool(const MemberInfo&)>& joined,
                            const std::function<bool(const MemberInfo&)>& gone);

// Fenced commits (docs/rendezvous.md, "Fenced commits"): what a checkpoint commit of this node
// is checked against -- its round, on the store the round formed on. A copy, taken on the
// agent's thread after each round, for the thread that answers the workers.
struct CommitFence {
  std::string store_address;  // "" : the first store (the agent's own endpoint)
  std::uint16_t store_port = 0;
  std::string prefix;  // "elastrun/<run id>/"
  std::uint64_t generation = 0;
  std::uint64_t lease = 0;
  std::string token;                     // "<requeues>.<generation>": orders rounds across failovers and requeues
  std::vector<std::string> member_keys;  // the round's members (MemberInfo::sort_key)
};

// Checks, on the store `kv` (the round's), that a commit of `what` (e.g. ".../step-42") by the
// round of `fence` may go ahead, and records it: the store's generation is still the round's, a
// strict majority of the round's members hold live leases there, our own lease is live (a keyed
// write under it), and the record `elastrun/<run>.commits/step/<what>` moves to our token by compare-and-set unless a
// newer round's token is there. Returns "" to go ahead, else why not (one line). A store that
// cannot be reached is a "no": a node cut off from the quorum commits nothing.
std::string fence_commit(KvBackend& kv, const CommitFence& fence, std::string_view what);

enum class Change {
  None,           // timeout: nothing happened
  MemberLost,     // a member of the round died or went silent
  MemberWaiting,  // a node waits to join and the round has room: scale up
  Reform,         // another agent started a new round (failure elsewhere, restart request)
  Fenced,         // we were declared dead: our lease is gone
  Closed,         // the rendezvous was closed
  StoreLost,      // the store is unreachable; next_round() fails over to a standby
};
std::string_view to_string(Change change);

// What wait_for_change() learnt about a member it reported lost (Change::MemberLost).
struct MemberLoss {
  std::string node_name;
  // How the store ended its lease: "holder disconnected" (the agent died: seen at once),
  // "missed its keep-alives" (a silent node), "revoked by its holder"; "" if the backend does
  // not say (etcd).
  std::string how;
  std::optional<std::int64_t> since_heartbeat_ms;  // from its last keep-alive to its loss
};

// Opens a connection to the store at address:port (used to fail over to a standby store).
using StoreConnector = std::function<std::unique_ptr<KvBackend>(const std::string& address, std::uint16_t port)>;

// Not thread-safe: one thread (the agent's main loop) calls next_round/wait_for_change/...;
// the object's own heartbeat thread only touches the heartbeat connection. To react to local
// events while waiting for a change, call wait_for_change with a short timeout in a loop.
class Rendezvous {
 public:
  // `kv` carries the protocol; `heartbeat_kv` (a second connection) holds this member's lease
  // and sends its keep-alives from a thread, so a busy agent is never mistaken for a dead one.
  // With a `connector`, losing the store is survivable: every member runs a standby store
  // (MemberInfo::store_port) and the survivors move to the first reachable one in round order,
  // where the next round rebuilds the state (docs/rendezvous.md, "No single point of failure").
  Rendezvous(std::unique_ptr<KvBackend> kv, std::unique_ptr<KvBackend> heartbeat_kv, RendezvousConfig config,
             MemberInfo me, StoreConnector connector = {});
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // Joins the current round if it is still forming, else waits for the next; blocks until a
  // round including us completes. Throws RendezvousError (too few nodes within join_timeout)
  // or RendezvousClosed.
  // The result stays valid until the next call.
  const RoundResult& next_round();

  // While a round runs: blocks until something calls for a new round, or `timeout`.
  Change wait_for_change(Millis timeout);

  // After wait_for_change() said StoreLost: reconnect to the same store and take a new lease
  // there, trying again while the link may still be cut (timeouts, not refusals) for up to a
  // heartbeat timeout. A link that flapped then costs one re-form, not two: the others,
  // re-forming after our old lease ended, find us alive and wait for us instead of forming
  // without us first. False if the store does not answer by then or refuses (next_round() fails
  // over as usual). The agent calls it on a thread of its own while it stops its workers: no other call
  // of this object may run meanwhile (the heartbeat thread is fine).
  bool reconnect_to_the_same_store();

  // After a local worker failure, before it is counted against the restart budget: is every
  // other member of the round alive? A worker dies of a broken collective ("Connection reset by
  // peer") within ~0.1 s of a peer node's death, long before a store that learns of deaths by
  // lease expiry (etcd: whole seconds) reports the loss. So this asks every member's agent to
  // answer (one probe key per round that wait_for_change watches and answers; the answers lie
  // outside the watched prefix, so N answers do not wake N agents each) and waits up to
  // `timeout` (the heartbeat timeout: by then a dead member's lease has ended too).
  struct Confirmation {
    Change change = Change::None;          // a change seen meanwhile (MemberLost, Reform, ...)
    std::vector<std::string> unconfirmed;  // members (node names) that did not answer in time
  };
  Confirmation confirm_members(Millis timeout);

  // Starts a new round (after a worker failure); everyone's wait_for_change returns Reform.
  void request_new_round();
  // Ends the rendezvous for everyone (job finished or failed for good).
  void close(std::string_view reason);
  // Job-wide counter (e.g. restarts against --max-restarts): add and return the new value.
  std::int64_t add_to_counter(std::string_view name, std::int64_t delta);
  // A barrier among the current round's members (e.g. the exit barrier); false on timeout.
  bool barrier(std::string_view name, Millis timeout);

  const RoundResult& current() const { return round_; }
  // The member behind the last Change::MemberLost, if any.
  const std::optional<MemberLoss>& last_loss() const { return last_loss_; }
  // The node whose standby store we failed over to, "" while on the first store.
  const std::string& store_node() const { return store_node_; }
  // The current round's fence for checkpoint commits; `requeues` goes into its token.
  CommitFence commit_fence(std::uint64_t requeues) const;

 private:
  std::uint64_t current_generation();
  bool advance_generation(std::uint64_t from);
  void ensure_alive();
  std::optional<RoundResult> try_form(std::uint64_t gen);
  bool try_close(std::uint64_t gen);
  // The round's result for this member, std::nullopt if the roster does not include us.
  std::optional<RoundResult> finish_round(std::uint64_t gen, std::string roster, std::uint64_t revision);
  void wait_as_late_joiner(std::uint64_t gen);
  void heartbeat_loop();
  std::string answers_prefix(std::uint64_t gen) const;  // confirm_members' answers of round gen
  void answer_probe(std::uint64_t gen);
  // A re-form need not wait for the last call when every live agent of the job has joined.
  bool every_live_agent_joined(std::uint64_t gen);
  void fail_over();
  bool component_has_room(int component) const;  // for a waiting member (component_bounds)
  // ---- partitions (docs/rendezvous.md, "Partitions") ----
  // Moves both connections to the store at address:port (a standby, or the primary after a heal).
  void switch_store(std::unique_ptr<KvBackend> kv, std::unique_ptr<KvBackend> hb, const std::string& node,
                    const std::string& address, std::uint16_t port);
  void seed_base();  // our last round's roster on a store we moved to: the quorum's base there
  // The newest generation at or below `from` with a roster on `kv` (0: none).
  std::uint64_t latest_formed(KvBackend& kv, std::uint64_t from);
  bool quorum_for(std::uint64_t gen, const std::vector<KeyValue>& joins);  // false: wait
  bool gone(const MemberInfo& m);
  bool move_if_the_job_is_elsewhere();  // during a wait without quorum, every few seconds
  void tell_quorum_wait(bool waiting, const QuorumVerdict& v);
  // A keep-alive unanswered this long: the store is unreachable (the heartbeat connection's
  // reply timeout). Sent every 1/4 heartbeat, so it fires about 3/4 heartbeat after the last
  // renewal: before the others can declare us dead (for heartbeat timeouts of 2 s and more).
  Millis keep_alive_patience() const { return std::max(config_.heartbeat_timeout / 2, Millis(1000)); }

  std::unique_ptr<KvBackend> kv_;
  std::unique_ptr<KvBackend> heartbeat_kv_;
  RendezvousConfig config_;
  MemberInfo me_;
  std::string prefix_;
  std::string my_key_;
  std::uint64_t lease_ = 0;
  std::atomic<bool> fenced_{false};
  std::atomic<bool> store_lost_{false};
  bool failed_over_ = false;  // moved to a standby store since the last round formed
  StoreConnector connector_;
  std::atomic<bool> stop_{false};
  std::mutex heartbeat_mutex_;  // the heartbeat connection is shared with re-leasing
  std::mutex stop_mutex_;
  std::condition_variable stop_cv_;
  std::thread heartbeat_;
  RoundResult round_;
  std::vector<MemberInfo> standbys_;  // wait list: the running round's members, for failover
  std::uint64_t watch_revision_ = 0;
  std::optional<MemberLoss> last_loss_;
  std::string store_node_;
  std::string store_address_;
  std::uint16_t store_port_ = 0;  // 0: the first store (config primary)
  std::optional<std::chrono::steady_clock::time_point> no_quorum_since_;
  std::chrono::steady_clock::time_point next_probe_{};
  // next_round()'s join deadline; a wait without quorum that ends without a round starts it anew
  // (the join timeout counts from when a quorum is there again)
  std::chrono::steady_clock::time_point join_deadline_{};
  std::vector<std::string> told_unreachable_;
  std::vector<std::string> gone_;  // sort keys confirmed gone (stays true)

 public:
  // Small job-wide records (failure reports, stop requests), under "<prefix>pub/". They live as
  // long as the store; after a failover to a standby store earlier records are gone.
  // Sets `key`; with `only_if_absent` only the first writer wins. True if this call wrote it.
  bool publish(std::string_view key, std::string_view value, bool only_if_absent = false);
  std::optional<std::string> read(std::string_view key);
  // Every record whose key starts with `key_prefix`: (key, value) in key order.
  std::vector<std::pair<std::string, std::string>> read_prefix(std::string_view key_prefix);
  // Why the rendezvous was closed, nullopt while it is open (an agent that does not join asks).
  std::optional<std::string> closed_reason();

  // The store host's clock read between two readings of ours (wall clock, ms since the epoch),
  // nullopt where the store cannot say its time (etcd). The offset is store - midpoint, known to
  // within half the round trip.
  struct ClockReading {
    std::int64_t before_ms = 0, store_ms = 0, after_ms = 0;
  };
  std::optional<ClockReading> store_clock();
};

}  // namespace elastrun::rdzv
