#include "protocol.hpp"

#include <fmt/format.h>

#include <cstring>

namespace elastrun::rdzv::protocol {
namespace {

template <typename T>
void put_le(std::string& out, T v) {
  for (std::size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

template <typename T>
T get_le(std::string_view bytes) {
  T v = 0;
  for (std::size_t i = 0; i < sizeof(T); ++i) v |= static_cast<T>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  return v;
}

std::string checked_key(BodyReader& r) {
  auto key = r.str(kMaxKeyBytes);
  if (key.empty()) throw ProtocolError("empty key");
  return key;
}

}  // namespace

std::string_view to_string(Op op) {
  switch (op) {
    case Op::Hello: return "hello";
    case Op::Set: return "set";
    case Op::Get: return "get";
    case Op::Add: return "add";
    case Op::CompareAndSet: return "compare_and_set";
    case Op::Delete: return "delete";
    case Op::GetPrefix: return "get_prefix";
    case Op::Wait: return "wait";
    case Op::Watch: return "watch";
    case Op::LeaseGrant: return "lease_grant";
    case Op::LeaseKeepAlive: return "lease_keepalive";
    case Op::LeaseRevoke: return "lease_revoke";
    case Op::Ping: return "ping";
  }
  return "unknown";
}

bool is_valid_op(std::uint8_t op) { return op >= 1 && op <= static_cast<std::uint8_t>(Op::Ping); }

std::string_view to_string(Status status) {
  switch (status) {
    case Status::Ok: return "ok";
    case Status::NotFound: return "not found";
    case Status::CasFailed: return "compare-and-set failed";
    case Status::Timeout: return "timed out";
    case Status::NoSuchLease: return "no such lease (expired or revoked: the holder was declared dead)";
    case Status::Compacted: return "watch history compacted";
    case Status::BadRequest: return "bad request";
    case Status::AuthFailed: return "authentication failed";
    case Status::NotAuthenticated: return "not authenticated";
    case Status::TooLarge: return "too large";
    case Status::StoreFull: return "store full";
    case Status::NotANumber: return "value is not a number";
    case Status::WrongRun: return "this store serves another run";
    case Status::ConnectionLost: return "connection lost";
  }
  return "unknown status";
}

StoreErrorKind error_kind(Status status) {
  switch (status) {
    case Status::Ok: return StoreErrorKind::BadRequest;
    case Status::NotFound: return StoreErrorKind::NotFound;
    case Status::CasFailed: return StoreErrorKind::CasFailed;
    case Status::Timeout: return StoreErrorKind::Timeout;
    case Status::NoSuchLease: return StoreErrorKind::NoSuchLease;
    case Status::Compacted: return StoreErrorKind::Compacted;
    case Status::BadRequest: return StoreErrorKind::BadRequest;
    case Status::AuthFailed: return StoreErrorKind::AuthFailed;
    case Status::NotAuthenticated: return StoreErrorKind::NotAuthenticated;
    case Status::TooLarge: return StoreErrorKind::TooLarge;
    case Status::StoreFull: return StoreErrorKind::StoreFull;
    case Status::NotANumber: return StoreErrorKind::NotANumber;
    case Status::WrongRun: return StoreErrorKind::WrongRun;
    case Status::ConnectionLost: return StoreErrorKind::ConnectionLost;
  }
  return StoreErrorKind::BadRequest;
}

}  // namespace elastrun::rdzv::protocol

namespace elastrun::rdzv {

std::string_view to_string(StoreErrorKind kind) {
  switch (kind) {
    case StoreErrorKind::NotFound: return "not found";
    case StoreErrorKind::CasFailed: return "compare-and-set failed";
    case StoreErrorKind::Timeout: return "timed out";
    case StoreErrorKind::NoSuchLease: return "no such lease";
    case StoreErrorKind::Compacted: return "watch history compacted";
    case StoreErrorKind::BadRequest: return "bad request";
    case StoreErrorKind::AuthFailed: return "authentication failed";
    case StoreErrorKind::NotAuthenticated: return "not authenticated";
    case StoreErrorKind::TooLarge: return "too large";
    case StoreErrorKind::StoreFull: return "store full";
    case StoreErrorKind::NotANumber: return "value is not a number";
    case StoreErrorKind::WrongRun: return "this store serves another run";
    case StoreErrorKind::AddressInUse: return "address in use";
    case StoreErrorKind::ConnectionLost: return "connection lost";
  }
  return "?";
}

}  // namespace elastrun::rdzv

namespace elastrun::rdzv::protocol {

BodyWriter& BodyWriter::u8(std::uint8_t v) {
  bytes_.push_back(static_cast<char>(v));
  return *this;
}
BodyWriter& BodyWriter::u32(std::uint32_t v) {
  put_le(bytes_, v);
  return *this;
}
BodyWriter& BodyWriter::u64(std::uint64_t v) {
  put_le(bytes_, v);
  return *this;
}
BodyWriter& BodyWriter::str(std::string_view s) {
  put_le(bytes_, static_cast<std::uint32_t>(s.size()));
  bytes_.append(s);
  return *this;
}

std::string_view BodyReader::take(std::size_t n) {
  if (n > body_.size() - pos_)
    throw ProtocolError(
        fmt::format("truncated body: need {} bytes at offset {}, have {}", n, pos_, body_.size() - pos_));
  auto out = body_.substr(pos_, n);
  pos_ += n;
  return out;
}
std::uint8_t BodyReader::u8() { return static_cast<std::uint8_t>(take(1)[0]); }
std::uint32_t BodyReader::u32() { return get_le<std::uint32_t>(take(4)); }
std::uint64_t BodyReader::u64() { return get_le<std::uint64_t>(take(8)); }
std::string BodyReader::str(std::size_t max_bytes) { return std::string(str_view(max_bytes)); }
std::string_view BodyReader::str_view(std::size_t max_bytes) {
  auto n = u32();
  if (n > max_bytes) throw ProtocolError(fmt::format("string of {} bytes exceeds {}", n, max_bytes));
  return take(n);
}
void BodyReader::expect_end() const {
  if (pos_ != body_.size()) throw ProtocolError(fmt::format("{} trailing bytes after the body", body_.size() - pos_));
}

std::string BodyWriter::finish_frame(FrameHeader h) && {
  if (!framed_) throw ProtocolError("finish_frame() on a writer not made by for_frame()");
  bytes_.replace(0, kHeaderBytes, encode_header(h, bytes_.size() - kHeaderBytes));
  return std::move(bytes_);
}

std::string encode_header(const FrameHeader& h, std::size_t body_length) {
  std::string out;
  out.reserve(kHeaderBytes + body_length);
  put_le(out, kMagic);
  out.push_back(static_cast<char>(kVersion));
  out.push_back(static_cast<char>(h.op));
  out.push_back(static_cast<char>(h.status));
  out.push_back(static_cast<char>(h.flags));
  put_le(out, h.request_id);
  put_le(out, static_cast<std::uint32_t>(body_length));
  return out;
}

std::string encode_frame(const FrameHeader& h, std::string_view body) {
  std::string out = encode_header(h, body.size());
  out.append(body);
  return out;
}

std::span<char> FrameDecoder::write_area(std::size_t min_bytes) {
  std::size_t want = min_bytes;
  const std::size_t pending = buffer_.size() - consumed_;
  if (pending >= kHeaderBytes) {
    // The header is here: room for the rest of this frame (bounded by the body limit, which
    // next() enforces with a clear error).
    std::string_view header(buffer_.data() + consumed_, kHeaderBytes);
    const std::size_t frame = kHeaderBytes + std::min<std::size_t>(get_le<std::uint32_t>(header.substr(12)), max_body_);
    if (frame > pending) want = std::max(want, frame - pending);
  }
  area_start_ = buffer_.size();
  buffer_.resize(area_start_ + want);
  return {buffer_.data() + area_start_, want};
}

void FrameDecoder::commit(std::size_t n) { buffer_.resize(area_start_ + n); }

std::optional<Frame> FrameDecoder::next() {
  std::string_view pending(buffer_);
  pending.remove_prefix(consumed_);
  if (pending.size() < kHeaderBytes) {
    // Compact so that a long-lived connection's buffer does not grow with consumed bytes.
    if (consumed_ > 0) {
      buffer_.erase(0, consumed_);
      consumed_ = 0;
    }
    return std::nullopt;
  }
  if (get_le<std::uint32_t>(pending) != kMagic) throw ProtocolError("bad magic: not an elastrun store client");
  auto version = static_cast<std::uint8_t>(pending[4]);
  if (version != kVersion)
    throw ProtocolError(fmt::format("protocol version {} (this side speaks {})", version, kVersion));
  auto op = static_cast<std::uint8_t>(pending[5]);
  if (!is_valid_op(op)) throw ProtocolError(fmt::format("unknown op {}", op));
  Frame f;
  f.header.op = static_cast<Op>(op);
  f.header.status = static_cast<Status>(static_cast<std::uint8_t>(pending[6]));
  f.header.flags = static_cast<std::uint8_t>(pending[7]);
  f.header.request_id = get_le<std::uint32_t>(pending.substr(8));
  f.header.body_length = get_le<std::uint32_t>(pending.substr(12));
  if (f.header.body_length > max_body_)
    throw ProtocolError(
        fmt::format("frame body of {} bytes exceeds the {} byte limit", f.header.body_length, max_body_));
  if (pending.size() < kHeaderBytes + f.header.body_length) return std::nullopt;
  if (consumed_ == 0 && buffer_.size() == kHeaderBytes + f.header.body_length) {
    // The common case, one whole frame buffered: hand over the buffer instead of copying it
    // (large rosters reach many members at once; copies cost first-touch memory).
    buffer_.erase(0, kHeaderBytes);
    f.body = std::move(buffer_);
    buffer_.clear();
    return f;
  }
  f.body.assign(pending.substr(kHeaderBytes, f.header.body_length));
  consumed_ += kHeaderBytes + f.header.body_length;
  if (consumed_ == buffer_.size()) {
    buffer_.clear();
    consumed_ = 0;
  }
  return f;
}

Request decode_request(const Frame& frame) {
  Request r;
  r.op = frame.header.op;
  r.request_id = frame.header.request_id;
  BodyReader in(frame.body);
  switch (r.op) {
    case Op::Hello:
      r.auth_kind = in.str(32);
      r.credential = in.str(4096);
      r.run_id = in.str(kMaxKeyBytes);
      break;
    case Op::Set:
      r.key = checked_key(in);
      r.value = in.str(kMaxValueBytes);
      r.lease = in.u64();
      break;
    case Op::Get:
    case Op::Delete: r.key = checked_key(in); break;
    case Op::Add:
      r.key = checked_key(in);
      r.delta = in.i64();
      r.lease = in.u64();
      break;
    case Op::CompareAndSet:
      r.key = checked_key(in);
      r.expect_absent = in.u8() != 0;
      r.expected = in.str(kMaxValueBytes);
      r.value = in.str(kMaxValueBytes);
      r.lease = in.u64();
      break;
    case Op::GetPrefix:
      r.key = in.str(kMaxKeyBytes);  // the empty prefix lists everything
      break;
    case Op::Wait: {
      auto n = in.u32();
      if (n == 0 || n > kMaxWaitKeys) throw ProtocolError(fmt::format("wait for {} keys", n));
      r.keys.reserve(n);
      for (std::uint32_t i = 0; i < n; ++i) r.keys.push_back(checked_key(in));
      r.timeout_ms = in.u32();
      break;
    }
    case Op::Watch:
      r.key = in.str(kMaxKeyBytes);
      r.revision = in.u64();
      r.timeout_ms = in.u32();
      break;
    case Op::LeaseGrant:
      r.timeout_ms = in.u32();
      if (r.timeout_ms == 0) throw ProtocolError("lease with a zero time-to-live");
      r.value = in.str(256);  // the holder's node name (for Slurm confirmation), may be empty
      break;
    case Op::LeaseKeepAlive:
    case Op::LeaseRevoke: r.lease = in.u64(); break;
    case Op::Ping: break;
  }
  in.expect_end();
  if (r.timeout_ms > kMaxTimeoutMs) throw ProtocolError(fmt::format("timeout {} ms too long", r.timeout_ms));
  return r;
}

std::string encode_request(const Request& r) {
  BodyWriter w;
  switch (r.op) {
    case Op::Hello: w.str(r.auth_kind).str(r.credential).str(r.run_id); break;
    case Op::Set: w.str(r.key).str(r.value).u64(r.lease); break;
    case Op::Get:
    case Op::Delete: w.str(r.key); break;
    case Op::Add: w.str(r.key).i64(r.delta).u64(r.lease); break;
    case Op::CompareAndSet: w.str(r.key).u8(r.expect_absent ? 1 : 0).str(r.expected).str(r.value).u64(r.lease); break;
    case Op::GetPrefix: w.str(r.key); break;
    case Op::Wait:
      w.u32(static_cast<std::uint32_t>(r.keys.size()));
      for (const auto& k : r.keys) w.str(k);
      w.u32(r.timeout_ms);
      break;
    case Op::Watch: w.str(r.key).u64(r.revision).u32(r.timeout_ms); break;
    case Op::LeaseGrant: w.u32(r.timeout_ms).str(r.value); break;
    case Op::LeaseKeepAlive:
    case Op::LeaseRevoke: w.u64(r.lease); break;
    case Op::Ping: break;
  }
  return encode_frame({.op = r.op, .status = Status::Ok, .flags = 0, .request_id = r.request_id, .body_length = 0},
                      w.bytes());
}

}  // namespace elastrun::rdzv::protocol
