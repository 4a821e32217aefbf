// Wire protocol of the embedded rendezvous store (docs/rendezvous.md, "Store protocol").
//
// Every message is a frame: a fixed 16-byte header followed by a body of at most
// kMaxBodyBytes. The header carries a magic number and a version so that a stray client (or a
// port reused by another program) is recognised at once. Bodies are sequences of fixed-width
// little-endian integers and length-prefixed byte strings, read through a bounds-checked
// BodyReader: a truncated, oversized or malformed frame is a ProtocolError, which closes that
// one connection and nothing else.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <span>
#include <string_view>
#include <vector>

#include "elastrun/rdzv/store.hpp"

namespace elastrun::rdzv::protocol {

inline constexpr std::uint32_t kMagic = 0x5A524C45;  // "ELRZ" on the wire
inline constexpr std::uint8_t kVersion = 1;
inline constexpr std::size_t kHeaderBytes = 16;
inline constexpr std::size_t kMaxBodyBytes = 1u << 20;       // requests
inline constexpr std::size_t kMaxResponseBytes = 64u << 20;  // responses (prefix listings)
inline constexpr std::size_t kMaxKeyBytes = 1024;
inline constexpr std::size_t kMaxValueBytes = 512u << 10;
inline constexpr std::size_t kMaxWaitKeys = 4096;
inline constexpr std::uint32_t kMaxTimeoutMs = 24u * 3600u * 1000u;

class ProtocolError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Op : std::uint8_t {
  Hello = 1,
  Set = 2,
  Get = 3,
  Add = 4,
  CompareAndSet = 5,
  Delete = 6,
  GetPrefix = 7,
  Wait = 8,
  Watch = 9,
  LeaseGrant = 10,
  LeaseKeepAlive = 11,
  LeaseRevoke = 12,
  Ping = 13,
};
std::string_view to_string(Op op);
bool is_valid_op(std::uint8_t op);

enum class Status : std::uint8_t {
  Ok = 0,
  NotFound = 1,
  CasFailed = 2,
  Timeout = 3,
  NoSuchLease = 4,  // expired, revoked, or never granted: the holder was declared dead
  Compacted = 5,    // a watch asked for history the server no longer keeps
  BadRequest = 6,
  AuthFailed = 7,
  NotAuthenticated = 8,
  TooLarge = 9,
  StoreFull = 10,
  NotANumber = 11,
  WrongRun = 12,         // hello: this store serves another run (nothing more is said)
  ConnectionLost = 100,  // never on the wire: the client's view of a dropped connection
};
std::string_view to_string(Status status);
// The public face of a status that failed a request (elastrun/rdzv/store.hpp). Ok maps to
// BadRequest: a request never fails with Ok.
StoreErrorKind error_kind(Status status);

// Header: magic u32 | version u8 | op u8 | status u8 | flags u8 | request id u32 | body length u32
struct FrameHeader {
  Op op{};
  Status status = Status::Ok;
  std::uint8_t flags = 0;
  std::uint32_t request_id = 0;
  std::uint32_t body_length = 0;
};

struct Frame {
  FrameHeader header;
  std::string body;
};

// Serialises integers and strings into a frame body.
class BodyWriter {
 public:
  BodyWriter() = default;
  // A writer whose buffer starts with room for the frame header, so a large response is
  // built in place and sent without copying its body into a frame (see finish_frame).
  static BodyWriter for_frame() {
    BodyWriter w;
    w.bytes_.assign(kHeaderBytes, '\0');
    w.framed_ = true;
    return w;
  }
  // Fills in the header of a for_frame() writer and hands over the whole frame.
  std::string finish_frame(FrameHeader header) &&;
  BodyWriter& u8(std::uint8_t v);
  BodyWriter& u32(std::uint32_t v);
  BodyWriter& u64(std::uint64_t v);
  BodyWriter& i64(std::int64_t v) { return u64(static_cast<std::uint64_t>(v)); }
  BodyWriter& str(std::string_view s);
  const std::string& bytes() const { return bytes_; }
  std::string take() { return std::move(bytes_); }

 private:
  std::string bytes_;
  bool framed_ = false;
};

// Reads a frame body; every read is bounds-checked and throws ProtocolError when short.
class BodyReader {
 public:
  explicit BodyReader(std::string_view body) : body_(body) {}
  std::uint8_t u8();
  std::uint32_t u32();
  std::uint64_t u64();
  std::int64_t i64() { return static_cast<std::int64_t>(u64()); }
  std::string str(std::size_t max_bytes);
  std::string_view str_view(std::size_t max_bytes);  // valid as long as the body is
  void expect_end() const;                           // trailing bytes are a protocol error too

 private:
  std::string_view take(std::size_t n);
  std::string_view body_;
  std::size_t pos_ = 0;
};

std::string encode_frame(const FrameHeader& header, std::string_view body);
// Just the header of a frame whose body (of `body_length` bytes) is sent separately; the
// returned string has capacity for the body should the caller append it.
std::string encode_header(const FrameHeader& header, std::size_t body_length);

// Incremental decoder: feed it bytes as they arrive, pop whole frames.
class FrameDecoder {
 public:
  explicit FrameDecoder(std::size_t max_body = kMaxBodyBytes) : max_body_(max_body) {}
  void feed(const char* data, std::size_t n) { buffer_.append(data, n); }
  // Receive straight into the decoder (no intermediate copy): recv() into write_area(), then
  // commit() the bytes received. The area is as large as the pending frame still needs (at
  // least `min_bytes` while its header is incomplete), so a large response is read at its
  // final place in one pass.
  std::span<char> write_area(std::size_t min_bytes = 4096);
  void commit(std::size_t n);
  // Returns the next complete frame, std::nullopt if more bytes are needed; throws
  // ProtocolError on a bad magic, version or op, or a body longer than the limit.
  std::optional<Frame> next();
  std::size_t buffered() const { return buffer_.size() - consumed_; }

 private:
  std::string buffer_;
  std::size_t consumed_ = 0;
  std::size_t area_start_ = 0;  // where the last write_area() began
  std::size_t max_body_;
};

// A request, decoded and validated (key and value sizes, timeouts). Fields unused by an op
// keep their defaults.
struct Request {
  Op op{};
  std::uint32_t request_id = 0;
  std::string key;  // also the prefix of GetPrefix/Watch
  std::string value;
  std::string expected;           // CompareAndSet
  bool expect_absent = false;     // CompareAndSet: succeed only if the key does not exist
  std::vector<std::string> keys;  // Wait
  std::int64_t delta = 0;         // Add
  std::uint64_t lease = 0;        // Set/Add/CompareAndSet: attach the key to this lease
  std::uint64_t revision = 0;     // Watch: report events after this revision
  std::uint32_t timeout_ms = 0;   // Wait/Watch; LeaseGrant: the lease's time-to-live
  // Hello
  std::string auth_kind;
  std::string credential;
  std::string run_id;
};

Request decode_request(const Frame& frame);          // throws ProtocolError
std::string encode_request(const Request& request);  // a whole frame
}  // namespace elastrun::rdzv::protocol
