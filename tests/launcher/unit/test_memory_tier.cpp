// The memory checkpoint tier's segments (launcher/src/memory_segments.hpp) and their service on a
// real node endpoint, driven by the worker's client (<elastrun/worker/memory.hpp>): budget,
// read-only restores, retention, spares reused, descriptors passed over the socket, refusal when off.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "elastrun/worker/memory.hpp"
#include "memory_segments.hpp"
#include "node_runtime.hpp"

namespace elastrun::launcher {
namespace {

void fill(int fd, std::size_t size, char value) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  std::memset(p, value, size);
  ::munmap(p, size);
}

TEST(MemorySegments, FindReturnsTheNewestThroughAReadOnlyDescriptor) {
  MemorySegments segments(1 << 20);
  for (std::uint64_t step : {1, 2}) {
    auto fd = segments.allocate(step, 0, 4096);
    fill(fd.get(), 4096, static_cast<char>('a' + step));
    segments.commit(step, 0, 100 + step);
  }
  auto found = segments.find(0);
  ASSERT_TRUE(found);
  EXPECT_EQ(found->step, 2u);
  EXPECT_EQ(found->checksum, 102u);
  EXPECT_EQ(::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, found->fd.get(), 0), MAP_FAILED)
      << "whoever restores cannot map it writable";
  EXPECT_EQ(::write(found->fd.get(), "x", 1), -1) << "nor written";
  void* p = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, found->fd.get(), 0);
  ASSERT_NE(p, MAP_FAILED);
  EXPECT_EQ(static_cast<char*>(p)[4095], 'c');
  ::munmap(p, 4096);
  EXPECT_EQ(segments.find(0, 1)->checksum, 101u);
  EXPECT_FALSE(segments.find(1)) << "another rank has none";
}

ino_t inode(int fd) {
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  return st.st_ino;
}

// Snapshots of steps 1..last for rank 0 (one page each, filled with 'a' + step); their inodes.
std::vector<ino_t> put_steps(MemorySegments& segments, std::uint64_t last) {
  std::vector<ino_t> inodes;
  for (std::uint64_t step = 1; step <= last; ++step) {
    auto fd = segments.allocate(step, 0, 4096);
    inodes.push_back(inode(fd.get()));
    fill(fd.get(), 4096, static_cast<char>('a' + step));
    segments.commit(step, 0, step);
  }
  return inodes;
}

// A fresh page costs a fault and zeroing at its first write (40x the copy on a VM): a snapshot
// every step writes into the pages of the segment retention dropped before it.
TEST(MemorySegments, DroppedSegmentsAreReusedForTheNextSnapshot) {
  MemorySegments segments(4 * 4096);
  const auto inodes = put_steps(segments, 3);
  EXPECT_EQ(segments.used(), 2u * 4096);
  EXPECT_EQ(segments.spare(), 4096u) << "step 1, dropped by retention, is kept for reuse";
  auto fd = segments.allocate(4, 0, 4096);
  EXPECT_EQ(inode(fd.get()), inodes[0]) << "step 4 is written into step 1's segment";
  EXPECT_EQ(segments.spare(), 0u);
  fill(fd.get(), 4096, 'e');
  segments.commit(4, 0, 4);
  // 3 pages next to step 4 fill the budget: step 3 (older than the newest) goes, step 2 grows
  auto grown = segments.allocate(5, 0, 3 * 4096);
  EXPECT_EQ(inode(grown.get()), inodes[1]) << "the spare needing the fewest new pages";
  struct stat st {};
  ASSERT_EQ(::fstat(grown.get(), &st), 0);
  EXPECT_EQ(st.st_size, 3 * 4096) << "resized to the new snapshot";
  EXPECT_EQ(segments.list()["spare"], 0);
  EXPECT_LE(segments.used() + segments.spare(), 4u * 4096) << "spares count against the budget";
  EXPECT_TRUE(segments.find(0, 4)) << "the newest committed step stays";
  EXPECT_FALSE(segments.find(0, 3)) << "step 3 made room (older than the newest)";
}

// Retention drops step 1 of both ranks at once: rank 1's next snapshot gets rank 1's old segment,
// the one its worker still maps (a new mapping pays a fault per page at the first write).
TEST(MemorySegments, ASpareGoesBackToTheRankThatWroteIt) {
  MemorySegments segments(1 << 20);
  std::map<int, ino_t> first;
  for (std::uint64_t step = 1; step <= 3; ++step) {
    for (int rank : {0, 1}) {
      auto fd = segments.allocate(step, rank, 4096);
      if (step == 1) first[rank] = inode(fd.get());
    }
    for (int rank : {0, 1}) segments.commit(step, rank, step);
  }
  EXPECT_EQ(segments.spare(), 2u * 4096);
  EXPECT_EQ(inode(segments.allocate(4, 1, 4096).get()), first[1]);
  EXPECT_EQ(inode(segments.allocate(4, 0, 4096).get()), first[0]);
}

// A reader's descriptor (mem_get) must keep showing the snapshot it asked for: a segment handed
// out is freed when dropped, never reused for another snapshot.
TEST(MemorySegments, AReaderKeepsItsSnapshotAfterTheSegmentIsDropped) {
  MemorySegments segments(1 << 20);
  const auto inodes = put_steps(segments, 2);
  auto reader = segments.find(0, 1);
  ASSERT_TRUE(reader);
  segments.allocate(3, 0, 4096);
  segments.commit(3, 0, 3);  // retention drops step 1
  EXPECT_FALSE(segments.find(0, 1));
  EXPECT_EQ(segments.spare(), 0u) << "a segment a reader got is not kept as a spare";
  auto next = segments.allocate(4, 0, 4096);
  EXPECT_NE(inode(next.get()), inodes[0]);
  fill(next.get(), 4096, 'z');
  char byte = 0;
  ASSERT_EQ(::pread(reader->fd.get(), &byte, 1, 4095), 1);
  EXPECT_EQ(byte, 'b') << "the reader still sees step 1";
}

