// The node's endpoint: a versioned Unix-socket service of the node's agent, served by a thread of
// its own for the whole job, so that it answers while the state machine waits (in a rendezvous, a
// restart, a checkpoint). Today it answers status queries; the preloader and the memory checkpoint
// tier attach here next.
//
// Protocol (version contract::kNodeProtocolVersion, docs/launcher.md "The node endpoint"): one
// request per connection, one JSON object per line each way (connections are read concurrently; a
// client silent for 2 s is dropped; requests are answered one at a time, on the endpoint's thread):
//   -> {"v":1,"op":"status"}
//   <- {"v":1,"ok":true, ...what the op returns}   or   {"v":1,"ok":false,"error":"..."}
// A reply may carry one file descriptor (SCM_RIGHTS: a memory checkpoint segment). The ops are the
// worker contract's (contract::node_op); the client and the line format are
// <elastrun/worker/node.hpp>'s, shared with training code.
// The address is "@name" (Linux abstract namespace: nothing on disk to leave behind, gone with the
// process, even after kill -9) or a filesystem path. Peers must run as the agent's user (or
// root): SO_PEERCRED is checked on every connection.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "elastrun/util/unique_fd.hpp"
#include "elastrun/worker/node.hpp"

namespace elastrun::launcher {

class NodeEndpoint {
 public:
  // Answers one request; called on the endpoint's thread. Throwing std::exception answers
  // {"ok":false,"error":what()}. A reply's descriptor is sent with it, then closed.
  using Handler = std::function<worker::NodeReply(const nlohmann::json& request)>;

  // Binds and listens on `address` ("@name" or a path; an existing socket file is replaced) and
  // starts serving. Throws std::system_error naming the address.
  NodeEndpoint(std::string address, Handler handler);
  ~NodeEndpoint();  // stops serving, removes a path
  NodeEndpoint(const NodeEndpoint&) = delete;
  NodeEndpoint& operator=(const NodeEndpoint&) = delete;

  const std::string& address() const { return address_; }

 private:
  void serve();
  void answer(int connection, const std::string& line);

  std::string address_;
  Handler handler_;
  util::UniqueFd listener_, wake_read_, wake_write_;
  std::jthread thread_;
};

// The default address of a node's agent: "@elastrun-node-<pid>-<node>".
std::string default_node_address(int pid, const std::string& node);

// Sends one request to the endpoint at `address` and returns its reply. Throws std::runtime_error
// naming the address when it cannot connect, times out or gets no JSON back.
nlohmann::json query_node(const std::string& address, const nlohmann::json& request,
                          std::chrono::milliseconds timeout = std::chrono::milliseconds(5000));

// `elastrun node-status [ADDRESS]`: prints the agent's status (ADDRESS default:
// $ELASTRUN_NODE_SOCKET, as its workers have it). Exit 1 naming the address when none answers.
int run_node_status_command(int argc, char** argv);

}  // namespace elastrun::launcher
