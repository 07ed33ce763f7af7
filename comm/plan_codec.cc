#include "comm/plan_codec.h"

#include <zlib.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/check.h"

namespace kvshard {
namespace {

// ---- encoding ----

class Writer {
  public:
    explicit Writer(std::string* out) : out_(out) {}

    template <typename T>
    void Fixed(T value) {
        static_assert(std::is_integral_v<T>);
        using U = std::make_unsigned_t<T>;
        auto bits = static_cast<U>(value);
        for (size_t i = 0; i < sizeof(T); ++i) {
            out_->push_back(static_cast<char>(bits & 0xFF));
            bits = static_cast<U>(bits >> 8);
        }
    }
    void F32(float value) {
        uint32_t bits = 0;
        std::memcpy(&bits, &value, sizeof(bits));
        Fixed(bits);
    }
    void F64(double value) {
        uint64_t bits = 0;
        std::memcpy(&bits, &value, sizeof(bits));
        Fixed(bits);
    }
    void Bool(bool value) { out_->push_back(value ? 1 : 0); }
    void Count(size_t n) {
        KV_CHECK_LE(n, size_t{UINT32_MAX}) << "too many elements for a frame";
        Fixed(static_cast<uint32_t>(n));
    }
    void String(const std::string& s) {
        Count(s.size());
        out_->append(s);
    }
    template <typename T>
    void Ints(const std::vector<T>& values) {
        Count(values.size());
        for (T v : values) Fixed(v);
    }

