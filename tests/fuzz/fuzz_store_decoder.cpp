// libFuzzer target: the store's frame decoder and request parser, exactly as the server runs
// them on bytes from the network. Build and run: scripts/fuzz [seconds].
#include <cstddef>
#include <cstdint>

#include "protocol.hpp"  // rdzv/src: the wire protocol is private to rdzv

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace elastrun::rdzv::protocol;
  FrameDecoder decoder;
  // Feed in two pieces to exercise partial frames as well.
  auto half = size / 2;
  try {
    decoder.feed(reinterpret_cast<const char*>(data), half);
    while (auto frame = decoder.next()) {
      try {
        decode_request(*frame);
      } catch (const ProtocolError&) {
      }
    }
    decoder.feed(reinterpret_cast<const char*>(data) + half, size - half);
    while (auto frame = decoder.next()) {
      try {
        auto request = decode_request(*frame);
        // Whatever was accepted must encode back to a frame the decoder accepts again.
        FrameDecoder again;
        auto bytes = encode_request(request);
        again.feed(bytes.data(), bytes.size());
        if (!again.next()) __builtin_trap();
      } catch (const ProtocolError&) {
      }
    }
  } catch (const ProtocolError&) {
  }
  return 0;
}
