#include "comm/plan_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

namespace kvshard {
namespace {

// ---- random messages ----

class Generator {
  public:
    explicit Generator(uint64_t seed) : rng_(seed) {}

    int64_t Int(int64_t lo, int64_t hi) {
        return std::uniform_int_distribution<int64_t>(lo, hi)(rng_);
    }
    // Any finite float, including negative zero, subnormals and huge values.
    float Float() {
        for (;;) {
            const auto bits = static_cast<uint32_t>(rng_());
            float f = 0;
            std::memcpy(&f, &bits, sizeof(f));
            if (std::isfinite(f)) return f;
        }
    }
    std::string Bytes(size_t max_len) {
        std::string s(static_cast<size_t>(Int(0, static_cast<int64_t>(max_len))), '\0');
        for (char& c : s) c = static_cast<char>(Int(0, 255));
        return s;
    }
    template <typename T>
    std::vector<T> Ints(size_t max_len) {
        std::vector<T> v(static_cast<size_t>(Int(0, static_cast<int64_t>(max_len))));
        for (T& x : v) x = static_cast<T>(rng_());
        return v;
    }

    // Block tables of KV cache groups past the first (kNoBlock entries among them).
    std::vector<std::vector<int32_t>> GroupTables() {
        std::vector<std::vector<int32_t>> tables;
        for (int64_t g = Int(0, 3); g > 0; --g) {
            tables.push_back(Ints<int32_t>(20));
            if (!tables.back().empty()) tables.back()[0] = -1;
        }
        return tables;
    }

    StepPlan Plan() {
        StepPlan plan;
        plan.step_id = rng_();
        for (int64_t i = Int(0, 6); i > 0; --i) {
            ScheduledSequence seq;
            seq.seq_id = static_cast<int64_t>(rng_());
            seq.token_ids = Ints<int32_t>(40);
            seq.start_pos = Int(0, 1 << 20);
            seq.block_table = Ints<int32_t>(20);
            seq.slot_mapping = Ints<int64_t>(40);
            seq.group_block_tables = GroupTables();
            for (int64_t g = Int(0, 3); g > 0; --g)
                seq.group_slot_mappings.push_back(Ints<int64_t>(40));
            seq.sample = Int(0, 1) == 1;
            seq.sampling = {Float(), static_cast<int>(Int(-5, 100)), Float(), Float(), rng_()};
            seq.sampling.repetition_penalty = Float();
            seq.sampling.frequency_penalty = Float();
            seq.sampling.presence_penalty = Float();
            for (int64_t b = Int(0, 3); b > 0; --b) {
                seq.sampling.logit_bias.push_back({static_cast<int32_t>(rng_()), Float()});
            }
            seq.sampling.min_tokens = Int(0, 1000);
            seq.sampling.min_tokens_banned_ids = Ints<int32_t>(3);
            seq.num_top_logprobs = static_cast<int32_t>(Int(-1, 20));
            seq.history = Ints<int32_t>(30);
            seq.history_prompt_tokens = Int(0, 30);
            seq.allowed_tokens = Ints<uint64_t>(4);
            seq.num_prompt_logprobs = static_cast<int32_t>(Int(-1, kMaxLogprobs));
            seq.next_prompt_token = static_cast<int32_t>(rng_());
            plan.sequences.push_back(std::move(seq));
        }
        for (int64_t i = Int(0, 4); i > 0; --i) {
            plan.block_copies.push_back(
                {static_cast<int32_t>(rng_()), static_cast<int32_t>(rng_())});
        }
        plan.released_seq_ids = Ints<int64_t>(8);
        for (int64_t i = Int(0, 3); i > 0; --i) {
            plan.kv_recvs.push_back({rng_(), static_cast<int64_t>(rng_()), Ints<int32_t>(10),
                                     GroupTables(), static_cast<int64_t>(rng_()),
                                     static_cast<int64_t>(rng_())});
        }
        for (int64_t i = Int(0, 3); i > 0; --i) {
            KvSendOp op;
            op.transfer_id = rng_();
            op.seq_id = static_cast<int64_t>(rng_());
            op.block_table = Ints<int32_t>(10);
            op.group_block_tables = GroupTables();
            op.num_tokens = static_cast<int64_t>(rng_());
            op.dst_tp = static_cast<int32_t>(rng_());
            for (int64_t k = Int(0, 4); k > 0; --k) op.dst_endpoints.push_back(Bytes(20));
            op.layerwise = Int(0, 1) == 1;
            op.timeout_ms = static_cast<int64_t>(rng_());
            plan.kv_sends.push_back(std::move(op));
        }
        return plan;
    }

