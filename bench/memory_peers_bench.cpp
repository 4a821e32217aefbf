// memory_peers_bench: the memory tier's partner copies (launcher/src/memory_peers.hpp) against
// loopback TCP, measured in the same run, alternating. Never asserts; run from bench/run.py.
//   tcp_gbs            one connection moving MIB from a touched buffer into a touched buffer:
//                      the anchor (an iperf-like figure of this machine's loopback)
//   fetch_gbs          an agent fetching a MIB segment from a peer agent (peer_fetch: what a node
//                      taking a lost node's ranks does), into a segment retention freed before
//                      (touched pages: the steady state of a node that holds snapshots)
//   fetch_fresh_gbs    the same into fresh memory (a node that holds nothing yet: a spare)
//   push_cpu_s         CPU seconds (both agents: sender and receiver) per partner copy of MIB
//   tcp_cpu_s          CPU seconds of the plain TCP transfer of the same bytes
// Usage: memory_peers_bench [--mib N] [--reps R] [--json FILE]
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "elastrun/rdzv/net.hpp"
#include "memory_peers.hpp"
#include "memory_segments.hpp"

using namespace elastrun::launcher;
using Clock = std::chrono::steady_clock;

namespace {

double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// One loopback connection, `bytes` from a touched buffer into a touched buffer; seconds.
double tcp_transfer(std::vector<char>& from, std::vector<char>& into) {
  auto listener = elastrun::rdzv::listen_tcp("127.0.0.1", 0);
  const auto t0 = Clock::now();
  std::thread receiver([&] {
    elastrun::util::UniqueFd c(::accept(listener.fd.get(), nullptr, nullptr));
    std::size_t got = 0;
    while (got < into.size()) {
      const ssize_t n = ::recv(c.get(), into.data() + got, into.size() - got, MSG_WAITALL);
      if (n <= 0) break;
      got += static_cast<std::size_t>(n);
    }
  });
  auto fd = elastrun::rdzv::connect_tcp("127.0.0.1", listener.port, std::chrono::seconds(5));
  std::size_t sent = 0;
  while (sent < from.size()) {
    const ssize_t n = ::send(fd.get(), from.data() + sent, from.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;
    sent += static_cast<std::size_t>(n);
  }
  receiver.join();
  return seconds_since(t0);
}

void fill(int fd, std::uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap");
  std::memset(p, 0x5a, bytes);
  ::munmap(p, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  std::uint64_t mib = 256;
  int reps = 3;
  std::string json_path;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--mib")
      mib = std::stoull(argv[i + 1]);
    else if (flag == "--reps")
      reps = std::stoi(argv[i + 1]);
    else if (flag == "--json")
      json_path = argv[i + 1];
    else {
      fmt::print(stderr, "memory_peers_bench: unknown flag {}\n", flag);
      return 2;
    }
  }
  spdlog::set_level(spdlog::level::warn);
  const std::uint64_t bytes = mib << 20;
  PeerCredentials credentials;
  credentials.auth.kind = elastrun::rdzv::AuthKind::Token;
  credentials.auth.token = "bench";
  credentials.run_id = "memory-peers-bench";
  // the holder: one committed segment per rep (kept: retention holds two steps, so one per step)
  MemorySegments holder_segments(4 * bytes);
  MemoryPeers holder(holder_segments, credentials, "127.0.0.1");
  std::vector<char> from(bytes, 1), into(bytes, 0);
  nlohmann::json out{{"mib", mib}, {"reps", reps}};
  std::vector<double> tcp, fetch, fetch_fresh, push_cpu, tcp_cpu;
  MemorySegments steady(4 * bytes);  // the fetching node of the steady state: its spares are reused
  MemorySegments partner_segments(2 * bytes);
  MemoryPeers partner(partner_segments, credentials, "127.0.0.1");
  for (int rep = 0; rep < reps; ++rep) {
    const auto step = static_cast<std::uint64_t>(rep + 1);
    {
      auto fd = holder_segments.allocate(step, 0, bytes);
      fill(fd.get(), bytes);
    }
    holder_segments.commit(step, 0, step, 1);
    // plain TCP (the anchor), its CPU seconds
    double cpu0 = cpu_seconds();
    tcp.push_back(static_cast<double>(bytes) / tcp_transfer(from, into) / 1e9);
    tcp_cpu.push_back(cpu_seconds() - cpu0);
    // a fetch into fresh memory (a spare's first restore)
    {
      MemorySegments fresh(2 * bytes);
      const auto t0 = Clock::now();
      peer_fetch(holder.address(), credentials, step, 0, fresh, MemorySegments::Origin::Fetched,
                 std::chrono::seconds(60));
      fetch_fresh.push_back(static_cast<double>(bytes) / seconds_since(t0) / 1e9);
    }
    // a fetch into touched memory: the step before's segment, dropped by retention, is reused
    if (rep == 0) {  // warm up: the first fetch into `steady` pays fresh pages
      peer_fetch(holder.address(), credentials, step, 0, steady, MemorySegments::Origin::Fetched,
                 std::chrono::seconds(60));
      steady.forget_after(0);
    }
    {
      const auto t0 = Clock::now();
      peer_fetch(holder.address(), credentials, step, 0, steady, MemorySegments::Origin::Fetched,
                 std::chrono::seconds(60));
      fetch.push_back(static_cast<double>(bytes) / seconds_since(t0) / 1e9);
      steady.forget_after(0);  // its memory becomes the spare of the next rep's fetch
    }
    // a partner copy: both agents are in this process, so this is the sender's and receiver's CPU;
    // the partner's memory is the spare of the copy before (the steady state of a copy per step)
    {
      auto pinned = holder_segments.pin(step, 0);
      if (rep == 0) {
        peer_push(partner.address(), credentials, *pinned, std::chrono::seconds(60));
        partner_segments.forget_after(0);
      }
      cpu0 = cpu_seconds();
      peer_push(partner.address(), credentials, *pinned, std::chrono::seconds(60));
      push_cpu.push_back(cpu_seconds() - cpu0);
      partner_segments.forget_after(0);
    }
  }
  out["tcp_gbs"] = tcp;
  out["fetch_gbs"] = fetch;
  out["fetch_fresh_gbs"] = fetch_fresh;
  out["push_cpu_s"] = push_cpu;
  out["tcp_cpu_s"] = tcp_cpu;
  fmt::print("{}\n", out.dump());
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(1) << "\n";
  return 0;
}
