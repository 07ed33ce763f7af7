// libFuzzer target for the frame codec (comm/plan_codec.h). Built with -DKVSHARD_BUILD_FUZZERS=ON
// and clang; see comm/CMakeLists.txt and docs/comm.md for how to run it.
//
// Every input is decoded twice: as a whole frame, and as a payload of each message type with a
// header made to match (so the fuzzer explores payload decoding without having to guess a CRC).
// Decoding must never crash, and whatever decodes must re-encode to a frame that decodes to the
// same message.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "comm/plan_codec.h"

namespace {

// NaN != NaN, so compare re-encoded bytes rather than messages.
void CheckRoundTrip(const kvshard::Message& message) {
    const std::string frame = kvshard::EncodeFrame(message);
    kvshard::Result<kvshard::Message> again = kvshard::DecodeFrame(frame);
    if (!again.ok()) {
        std::fprintf(stderr, "re-encoded frame does not decode: %s\n",
                     again.status().ToString().c_str());
        std::abort();
    }
    if (kvshard::EncodeFrame(*again) != frame) {
        std::fprintf(stderr, "re-encoded frame decodes to a different message\n");
        std::abort();
    }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    const std::string_view bytes(reinterpret_cast<const char*>(data), size);
    constexpr uint32_t kMaxPayload = 1 << 20;

    kvshard::Result<kvshard::Message> whole = kvshard::DecodeFrame(bytes, kMaxPayload);
    if (whole.ok()) CheckRoundTrip(*whole);

    if (size > kMaxPayload) return 0;
    for (uint16_t type = 1; type <= static_cast<uint16_t>(kvshard::MessageType::kReady); ++type) {
        kvshard::FrameHeader header;
        header.type = static_cast<kvshard::MessageType>(type);
        header.payload_bytes = static_cast<uint32_t>(size);
        header.payload_crc32 = kvshard::Crc32(bytes);
        kvshard::Result<kvshard::Message> payload = kvshard::DecodePayload(header, bytes);
        if (payload.ok()) CheckRoundTrip(*payload);
    }
    return 0;
}