    StepResult Result() {
        StepResult result;
        result.step_id = rng_();
        for (int64_t i = Int(0, 6); i > 0; --i) {
            SampledToken token;
            token.seq_id = static_cast<int64_t>(rng_());
            token.token_id = static_cast<int32_t>(rng_());
            token.logprob = Float();
            for (int64_t k = Int(0, 5); k > 0; --k) {
                token.top_logprobs.push_back({static_cast<int32_t>(rng_()), Float()});
            }
            token.rng_state = rng_();
            result.tokens.push_back(std::move(token));
        }
        for (int64_t i = Int(0, 3); i > 0; --i) {
            PromptLogprobs chunk;
            chunk.seq_id = static_cast<int64_t>(rng_());
            chunk.first_pos = static_cast<int64_t>(rng_());
            for (int64_t t = Int(0, 5); t > 0; --t) {
                PromptTokenLogprob token;
                token.token_id = static_cast<int32_t>(rng_());
                token.logprob = Float();
                token.rank = static_cast<int64_t>(rng_());
                for (int64_t k = Int(0, kMaxLogprobs); k > 0; --k)
                    token.top.push_back({static_cast<int32_t>(rng_()), Float()});
                chunk.tokens.push_back(std::move(token));
            }
            result.prompt_logprobs.push_back(std::move(chunk));
        }
        result.compute_seconds = static_cast<double>(Float());
        result.error_code = static_cast<StatusCode>(Int(0, 10));
        result.error = Bytes(30);
        for (int64_t i = Int(0, 3); i > 0; --i)
            result.failed_transfers.push_back(
                {rng_(), static_cast<StatusCode>(Int(1, 10)), Bytes(30), Int(0, 1) == 1, rng_()});
        result.kv_bytes_sent = static_cast<int64_t>(rng_());
        result.kv_bytes_received = static_cast<int64_t>(rng_());
        result.kv_transfer_seconds = static_cast<double>(Float());
        return result;
    }

    Message Any() {
        switch (Int(0, 9)) {
            case 0:
                return Plan();
            case 1:
                return Result();
            case 2:
                return RegisterMessage{static_cast<int32_t>(rng_()),
                                       static_cast<int32_t>(rng_()),
                                       Bytes(20),
                                       static_cast<uint32_t>(rng_()),
                                       Bytes(24),
                                       Bytes(32),
                                       Bytes(16)};
            case 3: {
                RegisterAckMessage ack{Int(0, 1) == 1,
                                       Bytes(30),
                                       Bytes(30),
                                       static_cast<int32_t>(rng_()),
                                       {},
                                       static_cast<int32_t>(rng_())};
                for (int64_t i = Int(0, 5); i > 0; --i)
                    ack.settings.emplace_back(Bytes(8), Bytes(8));
                return ack;
            }
            case 4:
                return HeartbeatMessage{rng_()};
            case 5:
                return ReadyMessage{Int(0, 1) == 1, Bytes(40), static_cast<int64_t>(rng_())};
            case 6:
                return StoreRequestMessage{Int(0, 1) == 1, Bytes(20), Bytes(60)};
            case 7:
                return StoreReplyMessage{Int(0, 1) == 1, Bytes(60), Bytes(20)};
            case 8: {
                RankSettingsMessage m;
                for (int64_t i = Int(0, 5); i > 0; --i) m.settings.emplace_back(Bytes(8), Bytes(8));
                return m;
            }
            default:
                return ShutdownMessage{Bytes(40)};
        }
    }