  private:
    std::string* out_;
};

// The block tables of KV cache groups 1 .. G - 1.
void GroupTables(Writer& w, const std::vector<std::vector<int32_t>>& tables) {
    w.Count(tables.size());
    for (const std::vector<int32_t>& table : tables) w.Ints(table);
}

void Encode(Writer& w, const StepPlan& plan) {
    w.Fixed(plan.step_id);
    w.Count(plan.sequences.size());
    for (const ScheduledSequence& seq : plan.sequences) {
        w.Fixed(seq.seq_id);
        w.Ints(seq.token_ids);
        w.Fixed(seq.start_pos);
        w.Ints(seq.block_table);
        w.Ints(seq.slot_mapping);
        GroupTables(w, seq.group_block_tables);
        w.Count(seq.group_slot_mappings.size());
        for (const std::vector<int64_t>& slots : seq.group_slot_mappings) w.Ints(slots);
        w.Bool(seq.sample);
        w.F32(seq.sampling.temperature);
        w.Fixed(static_cast<int32_t>(seq.sampling.top_k));
        w.F32(seq.sampling.top_p);
        w.F32(seq.sampling.min_p);
        w.Fixed(seq.sampling.seed);
        w.F32(seq.sampling.repetition_penalty);
        w.F32(seq.sampling.frequency_penalty);
        w.F32(seq.sampling.presence_penalty);
        w.Count(seq.sampling.logit_bias.size());
        for (const TokenBias& b : seq.sampling.logit_bias) {
            w.Fixed(b.token_id);
            w.F32(b.bias);
        }
        w.Fixed(seq.sampling.min_tokens);
        w.Ints(seq.sampling.min_tokens_banned_ids);
        w.Fixed(seq.num_top_logprobs);
        w.Ints(seq.history);
        w.Fixed(seq.history_prompt_tokens);
        w.Ints(seq.allowed_tokens);
        w.Fixed(seq.num_prompt_logprobs);
        w.Fixed(seq.next_prompt_token);
    }
    w.Count(plan.block_copies.size());
    for (const kv::CopyOp& op : plan.block_copies) {
        w.Fixed(op.src_block);
        w.Fixed(op.dst_block);
    }
    w.Ints(plan.released_seq_ids);
    w.Count(plan.kv_recvs.size());
    for (const KvRecvOp& op : plan.kv_recvs) {
        w.Fixed(op.transfer_id);
        w.Fixed(op.seq_id);
        w.Ints(op.block_table);
        GroupTables(w, op.group_block_tables);
        w.Fixed(op.num_tokens);
        w.Fixed(op.timeout_ms);
    }
    w.Count(plan.kv_sends.size());
    for (const KvSendOp& op : plan.kv_sends) {
        w.Fixed(op.transfer_id);
        w.Fixed(op.seq_id);
        w.Ints(op.block_table);
        GroupTables(w, op.group_block_tables);
        w.Fixed(op.num_tokens);
        w.Fixed(op.dst_tp);
        w.Count(op.dst_endpoints.size());
        for (const std::string& endpoint : op.dst_endpoints) w.String(endpoint);
        w.Bool(op.layerwise);
        w.Fixed(op.timeout_ms);
    }
}

// A token's alternatives, as both a sampled token and a scored prompt token carry them.
void EncodeTopLogprobs(Writer& w, const std::vector<TokenLogprob>& top) {
    w.Count(top.size());
    for (const TokenLogprob& t : top) {
        w.Fixed(t.token_id);
        w.F32(t.logprob);
    }
}

void Encode(Writer& w, const StepResult& result) {
    w.Fixed(result.step_id);
    w.Count(result.tokens.size());
    for (const SampledToken& token : result.tokens) {
        w.Fixed(token.seq_id);
        w.Fixed(token.token_id);
        w.F32(token.logprob);
        EncodeTopLogprobs(w, token.top_logprobs);
        w.Fixed(token.rng_state);
    }
    w.Count(result.prompt_logprobs.size());
    for (const PromptLogprobs& chunk : result.prompt_logprobs) {
        w.Fixed(chunk.seq_id);
        w.Fixed(chunk.first_pos);
        w.Count(chunk.tokens.size());
        for (const PromptTokenLogprob& token : chunk.tokens) {
            w.Fixed(token.token_id);
            w.F32(token.logprob);
            w.Fixed(token.rank);
            EncodeTopLogprobs(w, token.top);
        }
    }
    w.F64(result.compute_seconds);
    w.Fixed(static_cast<uint32_t>(result.error_code));
    w.String(result.error);
    w.Count(result.failed_transfers.size());
    for (const TransferFailure& failure : result.failed_transfers) {
        w.Fixed(failure.transfer_id);
        w.String(failure.error);
    }
    w.Fixed(result.kv_bytes_sent);
    w.Fixed(result.kv_bytes_received);
    w.F64(result.kv_transfer_seconds);
}

void Encode(Writer& w, const RegisterMessage& m) {
    w.Fixed(m.worker_rank);
    w.Fixed(m.tp);
    w.String(m.instance_id);
    w.Fixed(m.protocol_version);
    w.String(m.kv_endpoint);
    w.String(m.token);
    w.String(m.model);
}

void Encode(Writer& w, const RegisterAckMessage& m) {
    w.Bool(m.accepted);
    w.String(m.error);
    w.String(m.model_path);
    w.Fixed(m.tp);
    w.Count(m.settings.size());
    for (const auto& [key, value] : m.settings) {
        w.String(key);
        w.String(value);
    }
    w.Fixed(m.rank);
}

void Encode(Writer& w, const HeartbeatMessage& m) { w.Fixed(m.sequence); }

void Encode(Writer& w, const ShutdownMessage& m) { w.String(m.reason); }

void Encode(Writer& w, const ReadyMessage& m) {
    w.Bool(m.ok);
    w.String(m.error);
    w.Fixed(m.num_kv_blocks);
}

void Encode(Writer& w, const StoreRequestMessage& m) {
    w.Bool(m.set);
    w.String(m.key);
    w.String(m.value);
}

void Encode(Writer& w, const StoreReplyMessage& m) {
    w.Bool(m.found);
    w.String(m.value);
    w.String(m.error);
}

// ---- decoding ----

// Reads fields from a payload. The first problem is remembered and later reads return zeros,
// so a decoder reads straight through and checks status() once at the end.
class Reader {
  public:
    explicit Reader(std::string_view bytes) : bytes_(bytes) {}

    const Status& status() const { return status_; }

