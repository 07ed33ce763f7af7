// StepPlan / StepResult: everything that crosses from the coordinator to the workers of an
// instance, and back, for one step. Plain structs of ids and numbers — no pointers — so the same
// plan is passed by reference to embedded workers and serialized (comm/plan_codec.h) for worker
// processes. The request vocabulary they carry (SamplingParams, FinishReason, TokenLogprob) is
// common/request.h's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/kv_types.h"
#include "common/request.h"
#include "common/status.h"

namespace kvshard {

// One sequence's share of a step: a chunk of tokens at consecutive positions whose KV is written
// at `slot_mapping` and which attend over every position held by `block_table`.
// KV cache groups (kv/kv_cache_groups.h: a model with sliding-window layers): block_table and
// slot_mapping are group 0's; group g > 0 has group_block_tables[g - 1] and
// group_slot_mappings[g - 1], alike. A windowed group's table holds kv::kNoBlock where its window
// released the block (no query of this chunk reads it); a model with one group sends none.
struct ScheduledSequence {
    int64_t seq_id = 0;
    std::vector<int32_t> token_ids;  // tokens to compute, at positions start_pos, start_pos+1, ...
    int64_t start_pos = 0;
    std::vector<int32_t> block_table;   // blocks holding positions 0 .. start_pos + n - 1, in order
    std::vector<int64_t> slot_mapping;  // slot of each token in token_ids (block * block_size + i)
    std::vector<std::vector<int32_t>> group_block_tables = {};   // groups 1 .. G - 1
    std::vector<std::vector<int64_t>> group_slot_mappings = {};  // groups 1 .. G - 1
    // Sample a token after the last of token_ids (false for a prefill chunk that is not the last).
    bool sample = true;
    SamplingParams sampling = {};
    int32_t num_top_logprobs = -1;  // -1: no logprobs; 0: the sampled token's; k: also the top k
    // When sample and NeedsTokenHistory(sampling): every token of the sequence so far (prompt,
    // then output), of which the first history_prompt_tokens are the prompt — what the penalties
    // and min_tokens read. Sent per step, so that workers keep no per-request state and a
    // preempted, prefix-cached or handed-off sequence samples exactly as it would otherwise.
    std::vector<int32_t> history = {};
    int64_t history_prompt_tokens = 0;
    // Structured outputs (grammar/): when sample and not empty, the tokens that may be sampled,
    // as a bitset over the vocabulary (bit id % 64 of word id / 64; (vocab + 63) / 64 words). The
    // others are set to -inf after the logit controls; logprobs stay the raw model's. Computed
    // by the coordinator from the sequence's grammar state after its last token, every step.
    std::vector<uint64_t> allowed_tokens = {};
    // Prompt logprobs: when >= 0 (at most kMaxLogprobs), the worker scores every prompt token
    // this chunk's rows predict, with the top num_prompt_logprobs alternatives — token_ids[1..]
    // from the rows before them, then next_prompt_token from the chunk's last row (chunked
    // prefill: the first token of the next chunk). next_prompt_token is -1 when the chunk ends
    // where the prompt does. Results in StepResult.prompt_logprobs.
    int32_t num_prompt_logprobs = -1;
    int32_t next_prompt_token = -1;
    friend bool operator==(const ScheduledSequence&, const ScheduledSequence&) = default;
};

// Disaggregated serving (DESIGN.md data flow, step 6): a prefill instance sends the KV of one
// request to a decode instance. Every rank of the sending instance sends, to each rank of the
// receiving instance, the KV heads that receiver holds and that the sender owns (a KV head held
// by two senders is sent by the lower rank), so the two sides may have different tp.
// With KV cache groups, block_table is group 0's and group_block_tables[g - 1] group g's; only
// the blocks a table holds travel (a kNoBlock entry, released by a window, is not sent), and the
// receiving tables have kNoBlock at the same entries.
struct KvSendOp {
    uint64_t transfer_id = 0;
    int64_t seq_id = 0;                // the sequence whose KV this is
    std::vector<int32_t> block_table;  // source blocks holding positions 0 .. num_tokens - 1
    std::vector<std::vector<int32_t>> group_block_tables;  // groups 1 .. G - 1
    int64_t num_tokens = 0;
    int32_t dst_tp = 1;                      // the receiving instance's tensor-parallel size
    std::vector<std::string> dst_endpoints;  // KvTransport endpoint of each receiving rank
    // true: each layer is sent as soon as this step has written it (REQUIRES seq_id among the
    // plan's sequences); false: every layer after the step's forward pass.
    bool layerwise = false;
    int64_t timeout_ms = 10'000;  // per piece handed to the transport
    // The receiving instance's name: the KV pair path (kv_transfer.path: nccl) offers the
    // transfer to this rank's pairs with that instance (worker/kv_handoff_pairs.h).
    std::string dst_instance = {};
    friend bool operator==(const KvSendOp&, const KvSendOp&) = default;
};

struct KvRecvOp {
    uint64_t transfer_id = 0;
    int64_t seq_id = 0;  // the sequence that continues from the received KV
    // Destination blocks for positions 0 .. num_tokens - 1, by group as in KvSendOp; a negative
    // entry receives nothing (the receiver holds the block already, or the window released it).
    std::vector<int32_t> block_table;
    std::vector<std::vector<int32_t>> group_block_tables;  // groups 1 .. G - 1
    int64_t num_tokens = 0;
    int64_t timeout_ms = 10'000;  // how long the step waits for the missing pieces
    // The sending instance's name: the KV pair path receives over this rank's pairs with it.
    std::string src_instance = {};
    friend bool operator==(const KvRecvOp&, const KvRecvOp&) = default;
};

struct StepPlan {
    uint64_t step_id = 0;
    std::vector<ScheduledSequence> sequences;
    std::vector<kv::CopyOp> block_copies;   // executed before the step's KV writes (any group's)
    std::vector<int64_t> released_seq_ids;  // finished or preempted: drop per-sequence state
    // Executed before the forward pass: the received KV is written into the blocks, and a
    // sequence whose transfer failed is left out of this step (StepResult.failed_transfers).
    std::vector<KvRecvOp> kv_recvs;
    // Executed during (layerwise) or after the forward pass; the blocks are only read.
    std::vector<KvSendOp> kv_sends;
    // Transfers that will never be received (the request ended on the prefill side): each rank
    // drops what its transport staged for them.
    std::vector<uint64_t> kv_discards;
    // The KV pair path (kv_transfer.path: nccl), on a sending instance: the receiving instance
    // planned its receive of each of these transfers (KvPairSender::Ready, the "ready for T" of
    // comm/kv_pair_protocol.h, announced through the coordinator). Executed before kv_discards.
    std::vector<uint64_t> kv_ready;
    friend bool operator==(const StepPlan&, const StepPlan&) = default;
};

// A transfer that failed, with the Status it failed with (code and message, as StepResult
// carries a step's error): DeadlineExceeded when its pieces did not arrive in time, Unavailable
// when the peer could not be reached, Aborted when it failed on another rank of the instance.
struct TransferFailure {
    uint64_t transfer_id = 0;
    StatusCode code = StatusCode::kUnavailable;  // never kOk
    std::string message;
    // The KV pair path (kv_transfer.path: nccl): the rank's pairs with the other instance are
    // down after this failure (failed for good: worker/kv_handoff_pairs.h), and they are the
    // pairs that carry transfers from `pairs_first_transfer` on. The coordinator re-plans them
    // (cli/kv_pair_replan.h KvPairPlan::OnPairsDown); a report about pairs it replaced since
    // (an older pairs_first_transfer) is stale. False on every other path, and for failures that
    // leave the pairs up (a transfer older than the pairs, pairs still being joined, a full
    // offer buffer).
    bool pairs_down = false;
    uint64_t pairs_first_transfer = 0;
    Status status() const { return Status(code, message); }
    // REQUIRES: !status.ok().
    static TransferFailure Of(uint64_t transfer_id, const Status& status) {
        return {transfer_id, status.code(), status.message()};
    }
    friend bool operator==(const TransferFailure&, const TransferFailure&) = default;
};

struct SampledToken {
    int64_t seq_id = 0;
    int32_t token_id = 0;
    float logprob = 0.0f;                    // of token_id (when requested)
    std::vector<TokenLogprob> top_logprobs;  // highest first (when requested)
    // The sequence's sampler state after drawing this token: a sampler created elsewhere with
    // SamplingParams.seed = rng_state continues the same random stream (disaggregated decode).
    uint64_t rng_state = 0;
    friend bool operator==(const SampledToken&, const SampledToken&) = default;
};

// The scored prompt tokens of one chunk (ScheduledSequence.num_prompt_logprobs): tokens[i] is the
// prompt token at position first_pos + i (first_pos = the chunk's start_pos + 1).
struct PromptLogprobs {
    int64_t seq_id = 0;
    int64_t first_pos = 0;
    std::vector<PromptTokenLogprob> tokens;
    friend bool operator==(const PromptLogprobs&, const PromptLogprobs&) = default;
};

struct StepResult {
    uint64_t step_id = 0;
    std::vector<SampledToken> tokens;  // one per sequence with sample = true, in plan order
    double compute_seconds = 0.0;
    // A failed step's Status as the worker had it, code and message (StepError, SetStepError);
    // kOk on success. A failed step samples nothing.
    StatusCode error_code = StatusCode::kOk;
    std::string error;
    // Transfers of this step that failed (on any rank); the other sequences ran normally.
    std::vector<TransferFailure> failed_transfers;
    int64_t kv_bytes_sent = 0;         // summed over the instance's ranks
    int64_t kv_bytes_received = 0;     // summed over the instance's ranks
    double kv_transfer_seconds = 0.0;  // rank 0's time in sends and receives
    // One per chunk that asked for prompt logprobs and scores at least one token, in plan order.
    std::vector<PromptLogprobs> prompt_logprobs = {};
    friend bool operator==(const StepResult&, const StepResult&) = default;
};

// The Status of a step: OK, or the worker's error with its code.
inline Status StepError(const StepResult& result) {
    if (result.error_code == StatusCode::kOk) return Status::Ok();
    return Status(result.error_code, result.error);
}
// Adds another rank's failed transfers to `into` (the instance's result): one failure per
// transfer, and where one rank only saw that another rank failed it (kAborted), the rank that
// saw the cause gives the Status.
inline void MergeTransferFailures(const std::vector<TransferFailure>& other,
                                  std::vector<TransferFailure>* into) {
    for (const TransferFailure& f : other) {
        auto known = std::find_if(into->begin(), into->end(), [&](const TransferFailure& g) {
            return g.transfer_id == f.transfer_id;
        });
        if (known == into->end()) {
            into->push_back(f);
            continue;
        }
        const bool down = known->pairs_down || f.pairs_down;
        const uint64_t first = std::max(known->pairs_first_transfer, f.pairs_first_transfer);
        if (known->code == StatusCode::kAborted && f.code != StatusCode::kAborted) *known = f;
        // Any rank's pairs down are the instance's (each rank holds some of its pairs).
        known->pairs_down = down;
        if (down) known->pairs_first_transfer = first;
    }
}

// Marks `result` failed with `status` (REQUIRES: !status.ok()).
inline void SetStepError(StepResult* result, const Status& status) {
    result->error_code = status.code();
    result->error = status.message();
}

}  // namespace kvshard
