#include "comm/step_codec.h"

#include <cstdint>
#include <string>
#include <vector>

namespace kvshard {
namespace {

using wire::Reader;
using wire::Writer;

// ---- encoding ----

// The block tables of KV cache groups 1 .. G - 1.
void GroupTables(Writer& w, const std::vector<std::vector<int32_t>>& tables) {
    w.Count(tables.size());
    for (const std::vector<int32_t>& table : tables) w.Ints(table);
}

void EncodeTopLogprobs(Writer& w, const std::vector<TokenLogprob>& top) {
    w.Count(top.size());
    for (const TokenLogprob& t : top) {
        w.Fixed(t.token_id);
        w.F32(t.logprob);
    }
}

// ---- decoding ----

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
constexpr size_t kMinKvRecvBytes = 8 + 8 + 4 + 4 + 8 + 8 + 4;
constexpr size_t kMinKvSendBytes = 8 + 8 + 4 + 4 + 8 + 4 + 4 + 1 + 8 + 4;
constexpr size_t kMinTransferFailureBytes = 8 + 4 + 4 + 1 + 8;
// Receiving ranks of one send (a tensor-parallel size); strings cost 32 bytes in memory for 4 on
// the wire, so the list is capped like RegisterAck's settings (plan_codec.cc).
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

void DecodeTopLogprobs(Reader& r, const char* field, uint32_t max, std::vector<TokenLogprob>* top) {
    const uint32_t n = r.Count(field, 8, max);
    top->reserve(n);
    for (uint32_t k = 0; k < n && r.status().ok(); ++k) {
        TokenLogprob& t = top->emplace_back();
        t.token_id = r.Fixed<int32_t>("TokenLogprob.token_id");
        t.logprob = r.F32("TokenLogprob.logprob");
    }
}

}  // namespace

void EncodeStepPlan(Writer& w, const StepPlan& plan) {
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
        w.String(op.src_instance);
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
        w.String(op.dst_instance);
    }
    w.Ints(plan.kv_discards);
    w.Ints(plan.kv_ready);
}

// A token's alternatives, as both a sampled token and a scored prompt token carry them.

void EncodeStepResult(Writer& w, const StepResult& result) {
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
        w.Fixed(static_cast<uint32_t>(failure.code));
        w.String(failure.message);
        w.Bool(failure.pairs_down);
        w.Fixed(failure.pairs_first_transfer);
    }
    w.Fixed(result.kv_bytes_sent);
    w.Fixed(result.kv_bytes_received);
    w.F64(result.kv_transfer_seconds);
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
        op.src_instance = r.String("KvRecvOp.src_instance");
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
        op.dst_instance = r.String("KvSendOp.dst_instance");
    }
    plan.kv_discards = r.Ints<uint64_t>("StepPlan.kv_discards");
    plan.kv_ready = r.Ints<uint64_t>("StepPlan.kv_ready");
    return plan;
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
        failure.code = r.Code("TransferFailure.code");
        if (failure.code == StatusCode::kOk) r.Fail("TransferFailure.code: 0 (OK) is no failure");
        failure.message = r.String("TransferFailure.message");
        failure.pairs_down = r.Bool("TransferFailure.pairs_down");
        failure.pairs_first_transfer = r.Fixed<uint64_t>("TransferFailure.pairs_first_transfer");
    }
    result.kv_bytes_sent = r.Fixed<int64_t>("StepResult.kv_bytes_sent");
    result.kv_bytes_received = r.Fixed<int64_t>("StepResult.kv_bytes_received");
    result.kv_transfer_seconds = r.F64("StepResult.kv_transfer_seconds");
    return result;
}

}  // namespace kvshard