    template <typename T>
    T Fixed(const char* field) {
        static_assert(std::is_integral_v<T>);
        if (!Need(sizeof(T), field)) return T{};
        std::make_unsigned_t<T> bits = 0;
        for (size_t i = 0; i < sizeof(T); ++i) {
            bits |= static_cast<std::make_unsigned_t<T>>(static_cast<uint8_t>(bytes_[pos_ + i]))
                    << (8 * i);
        }
        pos_ += sizeof(T);
        return static_cast<T>(bits);
    }
    float F32(const char* field) {
        const auto bits = Fixed<uint32_t>(field);
        float value = 0;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
    double F64(const char* field) {
        const auto bits = Fixed<uint64_t>(field);
        double value = 0;
        std::memcpy(&value, &bits, sizeof(value));
        return value;
    }
    bool Bool(const char* field) {
        const auto byte = Fixed<uint8_t>(field);
        if (byte > 1) Fail(std::string(field) + ": bool byte " + std::to_string(byte));
        return byte == 1;
    }
    StatusCode Code(const char* field) {
        const auto code = Fixed<uint32_t>(field);
        if (code > static_cast<uint32_t>(StatusCode::kInternal)) {
            Fail(std::string(field) + ": " + std::to_string(code) + " is no status code");
            return StatusCode::kInternal;
        }
        return static_cast<StatusCode>(code);
    }
    // An element count, refused when the remaining bytes cannot hold that many elements of at
    // least `min_element_bytes` each: what makes the reserve() calls below safe.
    uint32_t Count(const char* field, size_t min_element_bytes, uint32_t max = UINT32_MAX) {
        const auto n = Fixed<uint32_t>(field);
        if (status_.ok() && n > max) {
            Fail(std::string(field) + ": " + std::to_string(n) + " elements, at most " +
                 std::to_string(max) + " allowed");
            return 0;
        }
        if (status_.ok() && n > (bytes_.size() - pos_) / min_element_bytes) {
            Fail(std::string(field) + ": " + std::to_string(n) + " elements of at least " +
                 std::to_string(min_element_bytes) + " bytes, but only " +
                 std::to_string(bytes_.size() - pos_) + " bytes remain");
            return 0;
        }
        return n;
    }
    std::string String(const char* field) {
        const uint32_t n = Count(field, 1);
        if (!status_.ok()) return {};
        std::string s(bytes_.substr(pos_, n));
        pos_ += n;
        return s;
    }
    template <typename T>
    std::vector<T> Ints(const char* field) {
        const uint32_t n = Count(field, sizeof(T));
        std::vector<T> values;
        values.reserve(n);
        for (uint32_t i = 0; i < n && status_.ok(); ++i) values.push_back(Fixed<T>(field));
        return values;
    }
    void Finish() {
        if (status_.ok() && pos_ != bytes_.size()) {
            Fail(std::to_string(bytes_.size() - pos_) + " bytes after the last field");
        }
    }
    // Fails the decode (the first failure is kept).
    void Fail(std::string message) {
        if (status_.ok()) {
            status_ = DataLoss("malformed payload at byte " + std::to_string(pos_) + ": " +
                               std::move(message));
        }
    }

  private:
    bool Need(size_t n, const char* field) {
        if (!status_.ok()) return false;
        if (bytes_.size() - pos_ < n) {
            Fail(std::string(field) + ": truncated (needs " + std::to_string(n) + " bytes, " +
                 std::to_string(bytes_.size() - pos_) + " remain)");
            return false;
        }
        return true;
    }

    std::string_view bytes_;
    size_t pos_ = 0;
    Status status_;
};

// Smallest encodings, for Reader::Count. The decoded structs take at most about 2.3 times their
// smallest encoding in memory (ScheduledSequence: 152 bytes for 61), which bounds the memory a
// frame can make the decoder allocate; a group's table (24 bytes for 4) is capped at
// kMaxExtraGroups per sequence or op.
constexpr size_t kMinSequenceBytes = 8 + 4 + 8 + 4 + 4 + 4 + 4 + 1 + 4 + 4 + 4 + 4 + 8 + 4 + 4 + 4 +
                                     4 + 8 + 4 + 4 + 4 + 8 + 4 + 4 + 4;
// Prompt logprobs: a chunk (40 bytes in memory for 20) and a scored token (40 for 20), whose
// alternatives are at most kMaxLogprobs.
constexpr size_t kMinPromptLogprobsBytes = 8 + 8 + 4;
constexpr size_t kMinPromptTokenBytes = 4 + 4 + 8 + 4;
// A token mask covers a vocabulary of at most 2^24 tokens.
constexpr uint32_t kMaxAllowedTokenWords = (1u << 24) / 64;
constexpr size_t kMinSampledTokenBytes = 8 + 4 + 4 + 4 + 8;
constexpr uint32_t kMaxSettings = 1 << 16;
constexpr size_t kMinKvRecvBytes = 8 + 8 + 4 + 4 + 8 + 8;
constexpr size_t kMinKvSendBytes = 8 + 8 + 4 + 4 + 8 + 4 + 4 + 1 + 8;
constexpr size_t kMinTransferFailureBytes = 8 + 4;
// Receiving ranks of one send (a tensor-parallel size); strings cost 32 bytes in memory for 4 on
// the wire, so the list is capped like RegisterAck's settings.
constexpr uint32_t kMaxDstEndpoints = 1 << 12;

// KV cache groups beyond group 0 (kv::kMaxKvCacheGroups in all), each table counted as today's.
constexpr uint32_t kMaxExtraGroups = static_cast<uint32_t>(kv::kMaxKvCacheGroups - 1);

std::vector<std::vector<int32_t>> DecodeGroupTables(Reader& r, const char* field) {
    const uint32_t n = r.Count(field, 4, kMaxExtraGroups);
    std::vector<std::vector<int32_t>> tables;
    tables.reserve(n);
    for (uint32_t g = 0; g < n && r.status().ok(); ++g) tables.push_back(r.Ints<int32_t>(field));
    return tables;
}

StepPlan DecodeStepPlan(Reader& r) {
    StepPlan plan;
    plan.step_id = r.Fixed<uint64_t>("StepPlan.step_id");
    const uint32_t num_sequences = r.Count("StepPlan.sequences", kMinSequenceBytes);
    plan.sequences.reserve(num_sequences);
    for (uint32_t i = 0; i < num_sequences && r.status().ok(); ++i) {
        ScheduledSequence& seq = plan.sequences.emplace_back();
        seq.seq_id = r.Fixed<int64_t>("ScheduledSequence.seq_id");
        seq.token_ids = r.Ints<int32_t>("ScheduledSequence.token_ids");
        seq.start_pos = r.Fixed<int64_t>("ScheduledSequence.start_pos");
        seq.block_table = r.Ints<int32_t>("ScheduledSequence.block_table");
        seq.slot_mapping = r.Ints<int64_t>("ScheduledSequence.slot_mapping");
        seq.group_block_tables = DecodeGroupTables(r, "ScheduledSequence.group_block_tables");
        const uint32_t num_slot_groups =
            r.Count("ScheduledSequence.group_slot_mappings", 4, kMaxExtraGroups);
        seq.group_slot_mappings.reserve(num_slot_groups);
        for (uint32_t g = 0; g < num_slot_groups && r.status().ok(); ++g) {
            seq.group_slot_mappings.push_back(
                r.Ints<int64_t>("ScheduledSequence.group_slot_mappings"));
        }
        seq.sample = r.Bool("ScheduledSequence.sample");
        seq.sampling.temperature = r.F32("SamplingParams.temperature");
        seq.sampling.top_k = r.Fixed<int32_t>("SamplingParams.top_k");
        seq.sampling.top_p = r.F32("SamplingParams.top_p");
        seq.sampling.min_p = r.F32("SamplingParams.min_p");
        seq.sampling.seed = r.Fixed<uint64_t>("SamplingParams.seed");
        seq.sampling.repetition_penalty = r.F32("SamplingParams.repetition_penalty");
        seq.sampling.frequency_penalty = r.F32("SamplingParams.frequency_penalty");
        seq.sampling.presence_penalty = r.F32("SamplingParams.presence_penalty");
        const uint32_t num_biases = r.Count("SamplingParams.logit_bias", 8);
        seq.sampling.logit_bias.reserve(num_biases);
        for (uint32_t b = 0; b < num_biases && r.status().ok(); ++b) {
            TokenBias& bias = seq.sampling.logit_bias.emplace_back();
            bias.token_id = r.Fixed<int32_t>("TokenBias.token_id");
            bias.bias = r.F32("TokenBias.bias");
        }
        seq.sampling.min_tokens = r.Fixed<int64_t>("SamplingParams.min_tokens");
        seq.sampling.min_tokens_banned_ids =
            r.Ints<int32_t>("SamplingParams.min_tokens_banned_ids");
        seq.num_top_logprobs = r.Fixed<int32_t>("ScheduledSequence.num_top_logprobs");
        seq.history = r.Ints<int32_t>("ScheduledSequence.history");
        seq.history_prompt_tokens = r.Fixed<int64_t>("ScheduledSequence.history_prompt_tokens");
        const uint32_t num_words =
            r.Count("ScheduledSequence.allowed_tokens", 8, kMaxAllowedTokenWords);
        seq.allowed_tokens.reserve(num_words);
        for (uint32_t w = 0; w < num_words && r.status().ok(); ++w) {
            seq.allowed_tokens.push_back(r.Fixed<uint64_t>("ScheduledSequence.allowed_tokens"));
        }
        seq.num_prompt_logprobs = r.Fixed<int32_t>("ScheduledSequence.num_prompt_logprobs");
        if (r.status().ok() &&
            (seq.num_prompt_logprobs < -1 || seq.num_prompt_logprobs > kMaxLogprobs)) {
            r.Fail("ScheduledSequence.num_prompt_logprobs: " +
                   std::to_string(seq.num_prompt_logprobs) + ", not in -1.." +
                   std::to_string(kMaxLogprobs));
        }
        seq.next_prompt_token = r.Fixed<int32_t>("ScheduledSequence.next_prompt_token");
    }
    const uint32_t num_copies = r.Count("StepPlan.block_copies", 8);
    plan.block_copies.reserve(num_copies);
    for (uint32_t i = 0; i < num_copies && r.status().ok(); ++i) {
        kv::CopyOp& op = plan.block_copies.emplace_back();
        op.src_block = r.Fixed<int32_t>("CopyOp.src_block");
        op.dst_block = r.Fixed<int32_t>("CopyOp.dst_block");
    }
    plan.released_seq_ids = r.Ints<int64_t>("StepPlan.released_seq_ids");
    const uint32_t num_recvs = r.Count("StepPlan.kv_recvs", kMinKvRecvBytes);
    plan.kv_recvs.reserve(num_recvs);
    for (uint32_t i = 0; i < num_recvs && r.status().ok(); ++i) {
        KvRecvOp& op = plan.kv_recvs.emplace_back();
        op.transfer_id = r.Fixed<uint64_t>("KvRecvOp.transfer_id");
        op.seq_id = r.Fixed<int64_t>("KvRecvOp.seq_id");
        op.block_table = r.Ints<int32_t>("KvRecvOp.block_table");
        op.group_block_tables = DecodeGroupTables(r, "KvRecvOp.group_block_tables");
        op.num_tokens = r.Fixed<int64_t>("KvRecvOp.num_tokens");
        op.timeout_ms = r.Fixed<int64_t>("KvRecvOp.timeout_ms");
    }
    const uint32_t num_sends = r.Count("StepPlan.kv_sends", kMinKvSendBytes);
    plan.kv_sends.reserve(num_sends);
    for (uint32_t i = 0; i < num_sends && r.status().ok(); ++i) {
        KvSendOp& op = plan.kv_sends.emplace_back();
        op.transfer_id = r.Fixed<uint64_t>("KvSendOp.transfer_id");
        op.seq_id = r.Fixed<int64_t>("KvSendOp.seq_id");
        op.block_table = r.Ints<int32_t>("KvSendOp.block_table");
        op.group_block_tables = DecodeGroupTables(r, "KvSendOp.group_block_tables");
        op.num_tokens = r.Fixed<int64_t>("KvSendOp.num_tokens");
        op.dst_tp = r.Fixed<int32_t>("KvSendOp.dst_tp");
        const uint32_t n = r.Count("KvSendOp.dst_endpoints", 4, kMaxDstEndpoints);
        op.dst_endpoints.reserve(n);
        for (uint32_t k = 0; k < n && r.status().ok(); ++k) {
            op.dst_endpoints.push_back(r.String("KvSendOp.dst_endpoints"));
        }
        op.layerwise = r.Bool("KvSendOp.layerwise");
        op.timeout_ms = r.Fixed<int64_t>("KvSendOp.timeout_ms");
    }
    return plan;
}

void DecodeTopLogprobs(Reader& r, const char* field, uint32_t max, std::vector<TokenLogprob>* top) {
    const uint32_t n = r.Count(field, 8, max);
    top->reserve(n);
    for (uint32_t k = 0; k < n && r.status().ok(); ++k) {
        TokenLogprob& t = top->emplace_back();
        t.token_id = r.Fixed<int32_t>("TokenLogprob.token_id");
        t.logprob = r.F32("TokenLogprob.logprob");
    }
}

StepResult DecodeStepResult(Reader& r) {
    StepResult result;
    result.step_id = r.Fixed<uint64_t>("StepResult.step_id");
    const uint32_t num_tokens = r.Count("StepResult.tokens", kMinSampledTokenBytes);
    result.tokens.reserve(num_tokens);
    for (uint32_t i = 0; i < num_tokens && r.status().ok(); ++i) {
        SampledToken& token = result.tokens.emplace_back();
        token.seq_id = r.Fixed<int64_t>("SampledToken.seq_id");
        token.token_id = r.Fixed<int32_t>("SampledToken.token_id");
        token.logprob = r.F32("SampledToken.logprob");
        DecodeTopLogprobs(r, "SampledToken.top_logprobs", UINT32_MAX, &token.top_logprobs);
        token.rng_state = r.Fixed<uint64_t>("SampledToken.rng_state");
    }
    const uint32_t num_chunks = r.Count("StepResult.prompt_logprobs", kMinPromptLogprobsBytes);
    result.prompt_logprobs.reserve(num_chunks);
    for (uint32_t i = 0; i < num_chunks && r.status().ok(); ++i) {
        PromptLogprobs& chunk = result.prompt_logprobs.emplace_back();
        chunk.seq_id = r.Fixed<int64_t>("PromptLogprobs.seq_id");
        chunk.first_pos = r.Fixed<int64_t>("PromptLogprobs.first_pos");
        const uint32_t n = r.Count("PromptLogprobs.tokens", kMinPromptTokenBytes);
        chunk.tokens.reserve(n);
        for (uint32_t t = 0; t < n && r.status().ok(); ++t) {
            PromptTokenLogprob& token = chunk.tokens.emplace_back();
            token.token_id = r.Fixed<int32_t>("PromptTokenLogprob.token_id");
            token.logprob = r.F32("PromptTokenLogprob.logprob");
            token.rank = r.Fixed<int64_t>("PromptTokenLogprob.rank");
            DecodeTopLogprobs(r, "PromptTokenLogprob.top", kMaxLogprobs, &token.top);
        }
    }
    result.compute_seconds = r.F64("StepResult.compute_seconds");
    result.error_code = r.Code("StepResult.error_code");
    result.error = r.String("StepResult.error");
    const uint32_t num_failures = r.Count("StepResult.failed_transfers", kMinTransferFailureBytes);
    result.failed_transfers.reserve(num_failures);
    for (uint32_t i = 0; i < num_failures && r.status().ok(); ++i) {
        TransferFailure& failure = result.failed_transfers.emplace_back();
        failure.transfer_id = r.Fixed<uint64_t>("TransferFailure.transfer_id");
        failure.error = r.String("TransferFailure.error");
    }
    result.kv_bytes_sent = r.Fixed<int64_t>("StepResult.kv_bytes_sent");
    result.kv_bytes_received = r.Fixed<int64_t>("StepResult.kv_bytes_received");
    result.kv_transfer_seconds = r.F64("StepResult.kv_transfer_seconds");
    return result;
}

RegisterMessage DecodeRegister(Reader& r) {
    RegisterMessage m;
    m.worker_rank = r.Fixed<int32_t>("Register.worker_rank");
    m.tp = r.Fixed<int32_t>("Register.tp");
    m.instance_id = r.String("Register.instance_id");
    m.protocol_version = r.Fixed<uint32_t>("Register.protocol_version");
    m.kv_endpoint = r.String("Register.kv_endpoint");
    m.token = r.String("Register.token");
    m.model = r.String("Register.model");
    return m;
}

RegisterAckMessage DecodeRegisterAck(Reader& r) {
    RegisterAckMessage m;
    m.accepted = r.Bool("RegisterAck.accepted");
    m.error = r.String("RegisterAck.error");
    m.model_path = r.String("RegisterAck.model_path");
    m.tp = r.Fixed<int32_t>("RegisterAck.tp");
    // A pair of strings takes 64 bytes in memory but only 8 on the wire; the cap keeps decoded
    // memory near the frame length even for a frame of nothing but empty pairs.
    const uint32_t n = r.Count("RegisterAck.settings", 8, kMaxSettings);
    m.settings.reserve(n);
    for (uint32_t i = 0; i < n && r.status().ok(); ++i) {
        std::string key = r.String("RegisterAck.settings.key");
        std::string value = r.String("RegisterAck.settings.value");
        m.settings.emplace_back(std::move(key), std::move(value));
    }
    m.rank = r.Fixed<int32_t>("RegisterAck.rank");
    return m;
}

Result<Message> DecodeMessage(MessageType type, Reader& r) {
    Message message;
    switch (type) {
        case MessageType::kStepPlan:
            message = DecodeStepPlan(r);
            break;
        case MessageType::kStepResult:
            message = DecodeStepResult(r);
            break;
        case MessageType::kRegister:
            message = DecodeRegister(r);
            break;
        case MessageType::kRegisterAck:
            message = DecodeRegisterAck(r);
            break;
        case MessageType::kHeartbeat:
            message = HeartbeatMessage{r.Fixed<uint64_t>("Heartbeat.sequence")};
            break;
        case MessageType::kShutdown:
            message = ShutdownMessage{r.String("Shutdown.reason")};
            break;
        case MessageType::kReady: {
            ReadyMessage ready;
            ready.ok = r.Bool("Ready.ok");
            ready.error = r.String("Ready.error");
            ready.num_kv_blocks = r.Fixed<int64_t>("Ready.num_kv_blocks");
            message = std::move(ready);
            break;
        }
        case MessageType::kStoreRequest: {
            StoreRequestMessage request;
            request.set = r.Bool("StoreRequest.set");
            request.key = r.String("StoreRequest.key");
            request.value = r.String("StoreRequest.value");
            message = std::move(request);
            break;
        }
        case MessageType::kStoreReply: {
            StoreReplyMessage reply;
            reply.found = r.Bool("StoreReply.found");
            reply.value = r.String("StoreReply.value");
            reply.error = r.String("StoreReply.error");
            message = std::move(reply);
            break;
        }
    }
    r.Finish();
    if (!r.status().ok()) {
        return r.status().WithContext(std::string(MessageTypeName(type)) + " frame");
    }
    return message;
}

uint32_t ReadU32(std::string_view bytes, size_t offset) {
    uint32_t value = 0;
    for (size_t i = 0; i < 4; ++i) {
        value |= static_cast<uint32_t>(static_cast<uint8_t>(bytes[offset + i])) << (8 * i);
    }
    return value;
}

uint16_t ReadU16(std::string_view bytes, size_t offset) {
    return static_cast<uint16_t>(static_cast<uint8_t>(bytes[offset]) |
                                 (static_cast<uint8_t>(bytes[offset + 1]) << 8));
}

std::string Hex(std::string_view bytes) {
    static constexpr char kDigits[] = "0123456789abcdef";
    std::string out;
    for (char c : bytes) {
        out += kDigits[static_cast<uint8_t>(c) >> 4];
        out += kDigits[static_cast<uint8_t>(c) & 0xF];
    }
    return out;
}

}  // namespace

std::string_view MessageTypeName(MessageType type) {
    switch (type) {
        case MessageType::kStepPlan:
            return "StepPlan";
        case MessageType::kStepResult:
            return "StepResult";
        case MessageType::kRegister:
            return "Register";
        case MessageType::kRegisterAck:
            return "RegisterAck";
        case MessageType::kHeartbeat:
            return "Heartbeat";
        case MessageType::kShutdown:
            return "Shutdown";
        case MessageType::kReady:
            return "Ready";
        case MessageType::kStoreRequest:
            return "StoreRequest";
        case MessageType::kStoreReply:
            return "StoreReply";
    }
    return "Unknown";
}

MessageType TypeOf(const Message& message) {
    struct Visitor {
        MessageType operator()(const StepPlan&) const { return MessageType::kStepPlan; }
        MessageType operator()(const StepResult&) const { return MessageType::kStepResult; }
        MessageType operator()(const RegisterMessage&) const { return MessageType::kRegister; }
        MessageType operator()(const RegisterAckMessage&) const {
            return MessageType::kRegisterAck;
        }
        MessageType operator()(const HeartbeatMessage&) const { return MessageType::kHeartbeat; }
        MessageType operator()(const ShutdownMessage&) const { return MessageType::kShutdown; }
        MessageType operator()(const ReadyMessage&) const { return MessageType::kReady; }
        MessageType operator()(const StoreRequestMessage&) const {
            return MessageType::kStoreRequest;
        }
        MessageType operator()(const StoreReplyMessage&) const { return MessageType::kStoreReply; }
    };
    return std::visit(Visitor{}, message);
}

uint32_t Crc32(std::string_view bytes) {
    // zlib's table-driven CRC runs at GB/s; the bit-serial alternatives are ~10x slower, which
    // capped KV handoff over TCP at ~0.15 GB/s (scripts/bench-kv-transfer).
    uLong crc = crc32(0L, Z_NULL, 0);
    const auto* data = reinterpret_cast<const Bytef*>(bytes.data());
    size_t left = bytes.size();
    while (left > 0) {
        const auto n = static_cast<uInt>(std::min<size_t>(left, 1u << 30));
        crc = crc32(crc, data, n);
        data += n;
        left -= n;
    }
    return static_cast<uint32_t>(crc);
}

std::string EncodeFrame(const Message& message) {
    std::string frame(kFrameHeaderBytes, '\0');
    Writer payload_writer(&frame);
    std::visit([&](const auto& m) { Encode(payload_writer, m); }, message);
    const std::string_view payload = std::string_view(frame).substr(kFrameHeaderBytes);
    KV_CHECK_LE(payload.size(), size_t{UINT32_MAX});

    std::string header;
    Writer w(&header);
    header.append(kFrameMagic);
    w.Fixed(kWireVersion);
    w.Fixed(static_cast<uint16_t>(TypeOf(message)));
    w.Fixed(static_cast<uint32_t>(payload.size()));
    w.Fixed(Crc32(payload));
    KV_CHECK_EQ(header.size(), kFrameHeaderBytes);
    frame.replace(0, kFrameHeaderBytes, header);
    return frame;
}

Result<FrameHeader> DecodeFrameHeader(std::string_view header, uint32_t max_payload_bytes) {
    if (header.size() < kFrameHeaderBytes) {
        return DataLoss("frame header truncated: " + std::to_string(header.size()) + " of " +
                        std::to_string(kFrameHeaderBytes) + " bytes");
    }
    if (header.substr(0, 4) != kFrameMagic) {
        return DataLoss("not a kvshard frame: magic bytes " + Hex(header.substr(0, 4)) +
                        ", expected " + Hex(kFrameMagic) + " (\"KVSF\")");
    }
    FrameHeader result;
    result.version = ReadU16(header, 4);
    if (result.version != kWireVersion) {
        return Unimplemented("frame version " + std::to_string(result.version) +
                             "; this build speaks version " + std::to_string(kWireVersion));
    }
    const uint16_t type = ReadU16(header, 6);
    if (type < static_cast<uint16_t>(MessageType::kStepPlan) ||
        type > static_cast<uint16_t>(MessageType::kStoreReply)) {
        return DataLoss("unknown message type " + std::to_string(type));
    }
    result.type = static_cast<MessageType>(type);
    result.payload_bytes = ReadU32(header, 8);
    if (result.payload_bytes > max_payload_bytes) {
        return Status(StatusCode::kResourceExhausted,
                      std::string(MessageTypeName(result.type)) + " frame of " +
                          std::to_string(result.payload_bytes) + " payload bytes exceeds the " +
                          "limit of " + std::to_string(max_payload_bytes));
    }
    result.payload_crc32 = ReadU32(header, 12);
    return result;
}

Result<Message> DecodePayload(const FrameHeader& header, std::string_view payload) {
    if (payload.size() != header.payload_bytes) {
        return DataLoss(std::string(MessageTypeName(header.type)) + " frame: payload has " +
                        std::to_string(payload.size()) + " bytes, header says " +
                        std::to_string(header.payload_bytes));
    }
    const uint32_t crc = Crc32(payload);
    if (crc != header.payload_crc32) {
        return DataLoss(std::string(MessageTypeName(header.type)) + " frame: payload CRC-32 " +
                        std::to_string(crc) + " does not match the header's " +
                        std::to_string(header.payload_crc32));
    }
    Reader reader(payload);
    return DecodeMessage(header.type, reader);
}

Result<Message> DecodeFrame(std::string_view frame, uint32_t max_payload_bytes) {
    KV_ASSIGN_OR_RETURN(const FrameHeader header, DecodeFrameHeader(frame, max_payload_bytes));
    return DecodePayload(header, frame.substr(kFrameHeaderBytes));
}

}  // namespace kvshard