  private:
    std::mt19937_64 rng_;
};

// A payload with a valid header in front, so that the test reaches the payload decoder.
std::string FrameAround(MessageType type, std::string_view payload) {
    std::string frame = EncodeFrame(HeartbeatMessage{});
    frame.resize(kFrameHeaderBytes);
    frame[6] = static_cast<char>(static_cast<uint16_t>(type) & 0xFF);
    frame[7] = static_cast<char>(static_cast<uint16_t>(type) >> 8);
    const auto n = static_cast<uint32_t>(payload.size());
    const uint32_t crc = Crc32(payload);
    for (int i = 0; i < 4; ++i) {
        frame[8 + i] = static_cast<char>((n >> (8 * i)) & 0xFF);
        frame[12 + i] = static_cast<char>((crc >> (8 * i)) & 0xFF);
    }
    return frame + std::string(payload);
}

// ---- tests ----

TEST(PlanCodec, Crc32MatchesTheStandardCheckValue) {
    EXPECT_EQ(Crc32("123456789"), 0xCBF43926u);
    EXPECT_EQ(Crc32(""), 0u);
}

TEST(PlanCodec, HeaderLayout) {
    StepPlan plan;
    plan.step_id = 7;
    const std::string frame = EncodeFrame(plan);
    ASSERT_GE(frame.size(), kFrameHeaderBytes);
    EXPECT_EQ(frame.substr(0, 4), "KVSF");
    EXPECT_EQ(frame[4], 3);  // version, little-endian
    EXPECT_EQ(frame[5], 0);
    EXPECT_EQ(frame[6], 1);  // MessageType::kStepPlan
    EXPECT_EQ(frame[7], 0);
    // step_id + 7 empty counts (the last two: kv_discards, kv_ready).
    EXPECT_EQ(frame.size(), kFrameHeaderBytes + 8 + 4 + 4 + 4 + 4 + 4 + 4 + 4);
    EXPECT_EQ(frame[8], 36);
}

TEST(PlanCodec, RoundTripsEveryMessageType) {
    StepPlan plan;
    plan.step_id = 42;
    ScheduledSequence seq;
    seq.seq_id = -3;
    seq.token_ids = {1, 2, 150000};
    seq.start_pos = 17;
    seq.block_table = {4, 9};
    seq.slot_mapping = {64 + 1, 64 + 2, 144};
    // Two more KV cache groups: a windowed one whose first block was released.
    seq.group_block_tables = {{-1, 12}, {20, 21}};
    seq.group_slot_mappings = {{192 + 1, 192 + 2, 192 + 16}, {320 + 1, 320 + 2, 336}};
    seq.sample = false;
    seq.sampling = {0.7f, 40, 0.9f, 0.05f, 1234};
    seq.num_top_logprobs = 5;
    ScheduledSequence controlled = seq;
    controlled.sampling.repetition_penalty = 1.3f;
    controlled.sampling.frequency_penalty = -0.5f;
    controlled.sampling.presence_penalty = 2.0f;
    controlled.sampling.logit_bias = {{3, -100.0f}, {70000, 4.5f}};
    controlled.sampling.min_tokens = 12;
    controlled.sampling.min_tokens_banned_ids = {2, 49152};
    controlled.history = {1, 2, 150000, 7, 7};
    controlled.history_prompt_tokens = 3;
    controlled.allowed_tokens = {0x5, ~uint64_t{0}, 0};
    plan.sequences = {seq, controlled};
    plan.block_copies = {{1, 2}, {3, 4}};
    plan.released_seq_ids = {8, 9};
    plan.kv_recvs = {{7, -3, {4, 9}, {{-1, 3}, {5, 6}}, 20, 1500}, {8, 5, {}, {}, 0, 0}};
    plan.kv_sends = {
        {11, 6, {1, 2, 3}, {{-1, 7, 8}}, 40, 2, {"10.0.0.1:5000", "10.0.0.2:5001"}, true, 250},
        {12, 7, {}, {}, 0, 1, {}, false, 0}};
    StepResult result{42,     {{-3, 5, -0.25f, {{5, -0.25f}, {6, -2.0f}}}},
                      0.125,  StatusCode::kDeadlineExceeded,
                      "oops", {},
                      0,      0,
                      0};
    StepResult transfers = result;
    transfers.failed_transfers = {{7, StatusCode::kDeadlineExceeded, "receiver gone", true, 41},
                                  {8, StatusCode::kAborted, ""}};
    transfers.kv_bytes_sent = int64_t{1} << 40;
    transfers.kv_bytes_received = 12345;
    transfers.kv_transfer_seconds = 0.5;
    const std::vector<Message> messages = {
        plan,
        StepPlan{},
        result,
        StepResult{},
        transfers,
        RegisterMessage{1, 2, "instance-0", kControlProtocolVersion, "", ""},
        RegisterMessage{1, 2, "instance-0", kControlProtocolVersion, "127.0.0.1:40123", "secret"},
        RegisterMessage{0, 1, "i", kControlProtocolVersion, "h:1", "3f9a0c"},
        RegisterMessage{kAnyRank, kAnyTp, "i", kControlProtocolVersion, "", "t", "m.gguf"},
        ReadyMessage{true, "", 512},
        ReadyMessage{false, "model.gguf: no such file", 0},
        RegisterAckMessage{true, "", "/models/a.gguf", 2, {{"block_size", "16"}, {"k", ""}}},
        RegisterAckMessage{false, "tp mismatch", "", 0, {}},
        RegisterAckMessage{true, "", "/m.gguf", 4, {}, 3},
        StoreRequestMessage{true, "1", std::string("\0addr\xff", 6)},
        StoreRequestMessage{false, "rank_0", ""},
        StoreReplyMessage{true, "value", ""},
        StoreReplyMessage{false, "", "too many keys"},
        HeartbeatMessage{99},
        ShutdownMessage{"bye"},
        RankSettingsMessage{{{"kv_nccl_pairs", std::string("\0\x01pairs", 7)}, {"k", ""}}},
        RankSettingsMessage{},
    };
    for (const Message& message : messages) {
        const std::string frame = EncodeFrame(message);
        Result<Message> decoded = DecodeFrame(frame);
        ASSERT_TRUE(decoded.ok()) << MessageTypeName(TypeOf(message)) << ": "
                                  << decoded.status().ToString();
        EXPECT_EQ(*decoded, message) << MessageTypeName(TypeOf(message));
    }
}

TEST(PlanCodec, RoundTripsRandomMessages) {
    Generator gen(1);
    for (int i = 0; i < 2000; ++i) {
        const Message message = gen.Any();
        Result<Message> decoded = DecodeFrame(EncodeFrame(message));
        ASSERT_TRUE(decoded.ok()) << "case " << i << ": " << decoded.status().ToString();
        ASSERT_EQ(*decoded, message) << "case " << i;
    }
}

TEST(PlanCodec, RejectsEveryTruncation) {
    Generator gen(2);
    for (int i = 0; i < 20; ++i) {
        const std::string frame = EncodeFrame(i % 2 == 0 ? Message(gen.Plan()) : gen.Result());
        for (size_t n = 0; n < frame.size(); ++n) {
            EXPECT_FALSE(DecodeFrame(std::string_view(frame).substr(0, n)).ok())
                << "prefix of " << n << " of " << frame.size() << " bytes";
        }
        EXPECT_FALSE(DecodeFrame(frame + '\0').ok()) << "one byte too many";
    }
}

// Truncated payloads behind a header that matches them (length and CRC): the payload decoder
// itself must notice that fields are missing.
TEST(PlanCodec, PayloadDecoderRejectsEveryTruncation) {
    Generator gen(3);
    for (int i = 0; i < 30; ++i) {
        const Message message = gen.Any();
        const std::string frame = EncodeFrame(message);
        const std::string_view payload = std::string_view(frame).substr(kFrameHeaderBytes);
        for (size_t n = 0; n < payload.size(); ++n) {
            const Result<Message> decoded =
                DecodeFrame(FrameAround(TypeOf(message), payload.substr(0, n)));
            ASSERT_FALSE(decoded.ok()) << MessageTypeName(TypeOf(message)) << " payload prefix "
                                       << n << " of " << payload.size();
            EXPECT_EQ(decoded.status().code(), StatusCode::kDataLoss);
        }
    }
}

// A failed transfer keeps its Status across the wire: every failing code comes back as it was
// sent, and a frame that says a transfer failed with OK is refused.
TEST(PlanCodec, TransferFailureKeepsItsStatusCode) {
    for (StatusCode code :
         {StatusCode::kInvalidArgument, StatusCode::kUnavailable, StatusCode::kDeadlineExceeded,
          StatusCode::kAborted, StatusCode::kInternal}) {
        StepResult result;
        result.failed_transfers = {
            TransferFailure::Of(9, Status(code, "rank 1: KV piece of transfer 9 timed out"))};
        Result<Message> decoded = DecodeFrame(EncodeFrame(result));
        ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
        const StepResult& back = std::get<StepResult>(*decoded);
        ASSERT_EQ(back.failed_transfers.size(), 1u);
        EXPECT_EQ(back.failed_transfers[0].status().code(), code);
        EXPECT_EQ(back.failed_transfers[0].status().message(),
                  "rank 1: KV piece of transfer 9 timed out");
    }
    StepResult ok_failure;
    ok_failure.failed_transfers = {{9, StatusCode::kOk, "not a failure"}};
    const Status refused = DecodeFrame(EncodeFrame(ok_failure)).status();
    EXPECT_EQ(refused.code(), StatusCode::kDataLoss);
    EXPECT_NE(refused.message().find("TransferFailure.code"), std::string::npos)
        << refused.message();
}

// Merging the ranks' failures: one per transfer, and the rank that saw the cause gives the
// Status rather than one that only saw another rank fail.
TEST(TransferFailures, MergeKeepsOnePerTransferAndTheCause) {
    std::vector<TransferFailure> merged = {
        {1, StatusCode::kAborted, "rank 0: failed on another rank of this instance"},
        {2, StatusCode::kUnavailable, "rank 0: no route"}};
    MergeTransferFailures({{1, StatusCode::kDeadlineExceeded, "rank 1: timed out"},
                           {2, StatusCode::kAborted, "rank 1: failed on another rank"},
                           {3, StatusCode::kInternal, "rank 1: bad piece"}},
                          &merged);
    const std::vector<TransferFailure> expected = {
        {1, StatusCode::kDeadlineExceeded, "rank 1: timed out"},
        {2, StatusCode::kUnavailable, "rank 0: no route"},
        {3, StatusCode::kInternal, "rank 1: bad piece"}};
    EXPECT_EQ(merged, expected);
}

// Any rank's pairs down are the instance's: the merge keeps pairs_down whichever rank's Status
// it keeps, so the coordinator re-plans them.
TEST(TransferFailures, MergeKeepsPairsDownFromAnyRank) {
    std::vector<TransferFailure> merged = {
        {1, StatusCode::kDeadlineExceeded, "rank 0: timed out"},
        {2, StatusCode::kAborted, "rank 0: failed on another rank", true, 9}};
    MergeTransferFailures({{1, StatusCode::kAborted, "rank 1: given up", true, 9},
                           {2, StatusCode::kUnavailable, "rank 1: peer reset"}},
                          &merged);
    const std::vector<TransferFailure> expected = {
        {1, StatusCode::kDeadlineExceeded, "rank 0: timed out", true, 9},
        {2, StatusCode::kUnavailable, "rank 1: peer reset", true, 9}};
    EXPECT_EQ(merged, expected);
}

// The version 2 fields at the end of each message: every truncation of a message that has them
// all is rejected too, by the frame check and by the payload decoder.
TEST(PlanCodec, RejectsEveryTruncationOfTransferFields) {
    StepPlan plan;
    plan.kv_recvs = {{7, -3, {4, 9}, {{-1, 3}}, 20, 1500}};
    plan.kv_sends = {{11, 6, {1, 2, 3}, {{-1, 7, 8}}, 40, 2, {"10.0.0.1:5000", ""}, true, 250}};
    StepResult result;
    result.failed_transfers = {{7, StatusCode::kUnavailable, "receiver gone"}};
    result.kv_bytes_sent = 3;
    const std::vector<Message> messages = {
        plan, result, RegisterMessage{0, 1, "i", kControlProtocolVersion, "h:1", "secret"},
        ReadyMessage{false, "bad", 4}};
    for (const Message& message : messages) {
        const std::string frame = EncodeFrame(message);
        const std::string_view payload = std::string_view(frame).substr(kFrameHeaderBytes);
        for (size_t n = 0; n < frame.size(); ++n) {
            EXPECT_FALSE(DecodeFrame(std::string_view(frame).substr(0, n)).ok())
                << MessageTypeName(TypeOf(message)) << " frame prefix " << n;
        }
        for (size_t n = 0; n < payload.size(); ++n) {
            const Status status =
                DecodeFrame(FrameAround(TypeOf(message), payload.substr(0, n))).status();
            EXPECT_EQ(status.code(), StatusCode::kDataLoss)
                << MessageTypeName(TypeOf(message)) << " payload prefix " << n;
        }
    }
}

TEST(PlanCodec, ByteFlipsAreRejectedOrDecodeToAValidMessage) {
    Generator gen(4);
    std::mt19937_64 rng(5);
    int rejected = 0;
    for (int i = 0; i < 3000; ++i) {
        std::string frame = EncodeFrame(gen.Any());
        const size_t at = rng() % frame.size();
        frame[at] = static_cast<char>(frame[at] ^ static_cast<char>(1 + rng() % 255));
        // Half the time, repair length and CRC so that the flip reaches the payload decoder.
        if (i % 2 == 1 && at >= kFrameHeaderBytes) {
            const auto type = static_cast<MessageType>(static_cast<uint8_t>(frame[6]));
            frame = FrameAround(type, std::string_view(frame).substr(kFrameHeaderBytes));
        }
        const Result<Message> decoded = DecodeFrame(frame);
        if (!decoded.ok()) {
            ++rejected;
            continue;
        }
        const Result<Message> again = DecodeFrame(EncodeFrame(*decoded));
        ASSERT_TRUE(again.ok()) << again.status().ToString();
    }
    EXPECT_GT(rejected, 1000);  // every unrepaired flip: header checks or the CRC
}

TEST(PlanCodec, RejectsBadHeaders) {
    const std::string good = EncodeFrame(ShutdownMessage{"x"});
    struct Case {
        const char* name;
        size_t offset;
        char value;
        StatusCode code;
    };
    const std::vector<Case> cases = {
        {"magic", 0, 'X', StatusCode::kDataLoss},
        {"version 1", 4, 1, StatusCode::kUnimplemented},
        {"version 2", 4, 2, StatusCode::kUnimplemented},
        {"version 4", 4, 4, StatusCode::kUnimplemented},
        {"type 0", 6, 0, StatusCode::kDataLoss},
        {"type 10", 6, 10, StatusCode::kDataLoss},
        {"type high byte", 7, 1, StatusCode::kDataLoss},
        {"length", 8, 0, StatusCode::kDataLoss},
        {"crc", 12, 0, StatusCode::kDataLoss},
    };
    for (const Case& c : cases) {
        std::string frame = good;
        frame[c.offset] = c.value;
        const Status status = DecodeFrame(frame).status();
        EXPECT_EQ(status.code(), c.code) << c.name << ": " << status.ToString();
    }
}

TEST(PlanCodec, RejectsOversizedFramesFromTheHeaderAlone) {
    const std::string frame = EncodeFrame(ShutdownMessage{std::string(100, 'x')});
    EXPECT_EQ(DecodeFrame(frame, /*max_payload_bytes=*/103).status().code(),
              StatusCode::kResourceExhausted);
    EXPECT_TRUE(DecodeFrame(frame, /*max_payload_bytes=*/104).ok());
    // A header announcing 4 GiB is refused before anything is read or allocated.
    std::string huge = frame.substr(0, kFrameHeaderBytes);
    for (int i = 8; i < 12; ++i) huge[i] = static_cast<char>(0xFF);
    EXPECT_EQ(DecodeFrameHeader(huge).status().code(), StatusCode::kResourceExhausted);
}

TEST(PlanCodec, RejectsMalformedPayloads) {
    auto u32 = [](uint32_t v) {
        std::string s(4, '\0');
        for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xFF);
        return s;
    };
    const std::string step_id(8, '\0');
    struct Case {
        const char* name;
        MessageType type;
        std::string payload;
    };
    const std::vector<Case> cases = {
        // 4 billion sequences claimed in a few bytes: refused before any reserve().
        {"huge sequence count", MessageType::kStepPlan, step_id + u32(0xFFFFFFFFu)},
        {"huge string", MessageType::kShutdown, u32(1000) + "short"},
        {"bool byte 2", MessageType::kRegisterAck,
         std::string(1, '\2') + u32(0) + u32(0) + u32(1) + u32(0)},
        {"too many settings", MessageType::kRegisterAck,
         std::string(1, '\1') + u32(0) + u32(0) + u32(1) + u32(70'000) +
             std::string(70'000 * 8, '\0')},
        {"trailing byte", MessageType::kHeartbeat, std::string(9, '\0')},
        {"huge kv_recvs count", MessageType::kStepPlan,
         step_id + u32(0) + u32(0) + u32(0) + u32(0x10000000u)},
        {"too many dst_endpoints", MessageType::kStepPlan,
         step_id + u32(0) + u32(0) + u32(0) + u32(0) + u32(1) + std::string(16, '\0') + u32(0) +
             u32(0) + std::string(8, '\0') + std::string(4, '\0') + u32(5000) +
             std::string(5000 * 4 + 9, '\0')},
        {"ready bool byte 7", MessageType::kReady,
         std::string(1, '\7') + u32(0) + std::string(8, '\0')},
        {"empty heartbeat", MessageType::kHeartbeat, ""},
        // A step's error code past the last StatusCode.
        {"unknown error code", MessageType::kStepResult,
         step_id + u32(0) + u32(0) + std::string(8, '\0') + u32(11) + u32(0) + u32(0) +
             std::string(8 + 8 + 8, '\0')},
        // More KV cache groups than kv::kMaxKvCacheGroups, in a sequence and in a receive.
        {"too many group tables", MessageType::kStepPlan,
         step_id + u32(1) + std::string(8, '\0') + u32(0) + std::string(8, '\0') + u32(0) + u32(0) +
             u32(kv::kMaxKvCacheGroups) + std::string(kv::kMaxKvCacheGroups * 4 + 200, '\0')},
        {"too many receive group tables", MessageType::kStepPlan,
         step_id + u32(0) + u32(0) + u32(0) + u32(1) + std::string(16, '\0') + u32(0) +
             u32(kv::kMaxKvCacheGroups) + std::string(kv::kMaxKvCacheGroups * 4 + 200, '\0')},
        // A prompt token with more alternatives than any request may ask for.
        {"too many prompt alternatives", MessageType::kStepResult,
         step_id + u32(0) + u32(1) + std::string(16, '\0') + u32(1) + std::string(16, '\0') +
             u32(kMaxLogprobs + 1) + std::string((kMaxLogprobs + 1) * 8 + 100, '\0')},
        // A chunk claiming more scored tokens than the frame could hold.
        {"huge prompt token count", MessageType::kStepResult,
         step_id + u32(0) + u32(1) + std::string(16, '\0') + u32(0x10000000u) +
             std::string(64, '\0')},
    };
    for (const Case& c : cases) {
        const Status status = DecodeFrame(FrameAround(c.type, c.payload)).status();
        EXPECT_EQ(status.code(), StatusCode::kDataLoss) << c.name << ": " << status.ToString();
    }
}

TEST(PlanCodec, AStepErrorKeepsItsCode) {
    StepResult failed;
    failed.step_id = 7;
    SetStepError(&failed, Status(StatusCode::kDeadlineExceeded, "rank 1: KV receive timed out"));
    Result<Message> decoded = DecodeFrame(EncodeFrame(failed));
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    const Status back = StepError(std::get<StepResult>(*decoded));
    EXPECT_EQ(back.code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(back.message(), "rank 1: KV receive timed out");
    EXPECT_TRUE(StepError(StepResult{}).ok());

    std::string payload = EncodeFrame(failed).substr(kFrameHeaderBytes);
    // step_id, no tokens, no prompt logprobs, compute_seconds, then the code: 11 is past kInternal.
    payload[8 + 4 + 4 + 8] = 11;
    const Status bad = DecodeFrame(FrameAround(MessageType::kStepResult, payload)).status();
    EXPECT_EQ(bad.code(), StatusCode::kDataLoss);
    EXPECT_NE(bad.message().find("StepResult.error_code: 11"), std::string::npos) << bad.ToString();
}

TEST(PlanCodec, RejectsAPromptLogprobsRequestPastTheLimit) {
    StepPlan plan;
    ScheduledSequence seq;
    seq.token_ids = {1, 2};
    seq.num_prompt_logprobs = kMaxLogprobs;
    plan.sequences.push_back(seq);
    ASSERT_TRUE(DecodeFrame(EncodeFrame(plan)).ok());
    for (int32_t bad : {kMaxLogprobs + 1, -2}) {
        plan.sequences[0].num_prompt_logprobs = bad;
        const Status status = DecodeFrame(EncodeFrame(plan)).status();
        EXPECT_EQ(status.code(), StatusCode::kDataLoss) << bad;
        EXPECT_NE(status.message().find("num_prompt_logprobs"), std::string::npos)
            << status.ToString();
    }
}

TEST(PlanCodec, ErrorsNameTheProblem) {
    const std::string frame = EncodeFrame(ShutdownMessage{"x"});
    EXPECT_NE(DecodeFrame("GARBAGE-GARBAGE!").status().message().find("magic"), std::string::npos);
    EXPECT_NE(
        DecodeFrame(std::string_view(frame).substr(0, 10)).status().message().find("truncated"),
        std::string::npos);
    std::string bad_crc = frame;
    bad_crc.back() = 'y';
    EXPECT_NE(DecodeFrame(bad_crc).status().message().find("CRC"), std::string::npos);
}

}  // namespace
}  // namespace kvshard
