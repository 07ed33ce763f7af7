// StepRunner: executes StepPlans on one ModelRunner — block copies, the forward pass over every
// scheduled chunk, and sampling (with per-sequence samplers whose RNG state persists across steps,
// so a seeded request is reproducible however it is batched).
// KV handoff (disaggregated serving): a plan's kv_recvs are completed before the forward pass
// (each rank takes its pieces from its KvTransport and writes them into its pool; the ranks agree
// through the instance's collective on which transfers failed, and those sequences sit out the
// step); its kv_sends run layer by layer inside the forward pass or after it, each rank sending
// the KV heads it owns to every receiving rank that holds them (worker/kv_handoff.h).
// With a KvPeerExchange (the peer-copy path, both instances in this process): a send posts where
// its blocks are (worker/kv_peer_exchange.h) after the forward pass, layer-wise or not, and a
// receive copies them pool to pool from the sending ranks' pools; no piece is packed.
// Thread-safety: none; one thread drives it.
#pragma once

#include <span>
#include <unordered_map>
#include <vector>

#include "comm/kv_transport.h"
#include "comm/step_executor.h"
#include "worker/kv_handoff_pairs.h"
#include "worker/kv_peer_exchange.h"
#include "worker/model_runner.h"
#include "worker/sampler.h"

namespace kvshard {

class StepRunner : public StepExecutor {
  public:
    // `transport` (not owned; may be nullptr when no plan carries KV transfer ops) must outlive
    // the runner. `peer` (not owned; nullptr: the host-staged path): the exchange of the
    // peer-copy path, shared by every instance of the process; the runner's pool is registered
    // with it while the StepRunner lives. REQUIRES with `peer`: a transport (its endpoint names
    // this rank to senders).
    // `pairs` (not owned; nullptr: not the pair path): the rank's KV pair handoff
    // (worker/kv_handoff_pairs.h, kv_transfer.path: nccl); sends are offered to it after the
    // forward pass, receives taken from it, kv_ready and kv_discards passed to it.
    explicit StepRunner(ModelRunner& runner, KvTransport* transport = nullptr,
                        KvPeerExchange* peer = nullptr, KvPairHandoff* pairs = nullptr);

    Result<StepResult> Execute(const StepPlan& plan) override;

    // Samples from one row of logits for `seq` (creating its sampler on first use) and fills the
    // requested logprobs.
    SampledToken SampleRow(const ScheduledSequence& seq, const float* logits);
    size_t num_samplers() const { return samplers_.size(); }
    // Scores the prompt tokens that rows [first_row, first_row + num_rows) of `seq`'s chunk
    // predict (ScheduledSequence.num_prompt_logprobs) into result->prompt_logprobs.
    void ScoreRows(const ScheduledSequence& seq, int64_t first_row, int64_t num_rows,
                   const float* logits, StepResult* result);

  private:
    // Receives every transfer of the plan; returns the failures all ranks agree on.
    Result<std::vector<TransferFailure>> ReceiveTransfers(const StepPlan& plan, StepResult* result);
    // The KV pair path: marks `failure` pairs_down when this rank's pairs with `instance` are
    // down after it (KvPairHandoff::DownPairs), for the coordinator to re-plan them.
    void MarkPairsDown(const std::string& instance, TransferFailure* failure);
    // A send op checked against this worker, with the KV heads it sends to each receiving rank
    // (computed once per step, not once per layer).
    struct PreparedSend {
        const KvSendOp* op = nullptr;
        // By KV cache group: the blocks the handoff carries (FirstHandoffEntry on).
        std::vector<std::span<const int32_t>> blocks;
        std::vector<IndexRange> heads;  // per receiving rank; empty range: nothing for it
    };
    Result<PreparedSend> PrepareSend(const KvSendOp& op) const;
    // Sends layers [layer_begin, layer_end) to every receiving rank, pipelined
    // (KvTransport::SendPipelined): a piece per run of consecutive layers of one KV cache group.
    Status SendLayers(const PreparedSend& send, int64_t layer_begin, int64_t layer_end,
                      StepResult* result);
    // Waits for the verdicts of every piece of the send, at every receiving rank: the first
    // failed one.
    Status FlushSend(const PreparedSend& send);
    // The peer-copy path's send: one KvPeerSource per receiving rank that gets heads; adds the
    // bytes the receivers will copy from this pool to result->kv_bytes_sent.
    // REQUIRES: the step's KV writes done.
    Status PostPeerSources(const PreparedSend& send, StepResult* result);
    // The peer-copy path's receive of `op` into `blocks` (by group): takes the sources covering
    // `cells` and copies from each sender's pool.
    Status CopyFromPeers(const KvRecvOp& op, const std::vector<std::span<const int32_t>>& blocks,
                         int64_t cells, std::chrono::steady_clock::time_point deadline,
                         StepResult* result);

    ModelRunner& runner_;
    KvTransport* transport_;
    KvPeerExchange* peer_;
    KvPairHandoff* pairs_;
    std::unique_ptr<KvPeerExchange::Registration> peer_registration_;  // with peer_
    std::unordered_map<int64_t, Sampler> samplers_;
    std::vector<float> logits_;
    // Backend memory for the ranks' vote on failed transfers: the runner's collective reduces
    // backend memory (a GPU rank's all-reduce is NCCL's or host-staged), never host vectors.
    BackendBuffer votes_;
    std::vector<float> adjusted_;           // the logits after the logit controls
    std::vector<int32_t> control_scratch_;  // ApplyLogitControls scratch
    std::vector<int32_t> score_ids_;        // ScorePromptToken scratch
    KvPiece send_piece_;                    // reused by every send
};

// A chunk's prompt-logprobs request checked: num_prompt_logprobs in -1..kMaxLogprobs,
// next_prompt_token -1 or in the vocabulary.
Status ValidatePromptLogprobs(const ScheduledSequence& seq, int64_t vocab);

}  // namespace kvshard