TEST(MemorySegments, ASnapshotLargerThanTheBudgetIsRefusedAtOnce) {
  MemorySegments segments(4096);
  EXPECT_THROW(segments.allocate(1, 0, ~std::uint64_t{0}), MemoryBudgetError);
  EXPECT_THROW(segments.allocate(1, 0, 4097), MemoryBudgetError);
  EXPECT_EQ(segments.used() + segments.spare(), 0u);
}

TEST(MemorySegments, RetentionAndBudget) {
  MemorySegments segments(3 * 4096);
  for (std::uint64_t step = 1; step <= 4; ++step) {
    segments.allocate(step, 0, 4096);
    segments.commit(step, 0, step);
  }
  EXPECT_EQ(segments.used(), 2u * 4096) << "the two newest committed steps are kept";
  EXPECT_FALSE(segments.find(0, 2));
  EXPECT_TRUE(segments.find(0, 3));
  // a re-formed rank (another number) needs two pages: step 3 (older than the newest) makes room
  segments.allocate(5, 1, 2 * 4096);
  EXPECT_FALSE(segments.find(0, 3));
  EXPECT_TRUE(segments.find(0, 4)) << "the newest committed step stays until the next is committed";
  try {
    segments.allocate(5, 2, 4096);
    FAIL() << "over budget";
  } catch (const MemoryBudgetError& e) {
    EXPECT_NE(std::string(e.what()).find("--memory-checkpoints"), std::string::npos) << e.what();
  }
  segments.commit(5, 1, 5);
  const auto list = segments.list();
  EXPECT_EQ(list["budget"], 3 * 4096);
  EXPECT_EQ(list["segments"].size(), 2u) << list.dump();
  segments.allocate(6, 1, 4096);
  segments.commit(6, 1, 6);
  EXPECT_FALSE(segments.find(0, 4)) << "older than the two newest steps (5, 6): gone, whatever its rank";
  EXPECT_TRUE(segments.find(1, 5));
}

// The worker's client against a real runtime's endpoint: the segment outlives the client's
// mapping and descriptors (a worker that exits), and comes back read-only.
TEST(MemoryTier, WorkerClientThroughTheNodeEndpoint) {
  NodeRuntime runtime(std::chrono::milliseconds(100));
  runtime.enable_memory_checkpoints(1 << 20);
  runtime.serve_endpoint({.node = "n1", .run_id = "test", .job_dir = ""});
  ASSERT_FALSE(runtime.endpoint_address().empty());
  {
    worker::MemoryTier tier(runtime.endpoint_address());
    auto segment = tier.allocate(7, 2, 10000);
    std::iota(reinterpret_cast<unsigned char*>(segment.data()),
              reinterpret_cast<unsigned char*>(segment.data()) + segment.size(), 0);
    tier.commit(std::move(segment), 0xfedcba9876543210ULL);  // all 64 bits
  }
  worker::MemoryTier tier(runtime.endpoint_address());
  auto back = tier.newest(2);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->step(), 7u);
  EXPECT_EQ(back->size(), 10000u);
  EXPECT_EQ(back->checksum(), 0xfedcba9876543210ULL);
  EXPECT_EQ(static_cast<unsigned char>(back->data()[9999]), 9999 % 256);
  EXPECT_FALSE(tier.newest(3));
  EXPECT_EQ(tier.list()["used"], 10000);
  EXPECT_EQ(runtime.status_reply()["memory_checkpoints"]["used"], 10000);
  try {
    tier.allocate(8, 2, 2 << 20);
    FAIL() << "over budget";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("budget"), std::string::npos) << e.what();
  }
}

// A restore to step 3 (from files) while the agent holds 4 and 5 of an abandoned history: left
// there, they would be "the two newest" and retention would drop every new snapshot (3 < 5).
TEST(MemoryTier, ForgetAfterARestoreDropsTheAbandonedHistorySoNewSnapshotsAreKept) {
  NodeRuntime runtime(std::chrono::milliseconds(100));
  runtime.enable_memory_checkpoints(1 << 20);
  runtime.serve_endpoint({.node = "n1", .run_id = "test", .job_dir = ""});
  worker::MemoryTier tier(runtime.endpoint_address());
  const auto put = [&](std::uint64_t step, int rank) { tier.commit(tier.allocate(step, rank, 4096), step); };
  for (int rank : {0, 1}) put(4, rank), put(5, rank);
  tier.allocate(6, 0, 4096);  // an unfinished one of the old history too
  EXPECT_EQ(tier.forget_after(3), 5u);
  EXPECT_EQ(tier.list()["segments"].size(), 0u) << tier.list().dump();
  put(4, 0);  // the new history's step 4
  ASSERT_TRUE(tier.newest(0));
  EXPECT_EQ(tier.newest(0)->step(), 4u) << "the new snapshot was dropped by retention";
  EXPECT_EQ(tier.forget_after(4), 0u);
}

TEST(MemoryTier, RefusedWhenOff) {
  NodeRuntime runtime(std::chrono::milliseconds(100));
  runtime.serve_endpoint({.node = "n1", .run_id = "test", .job_dir = ""});
  worker::MemoryTier tier(runtime.endpoint_address());
  try {
    tier.allocate(1, 0, 16);
    FAIL() << "allocated without --memory-checkpoints";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("--memory-checkpoints"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(runtime.status_reply()["memory_checkpoints"].is_null());
}

}  // namespace
}  // namespace elastrun::launcher
