#include "elastrun/rdzv/etcd.hpp"

#include <curl/curl.h>
#include <dlfcn.h>

#include <type_traits>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <mutex>

#include "elastrun/rdzv/store.hpp"
#include "elastrun/util/parse.hpp"

namespace elastrun::rdzv {
namespace {

using json = nlohmann::json;

constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// etcd's gateway writes 64-bit integers as JSON strings.
std::uint64_t u64_of(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end()) return 0;
  if (it->is_number_unsigned() || it->is_number_integer()) return it->get<std::uint64_t>();
  if (it->is_string()) return util::parse_integer<std::uint64_t>(it->get_ref<const std::string&>()).value_or(0);
  return 0;
}

// The end of a prefix range: the prefix with its last byte incremented ("\0" = all keys).
std::string range_end(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(end.back());
    if (c < 0xff) {
      ++c;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

KeyValue kv_of(const json& j) {
  KeyValue kv;
  kv.key = base64_decode(j.value("key", ""));
  kv.value = base64_decode(j.value("value", ""));
  kv.revision = u64_of(j, "mod_revision");
  kv.lease = u64_of(j, "lease");
  return kv;
}

// libcurl is opened on first use, not linked: it pulls in ~30 libraries (TLS, Kerberos, LDAP,
// ...) that would cost every agent ~4 MB of resident memory and start-up relocations, while
// only agents using the etcd backend need it.
struct CurlApi {
  decltype(&::curl_global_init) global_init = nullptr;
  decltype(&::curl_easy_init) easy_init = nullptr;
  decltype(&::curl_easy_cleanup) easy_cleanup = nullptr;
  decltype(&::curl_easy_reset) easy_reset = nullptr;
  decltype(&::curl_easy_setopt) easy_setopt = nullptr;
  decltype(&::curl_easy_perform) easy_perform = nullptr;
  decltype(&::curl_easy_strerror) easy_strerror = nullptr;
  decltype(&::curl_slist_append) slist_append = nullptr;
  decltype(&::curl_slist_free_all) slist_free_all = nullptr;
};

const CurlApi& curl_api() {
  static const CurlApi api = [] {
    // Kept open for the life of the process: handles and the global state live in it.
    void* lib = ::dlopen("libcurl.so.4", RTLD_NOW | RTLD_LOCAL);
    if (!lib)
      throw StoreError(StoreErrorKind::ConnectionLost,
                       fmt::format("the etcd backend needs libcurl: {} (install libcurl4)", ::dlerror()));
    CurlApi a;
    auto load = [lib](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(lib, name));
      if (!fn) throw StoreError(StoreErrorKind::ConnectionLost, fmt::format("libcurl.so.4 has no {}", name));
    };
    load(a.global_init, "curl_global_init");
    load(a.easy_init, "curl_easy_init");
    load(a.easy_cleanup, "curl_easy_cleanup");
    load(a.easy_reset, "curl_easy_reset");
    load(a.easy_setopt, "curl_easy_setopt");
    load(a.easy_perform, "curl_easy_perform");
    load(a.easy_strerror, "curl_easy_strerror");
    load(a.slist_append, "curl_slist_append");
    load(a.slist_free_all, "curl_slist_free_all");
    a.global_init(CURL_GLOBAL_DEFAULT);
    return a;
  }();
  return api;
}

struct CurlDeleter {
  void operator()(CURL* c) const { curl_api().easy_cleanup(c); }
};
struct SlistDeleter {
  void operator()(curl_slist* l) const { curl_api().slist_free_all(l); }
};

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  std::size_t i = 0;
  for (; i + 2 < bytes.size(); i += 3) {
    auto n = (std::uint32_t(std::uint8_t(bytes[i])) << 16) | (std::uint32_t(std::uint8_t(bytes[i + 1])) << 8) |
             std::uint8_t(bytes[i + 2]);
    for (int s : {18, 12, 6, 0}) out.push_back(kAlphabet[(n >> s) & 63]);
  }
  if (i < bytes.size()) {
    auto n = std::uint32_t(std::uint8_t(bytes[i])) << 16;
    if (i + 1 < bytes.size()) n |= std::uint32_t(std::uint8_t(bytes[i + 1])) << 8;
    out.push_back(kAlphabet[(n >> 18) & 63]);
    out.push_back(kAlphabet[(n >> 12) & 63]);
    out.push_back(i + 1 < bytes.size() ? kAlphabet[(n >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

std::string base64_decode(std::string_view text) {
  std::array<int, 256> value{};
  value.fill(-1);
  for (std::size_t i = 0; i < kAlphabet.size(); ++i)
    value[static_cast<unsigned char>(kAlphabet[i])] = static_cast<int>(i);
  std::string out;
  std::uint32_t acc = 0;
  int bits = 0;
  for (char c : text) {
    if (c == '=') break;
    int v = value[static_cast<unsigned char>(c)];
    if (v < 0) throw std::invalid_argument(fmt::format("'{}' is not base64", c));
    acc = (acc << 6) | static_cast<std::uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

struct EtcdKv::Impl {
  std::string base;
  std::string endpoint;
  Millis timeout;
  std::unique_ptr<CURL, CurlDeleter> curl;
  std::unique_ptr<curl_slist, SlistDeleter> headers;

  // Streaming state of a watch (the gateway sends one JSON object per message).
  struct Stream {
    std::string buffer;
    std::vector<json> messages;
    bool stop = false;
  };

  static std::size_t collect(char* data, std::size_t size, std::size_t n, void* user) {
    static_cast<std::string*>(user)->append(data, size * n);
    return size * n;
  }

  static std::size_t collect_stream(char* data, std::size_t size, std::size_t n, void* user) {
    auto* s = static_cast<Stream*>(user);
    s->buffer.append(data, size * n);
    // Split complete top-level objects (base64 and numbers never contain braces).
    int depth = 0;
    bool in_string = false;
    std::size_t start = 0;
    for (std::size_t i = 0; i < s->buffer.size(); ++i) {
      char c = s->buffer[i];
      if (in_string) {
        if (c == '\\')
          ++i;
        else if (c == '"')
          in_string = false;
        continue;
      }
      if (c == '"')
        in_string = true;
      else if (c == '{') {
        if (depth++ == 0) start = i;
      } else if (c == '}' && --depth == 0) {
        auto msg = json::parse(s->buffer.substr(start, i - start + 1), nullptr, false);
        if (!msg.is_discarded()) {
          const auto& r = msg.contains("result") ? msg["result"] : msg;
          if ((r.contains("events") && !r["events"].empty()) || r.contains("compact_revision") || msg.contains("error"))
            s->stop = true;
          s->messages.push_back(std::move(msg));
        }
        s->buffer.erase(0, i + 1);
        i = static_cast<std::size_t>(-1);
      }
    }
    return s->stop ? 0 : size * n;  // returning short aborts the transfer: we have what we need
  }

  void prepare(const std::string& path, const std::string& body, Millis t) {
    curl_api().easy_reset(curl.get());
    auto url = base + path;
    curl_api().easy_setopt(curl.get(), CURLOPT_URL, url.c_str());
    curl_api().easy_setopt(curl.get(), CURLOPT_POST, 1L);
    curl_api().easy_setopt(curl.get(), CURLOPT_POSTFIELDS, body.c_str());
    curl_api().easy_setopt(curl.get(), CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
    curl_api().easy_setopt(curl.get(), CURLOPT_HTTPHEADER, headers.get());
    curl_api().easy_setopt(curl.get(), CURLOPT_TIMEOUT_MS, static_cast<long>(t.count()));
    curl_api().easy_setopt(curl.get(), CURLOPT_CONNECTTIMEOUT_MS, 3000L);
    curl_api().easy_setopt(curl.get(), CURLOPT_NOSIGNAL, 1L);
    curl_api().easy_setopt(curl.get(), CURLOPT_TCP_NODELAY, 1L);
  }

  [[noreturn]] void fail_from(const json& reply, const std::string& what) {
    auto message = reply.value("message", reply.value("error", std::string("error")));
    auto kind = StoreErrorKind::BadRequest;
    if (message.find("lease not found") != std::string::npos)
      kind = StoreErrorKind::NoSuchLease;
    else if (message.find("compacted") != std::string::npos)
      kind = StoreErrorKind::Compacted;
    throw StoreError(kind, fmt::format("etcd {}: {}: {}", endpoint, what, message));
  }

  json post(const std::string& path, const json& request) {
    auto body = request.dump();
    std::string reply;
    prepare(path, body, timeout);
    curl_api().easy_setopt(curl.get(), CURLOPT_WRITEFUNCTION, &Impl::collect);
    curl_api().easy_setopt(curl.get(), CURLOPT_WRITEDATA, &reply);
    auto rc = curl_api().easy_perform(curl.get());
    if (rc != CURLE_OK)
      throw StoreError(StoreErrorKind::ConnectionLost,
                       fmt::format("etcd {}{}: {}", endpoint, path, curl_api().easy_strerror(rc)));
    auto j = json::parse(reply, nullptr, false);
    if (j.is_discarded())
      throw StoreError(StoreErrorKind::BadRequest,
                       fmt::format("etcd {}{}: not JSON: {}", endpoint, path, reply.substr(0, 200)));
    if (j.contains("error")) fail_from(j, path);
    return j;
  }

  json put_op(std::string_view key, std::string_view value, std::uint64_t lease) {
    json p{{"key", base64_encode(key)}, {"value", base64_encode(value)}};
    if (lease) p["lease"] = std::to_string(lease);
    return p;
  }
};

EtcdKv::EtcdKv(const std::string& endpoint, Millis request_timeout) : impl_(std::make_unique<Impl>()) {
  impl_->endpoint = endpoint;
  impl_->base = endpoint.starts_with("http") ? endpoint : "http://" + endpoint;
  impl_->timeout = request_timeout;
  impl_->curl.reset(curl_api().easy_init());
  if (!impl_->curl) throw StoreError(StoreErrorKind::ConnectionLost, "libcurl: cannot create a handle");
  impl_->headers.reset(curl_api().slist_append(nullptr, "Content-Type: application/json"));
  // Fail early with a clear message if nothing answers there.
  impl_->post("/v3/kv/range", {{"key", base64_encode("elastrun/")}, {"limit", 1}});
}

EtcdKv::~EtcdKv() = default;

std::uint64_t EtcdKv::set(std::string_view key, std::string_view value, std::uint64_t lease) {
  auto r = impl_->post("/v3/kv/put", impl_->put_op(key, value, lease));
  return u64_of(r["header"], "revision");
}

std::optional<KeyValue> EtcdKv::get(std::string_view key) {
  auto r = impl_->post("/v3/kv/range", {{"key", base64_encode(key)}});
  if (!r.contains("kvs") || r["kvs"].empty()) return std::nullopt;
  return kv_of(r["kvs"][0]);
}

std::int64_t EtcdKv::add(std::string_view key, std::int64_t delta, std::uint64_t lease) {
  // etcd has no atomic add: read, then a transaction that succeeds only if nobody wrote since.
  while (true) {
    auto r = impl_->post("/v3/kv/range", {{"key", base64_encode(key)}});
    std::int64_t current = 0;
    std::uint64_t keep_lease = 0;  // a counter keeps the lease it had unless given another
    json compare;
    if (r.contains("kvs") && !r["kvs"].empty()) {
      auto kv = kv_of(r["kvs"][0]);
      auto parsed = util::parse_integer<std::int64_t>(kv.value);
      if (!parsed)
        throw StoreError(StoreErrorKind::NotANumber,
                         fmt::format("etcd {}: add '{}': value is not a number", impl_->endpoint, key));
      current = *parsed;
      keep_lease = kv.lease;
      compare = {{"key", base64_encode(key)},
                 {"result", "EQUAL"},
                 {"target", "MOD"},
                 {"mod_revision", std::to_string(kv.revision)}};
    } else {
      compare = {{"key", base64_encode(key)}, {"result", "EQUAL"}, {"target", "VERSION"}, {"version", "0"}};
    }
    auto next = current + delta;
    json txn{{"compare", json::array({compare})},
             {"success",
              json::array({{{"request_put", impl_->put_op(key, std::to_string(next), lease ? lease : keep_lease)}}})}};
    if (impl_->post("/v3/kv/txn", txn).value("succeeded", false)) return next;
  }
}

bool EtcdKv::compare_and_set(std::string_view key, const std::optional<std::string>& expected, std::string_view desired,
                             std::uint64_t lease, std::optional<std::string>* current) {
  json compare = expected
                     ? json{{"key", base64_encode(key)},
                            {"result", "EQUAL"},
                            {"target", "VALUE"},
                            {"value", base64_encode(*expected)}}
                     : json{{"key", base64_encode(key)}, {"result", "EQUAL"}, {"target", "VERSION"}, {"version", "0"}};
  json txn{{"compare", json::array({compare})},
           {"success", json::array({{{"request_put", impl_->put_op(key, desired, lease)}}})},
           {"failure", json::array({{{"request_range", {{"key", base64_encode(key)}}}}})}};
  auto r = impl_->post("/v3/kv/txn", txn);
  if (r.value("succeeded", false)) return true;
  if (current) {
    *current = std::nullopt;
    for (const auto& resp : r.value("responses", json::array())) {
      const auto& range = resp.value("response_range", json::object());
      if (range.contains("kvs") && !range["kvs"].empty()) *current = kv_of(range["kvs"][0]).value;
    }
  }
  return false;
}

bool EtcdKv::remove(std::string_view key) {
  auto r = impl_->post("/v3/kv/deleterange", {{"key", base64_encode(key)}});
  return u64_of(r, "deleted") > 0;
}

std::vector<KeyValue> EtcdKv::get_prefix(std::string_view prefix, std::uint64_t* revision) {
  std::string start = prefix.empty() ? std::string(1, '\0') : std::string(prefix);
  auto r =
      impl_->post("/v3/kv/range", {{"key", base64_encode(start)}, {"range_end", base64_encode(range_end(prefix))}});
  if (revision) *revision = u64_of(r["header"], "revision");
  std::vector<KeyValue> out;
  for (const auto& kv : r.value("kvs", json::array())) out.push_back(kv_of(kv));
  return out;
}

std::vector<WatchEvent> EtcdKv::watch(std::string_view prefix, std::uint64_t after_revision, Millis timeout,
                                      std::uint64_t* revision) {
  std::string start = prefix.empty() ? std::string(1, '\0') : std::string(prefix);
  json create{{"create_request",
               {{"key", base64_encode(start)},
                {"range_end", base64_encode(range_end(prefix))},
                {"start_revision", std::to_string(after_revision + 1)}}}};
  auto body = create.dump();
  Impl::Stream stream;
  impl_->prepare("/v3/watch", body, timeout);
  curl_api().easy_setopt(impl_->curl.get(), CURLOPT_WRITEFUNCTION, &Impl::collect_stream);
  curl_api().easy_setopt(impl_->curl.get(), CURLOPT_WRITEDATA, &stream);
  auto rc = curl_api().easy_perform(impl_->curl.get());
  if (rc != CURLE_OK && !(rc == CURLE_WRITE_ERROR && stream.stop) && rc != CURLE_OPERATION_TIMEDOUT)
    throw StoreError(StoreErrorKind::ConnectionLost,
                     fmt::format("etcd {} watch: {}", impl_->endpoint, curl_api().easy_strerror(rc)));
  std::vector<WatchEvent> events;
  std::uint64_t rev = after_revision;
  for (const auto& msg : stream.messages) {
    if (msg.contains("error")) impl_->fail_from(msg, "watch");
    const auto& r = msg.contains("result") ? msg["result"] : msg;
    if (r.contains("compact_revision"))
      throw StoreError(StoreErrorKind::Compacted,
                       fmt::format("etcd {}: watch from revision {} is compacted", impl_->endpoint, after_revision));
    if (r.contains("header")) rev = std::max(rev, u64_of(r["header"], "revision"));
    for (const auto& e : r.value("events", json::array())) {
      WatchEvent w;
      w.type = e.value("type", "PUT") == "DELETE" ? WatchEvent::Type::Delete : WatchEvent::Type::Put;
      auto kv = kv_of(e["kv"]);
      w.key = std::move(kv.key);
      w.value = std::move(kv.value);
      w.revision = kv.revision;
      events.push_back(std::move(w));
    }
  }
  if (!events.empty()) rev = events.back().revision;
  if (revision) *revision = rev;
  return events;
}

std::uint64_t EtcdKv::grant_lease(Millis ttl, std::string_view /*holder: etcd has no use for it*/) {
  auto seconds = std::max<long long>(1, (ttl.count() + 999) / 1000);
  auto r = impl_->post("/v3/lease/grant", {{"TTL", std::to_string(seconds)}});
  return u64_of(r, "ID");
}

bool EtcdKv::keep_alive(std::uint64_t lease) {
  auto r = impl_->post("/v3/lease/keepalive", {{"ID", std::to_string(lease)}});
  const auto& result = r.contains("result") ? r["result"] : r;
  return u64_of(result, "TTL") > 0;
}

void EtcdKv::revoke_lease(std::uint64_t lease) {
  try {
    impl_->post("/v3/lease/revoke", {{"ID", std::to_string(lease)}});
  } catch (const StoreError& e) {
    if (e.kind() != StoreErrorKind::NoSuchLease) throw;
  }
}

}  // namespace elastrun::rdzv
