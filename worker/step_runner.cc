#include "worker/step_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>

#include "worker/kv_handoff.h"
#include "worker/prompt_logprobs.h"

namespace kvshard {

StepRunner::StepRunner(ModelRunner& runner, KvTransport* transport, KvPeerExchange* peer,
                       KvPairHandoff* pairs)
    : runner_(runner), transport_(transport), peer_(peer), pairs_(pairs) {
    if (peer_ != nullptr) {
        KV_CHECK(transport_ != nullptr) << "the peer-copy path names this rank by its transport";
        peer_registration_ =
            KvPeerExchange::RegisterSource(runner_.backend(), *runner_.pool(), runner_.layout());
    }
}

// The prompt token row `row` of `seq`'s chunk predicts: the chunk's next token, or after its last
// row the plan's next_prompt_token (-1: none).
static int32_t PromptTarget(const ScheduledSequence& seq, int64_t row) {
    const auto next = static_cast<size_t>(row + 1);
    return next < seq.token_ids.size() ? seq.token_ids[next] : seq.next_prompt_token;
}

static bool ScoresPrompt(const ScheduledSequence& seq) {
    return seq.num_prompt_logprobs >= 0 && (seq.token_ids.size() > 1 || seq.next_prompt_token >= 0);
}

Status ValidatePromptLogprobs(const ScheduledSequence& seq, int64_t vocab) {
    if (seq.num_prompt_logprobs < -1 || seq.num_prompt_logprobs > kMaxLogprobs) {
        return InvalidArgument("sequence " + std::to_string(seq.seq_id) + ": num_prompt_logprobs " +
                               std::to_string(seq.num_prompt_logprobs) + " not in -1.." +
                               std::to_string(kMaxLogprobs));
    }
    if (seq.next_prompt_token < -1 || seq.next_prompt_token >= vocab) {
        return InvalidArgument("sequence " + std::to_string(seq.seq_id) + ": next_prompt_token " +
                               std::to_string(seq.next_prompt_token) +
                               " outside the vocabulary of " + std::to_string(vocab));
    }
    return Status::Ok();
}

void StepRunner::ScoreRows(const ScheduledSequence& seq, int64_t first_row, int64_t num_rows,
                           const float* logits, StepResult* result) {
    const int64_t vocab = runner_.spec().vocab_size;
    if (result->prompt_logprobs.empty() || result->prompt_logprobs.back().seq_id != seq.seq_id) {
        PromptLogprobs& chunk = result->prompt_logprobs.emplace_back();
        chunk.seq_id = seq.seq_id;
        chunk.first_pos = seq.start_pos + 1;
    }
    PromptLogprobs& out = result->prompt_logprobs.back();
    for (int64_t i = 0; i < num_rows; ++i) {
        const int32_t target = PromptTarget(seq, first_row + i);
        if (target < 0) continue;  // the chunk's last row, where the prompt ends
        out.tokens.push_back(ScorePromptToken(logits + i * vocab, vocab, target,
                                              seq.num_prompt_logprobs, &score_ids_));
    }
}

SampledToken StepRunner::SampleRow(const ScheduledSequence& seq, const float* logits) {
    const int64_t vocab = runner_.spec().vocab_size;
    auto it = samplers_.find(seq.seq_id);
    if (it == samplers_.end()) it = samplers_.emplace(seq.seq_id, Sampler(seq.sampling)).first;
    SampledToken out;
    out.seq_id = seq.seq_id;
    if (HasLogitControls(seq.sampling) || !seq.allowed_tokens.empty()) {
        // The controls and the structured-output mask change what is sampled; logprobs stay
        // those of the model's own logits. Every rank gets the same plan, so every rank masks
        // and samples alike.
        adjusted_.assign(logits, logits + vocab);
        ApplyLogitControls(seq.sampling, seq.history, seq.history_prompt_tokens, adjusted_.data(),
                           vocab, &control_scratch_);
        if (!seq.allowed_tokens.empty())
            ApplyTokenMask(seq.allowed_tokens, adjusted_.data(), vocab);
        out.token_id = it->second.Sample(adjusted_.data(), vocab);
    } else {
        out.token_id = it->second.Sample(logits, vocab);
    }
    out.rng_state = it->second.rng_state();
    if (seq.num_top_logprobs >= 0) {
        // Only the sampled token's and the top k values are read: each is computed as the full
        // row's log-softmax would hold it (logit - LogSumExp), without writing the row.
        const float log_sum = LogSumExp(logits, vocab);
        out.logprob = logits[out.token_id] - log_sum;
        const int64_t k = std::min<int64_t>(seq.num_top_logprobs, vocab);
        out.top_logprobs = TopLogprobs(logits, vocab, log_sum, k);
    }
    return out;
}

// The entries of table `g` (0: block_table, else group_block_tables[g - 1]) of `op` that a
// handoff of op.num_tokens carries (kv_handoff.h FirstHandoffEntry); an error names what is
// missing.
template <typename Op>
static Result<std::span<const int32_t>> HandoffEntries(const Op& op,
                                                       const kv::KvCacheGroups& groups, int64_t g,
                                                       int64_t block_size,
                                                       const std::string& what) {
    if (static_cast<int64_t>(op.group_block_tables.size()) != groups.num_groups() - 1) {
        return InvalidArgument(what + std::to_string(op.group_block_tables.size() + 1) +
                               " block tables for the model's " +
                               std::to_string(groups.num_groups()) + " KV cache groups");
    }
    const std::vector<int32_t>& table =
        g == 0 ? op.block_table : op.group_block_tables[static_cast<size_t>(g - 1)];
    const int64_t end = (op.num_tokens + block_size - 1) / block_size;
    if (op.num_tokens <= 0 || end > static_cast<int64_t>(table.size())) {
        return InvalidArgument(what + "group " + std::to_string(g) + "'s " +
                               std::to_string(table.size()) + " blocks cannot hold " +
                               std::to_string(op.num_tokens) + " tokens");
    }
    const int64_t first =
        FirstHandoffEntry(op.num_tokens, block_size, groups.windows[static_cast<size_t>(g)]);
    return std::span<const int32_t>(table).subspan(static_cast<size_t>(first),
                                                   static_cast<size_t>(end - first));
}

void StepRunner::MarkPairsDown(const std::string& instance, TransferFailure* failure) {
    if (pairs_ == nullptr) return;
    if (std::optional<uint64_t> first = pairs_->DownPairs(instance); first.has_value()) {
        failure->pairs_down = true;
        failure->pairs_first_transfer = *first;
    }
}

Result<std::vector<TransferFailure>> StepRunner::ReceiveTransfers(const StepPlan& plan,
                                                                  StepResult* result) {
    std::vector<TransferFailure> local(plan.kv_recvs.size());
    const ShardLayout& layout = runner_.layout();
    const kv::KvCacheGroups& groups = runner_.kv_groups();
    const int64_t bs = runner_.pool()->config().block_size;
    for (size_t i = 0; i < plan.kv_recvs.size(); ++i) {
        const KvRecvOp& op = plan.kv_recvs[i];
        local[i].transfer_id = op.transfer_id;
        local[i].code = StatusCode::kOk;
        const std::string rank = "rank " + std::to_string(layout.shard.rank) + ": ";
        // The first problem of this transfer, with its code (kOk: none so far).
        auto fail = [&](const Status& st) {
            local[i].code = st.code();
            local[i].message = rank + st.message();
        };
        if (transport_ == nullptr) {
            fail(Unavailable("this worker has no KV transport"));
            continue;
        }
        // The blocks each group receives, checked before anything arrives.
        std::vector<std::span<const int32_t>> blocks;
        for (int64_t g = 0; g < groups.num_groups() && local[i].code == StatusCode::kOk; ++g) {
            Result<std::span<const int32_t>> entries =
                HandoffEntries(op, groups, g, bs,
                               "KV receive of transfer " + std::to_string(op.transfer_id) + ": ");
            if (entries.ok()) {
                blocks.push_back(*entries);
            } else {
                fail(entries.status());
            }
        }
        if (local[i].code != StatusCode::kOk) {
            transport_->Discard(op.transfer_id);
            // Announced to the sender already: the pairs' order is lost.
            if (pairs_ != nullptr) {
                pairs_->Abandon(op, Status(local[i].code, local[i].message));
                MarkPairsDown(op.src_instance, &local[i]);
            }
            continue;
        }
        if (pairs_ != nullptr) {
            Result<int64_t> bytes = pairs_->Receive(op, blocks);
            if (bytes.ok()) {
                result->kv_bytes_received += *bytes;
            } else {
                fail(bytes.status());
                MarkPairsDown(op.src_instance, &local[i]);
            }
            continue;
        }
        // Every (layer, KV head) arrives once, but for the groups whose window reads nothing
        // of the handed-off positions.
        int64_t cells = 0;
        for (int64_t l = 0; l < runner_.spec().num_layers; ++l) {
            const int64_t g = groups.group_of_layer[static_cast<size_t>(l)];
            if (!blocks[static_cast<size_t>(g)].empty()) cells += layout.num_kv_heads();
        }
        const auto deadline =
            std::chrono::steady_clock::now() + std::chrono::milliseconds(op.timeout_ms);
        if (peer_ != nullptr) {
            if (Status st = CopyFromPeers(op, blocks, cells, deadline, result); !st.ok()) {
                fail(st);
                peer_->Discard(transport_->endpoint(), op.transfer_id);
                transport_->Discard(op.transfer_id);
            }
            continue;
        }
        Result<std::vector<KvPiece>> pieces = transport_->Receive(op.transfer_id, cells, deadline);
        if (!pieces.ok()) {
            fail(pieces.status());
            transport_->Discard(op.transfer_id);
            continue;
        }
        for (const KvPiece& piece : *pieces) {
            // A piece's layers are of one group (SendLayers cuts them so).
            const KvPieceHeader& h = piece.header;
            Status st;
            if (h.layer_begin < 0 || h.layer_end > runner_.spec().num_layers ||
                h.layer_begin >= h.layer_end) {
                st = InvalidArgument("KV piece of transfer " + std::to_string(h.transfer_id) +
                                     ": layers [" + std::to_string(h.layer_begin) + ", " +
                                     std::to_string(h.layer_end) + ") outside the model's " +
                                     std::to_string(runner_.spec().num_layers));
            } else {
                const int64_t g = groups.group_of_layer[static_cast<size_t>(h.layer_begin)];
                for (int64_t l = h.layer_begin; l < h.layer_end && st.ok(); ++l) {
                    if (groups.group_of_layer[static_cast<size_t>(l)] != g) {
                        st = InvalidArgument(
                            "KV piece of transfer " + std::to_string(h.transfer_id) + ": layers [" +
                            std::to_string(h.layer_begin) + ", " + std::to_string(h.layer_end) +
                            ") span two KV cache groups");
                    }
                }
                if (st.ok()) {
                    st = UnpackKvPiece(runner_.backend(), piece, *runner_.pool(), layout,
                                       blocks[static_cast<size_t>(g)]);
                }
            }
            if (!st.ok()) {
                fail(st);
                break;
            }
            result->kv_bytes_received += static_cast<int64_t>(piece.data.size());
        }
        transport_->Recycle(std::move(*pieces));  // later arrivals land in these buffers
    }
    // Every rank must leave out the same sequences (the collectives of the forward pass pair up):
    // a transfer failed when it failed on any rank.
    std::vector<float> failed(local.size());
    for (size_t i = 0; i < local.size(); ++i)
        failed[i] = local[i].code == StatusCode::kOk ? 0.0f : 1.0f;
    if (Collective* c = runner_.collective(); c != nullptr && !failed.empty()) {
        Backend& backend = runner_.backend();
        const size_t bytes = failed.size() * sizeof(float);
        if (votes_.bytes() < bytes) {
            KV_ASSIGN_OR_RETURN(votes_, backend.Allocate(std::max<size_t>(bytes, 256)));
        }
        KV_RETURN_IF_ERROR(backend.CopyToDevice(votes_.data(), failed.data(), bytes));
        KV_RETURN_IF_ERROR(c->AllReduceSum(votes_.As<float>(),
                                           static_cast<int64_t>(failed.size())));
        KV_RETURN_IF_ERROR(backend.CopyToHost(failed.data(), votes_.data(), bytes));
        KV_RETURN_IF_ERROR(backend.Synchronize());
    }
    std::vector<TransferFailure> out;
    for (size_t i = 0; i < local.size(); ++i) {
        if (failed[i] == 0.0f) continue;
        if (local[i].code == StatusCode::kOk) {
            local[i].code = StatusCode::kAborted;
            local[i].message = "failed on another rank of this instance";
        }
        out.push_back(std::move(local[i]));
    }
    return out;
}

Status StepRunner::CopyFromPeers(const KvRecvOp& op,
                                 const std::vector<std::span<const int32_t>>& blocks, int64_t cells,
                                 std::chrono::steady_clock::time_point deadline,
                                 StepResult* result) {
    KV_ASSIGN_OR_RETURN(std::vector<KvPeerSource> sources,
                        peer_->Take(transport_->endpoint(), op.transfer_id, cells, deadline));
    const std::vector<int64_t>& group_of = runner_.kv_groups().group_of_layer;
    const int64_t num_layers = runner_.spec().num_layers;
    Backend& backend = runner_.backend();
    for (const KvPeerSource& source : sources) {
        KvPeerRank& from = *source.rank;
        // Held until this backend ran the copies: the sender's pool stays while they read it.
        std::lock_guard<std::mutex> lock(from.mu);
        if (!from.alive) {
            return Unavailable("KV peer handoff of transfer " + std::to_string(op.transfer_id) +
                               ": the sending rank went away");
        }
        if (source.blocks.size() != blocks.size()) {
            return InvalidArgument("KV peer handoff of transfer " + std::to_string(op.transfer_id) +
                                   ": " + std::to_string(source.blocks.size()) +
                                   " block tables from the sender for " +
                                   std::to_string(blocks.size()) + " KV cache groups");
        }
        Status copied;
        int64_t bytes = 0;
        for (int64_t begin = 0; begin < num_layers && copied.ok();) {
            const auto g = static_cast<size_t>(group_of[static_cast<size_t>(begin)]);
            int64_t end = begin + 1;
            while (end < num_layers && group_of[static_cast<size_t>(end)] == int64_t(g)) ++end;
            if (!blocks[g].empty()) {
                Result<int64_t> n = QueueKvPeerCopies(
                    *from.backend, *from.pool, from.layout, source.blocks[g], backend,
                    *runner_.pool(), runner_.layout(), blocks[g], begin, end, source.heads);
                if (n.ok()) {
                    bytes += *n;
                } else {
                    copied = n.status();
                }
            }
            begin = end;
        }
        // Also after a failed copy: what was queued reads the sender's pool until it ran.
        const Status synced = backend.Synchronize();
        KV_RETURN_IF_ERROR(copied);
        KV_RETURN_IF_ERROR(synced);
        result->kv_bytes_received += bytes;
    }
    return Status::Ok();
}

Status StepRunner::PostPeerSources(const PreparedSend& send, StepResult* result) {
    const KvSendOp& op = *send.op;
    const std::vector<int64_t>& group_of = runner_.kv_groups().group_of_layer;
    for (size_t dst = 0; dst < send.heads.size(); ++dst) {
        if (send.heads[dst].size() == 0) continue;
        KvPeerSource source{.transfer_id = op.transfer_id,
                            .rank = peer_registration_->rank(),
                            .blocks = {},
                            .heads = send.heads[dst],
                            .cells = 0};
        for (std::span<const int32_t> b : send.blocks)
            source.blocks.emplace_back(b.begin(), b.end());
        for (int64_t g : group_of) {
            if (!send.blocks[static_cast<size_t>(g)].empty())
                source.cells += send.heads[dst].size();
        }
        // The bytes the receiver copies out of this pool: what a piece of these heads would
        // carry (KvCopyRuns per run of one group's layers), as the host-staged path counts them.
        int64_t bytes = 0;
        const auto num_layers = static_cast<int64_t>(group_of.size());
        for (int64_t begin = 0; begin < num_layers;) {
            const int64_t g = group_of[static_cast<size_t>(begin)];
            int64_t end = begin + 1;
            while (end < num_layers && group_of[static_cast<size_t>(end)] == g) ++end;
            const std::span<const int32_t> blocks = send.blocks[static_cast<size_t>(g)];
            if (!blocks.empty()) {
                for (const KvCopyRun& run : KvCopyRuns(*runner_.pool(), runner_.layout(), blocks,
                                                       begin, end, send.heads[dst]))
                    bytes += run.bytes;
            }
            begin = end;
        }
        KV_RETURN_IF_ERROR(peer_->Post(op.dst_endpoints[dst], std::move(source)));
        result->kv_bytes_sent += bytes;
    }
    return Status::Ok();
}

Result<StepRunner::PreparedSend> StepRunner::PrepareSend(const KvSendOp& op) const {
    if (transport_ == nullptr)
        return InvalidArgument("the plan sends KV but this worker has no KV transport");
    const std::string what = "KV send of transfer " + std::to_string(op.transfer_id) + ": ";
    if (static_cast<int32_t>(op.dst_endpoints.size()) != op.dst_tp) {
        return InvalidArgument(what + std::to_string(op.dst_endpoints.size()) +
                               " endpoints for dst_tp " + std::to_string(op.dst_tp));
    }
    const int64_t bs = runner_.pool()->config().block_size;
    const kv::KvCacheGroups& groups = runner_.kv_groups();
    PreparedSend out;
    out.op = &op;
    for (int64_t g = 0; g < groups.num_groups(); ++g) {
        KV_ASSIGN_OR_RETURN(std::span<const int32_t> blocks,
                            HandoffEntries(op, groups, g, bs, what));
        for (int32_t b : blocks) {
            if (!runner_.pool()->ValidBlock(b))
                return InvalidArgument(what + "block " + std::to_string(b) + " outside the pool");
        }
        out.blocks.push_back(blocks);
    }
    const ShardLayout& layout = runner_.layout();
    for (int dst = 0; dst < op.dst_tp; ++dst) {
        KV_RETURN_IF_ERROR(
            MakeShardLayout(runner_.spec(), {.rank = dst, .tp = op.dst_tp}).status());
        out.heads.push_back(
            KvHeadsToSend(runner_.spec(), layout.shard.rank, layout.shard.tp, dst, op.dst_tp));
    }
    return out;
}

Status StepRunner::SendLayers(const PreparedSend& send, int64_t layer_begin, int64_t layer_end,
                              StepResult* result) {
    const KvSendOp& op = *send.op;
    const std::vector<int64_t>& group_of = runner_.kv_groups().group_of_layer;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(op.timeout_ms);
    for (int64_t begin = layer_begin; begin < layer_end;) {
        const int64_t g = group_of[static_cast<size_t>(begin)];
        int64_t end = begin + 1;
        while (end < layer_end && group_of[static_cast<size_t>(end)] == g) ++end;
        for (size_t dst = 0; dst < send.heads.size(); ++dst) {
            if (send.heads[dst].size() == 0 || send.blocks[static_cast<size_t>(g)].empty())
                continue;
            KV_RETURN_IF_ERROR(PackKvPiece(runner_.backend(), *runner_.pool(), runner_.layout(),
                                           op.transfer_id, send.blocks[static_cast<size_t>(g)],
                                           begin, end, send.heads[dst], &send_piece_));
            // Pipelined: the next piece (layer-wise: the next layer's compute) proceeds while
            // the receiver takes this one; FlushSend collects the verdicts.
            KV_RETURN_IF_ERROR(
                transport_->SendPipelined(op.dst_endpoints[dst], send_piece_, deadline));
            result->kv_bytes_sent += static_cast<int64_t>(send_piece_.data.size());
        }
        begin = end;
    }
    return Status::Ok();
}

Status StepRunner::FlushSend(const PreparedSend& send) {
    const KvSendOp& op = *send.op;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(op.timeout_ms);
    Status first;
    for (size_t dst = 0; dst < send.heads.size(); ++dst) {
        if (send.heads[dst].size() == 0) continue;
        // Every destination is flushed, failed or not, so nothing of the transfer stays in flight.
        Status st = transport_->Flush(op.dst_endpoints[dst], op.transfer_id, deadline);
        if (first.ok()) first = std::move(st);
    }
    return first;
}

Result<StepResult> StepRunner::Execute(const StepPlan& plan) {
    const auto t0 = std::chrono::steady_clock::now();
    KvPairReceiveGuard receive_guard(pairs_, plan.kv_recvs);
    if (pairs_ != nullptr) {
        // First, whatever else fails: a decode rank waits for these sends. Ready before
        // discards: a transfer discarded in the plan that readies it was sent.
        for (uint64_t id : plan.kv_ready) pairs_->Ready(id);
        for (uint64_t id : plan.kv_discards) pairs_->Discard(id);
    }
    StepResult result;
    result.step_id = plan.step_id;
    for (int64_t id : plan.released_seq_ids) samplers_.erase(id);
    for (const ScheduledSequence& s : plan.sequences) {
        if (!s.sample) continue;
        KV_RETURN_IF_ERROR(ValidateSamplingParams(s.sampling));
        KV_RETURN_IF_ERROR(ValidateLogitControls(s.sampling, s.history, s.history_prompt_tokens,
                                                 runner_.spec().vocab_size));
        KV_RETURN_IF_ERROR(ValidateTokenMask(s.allowed_tokens, runner_.spec().vocab_size));
    }
    for (const ScheduledSequence& s : plan.sequences)
        KV_RETURN_IF_ERROR(ValidatePromptLogprobs(s, runner_.spec().vocab_size));
    if (transport_ != nullptr) {
        for (uint64_t id : plan.kv_discards) {
            transport_->Discard(id);
            if (peer_ != nullptr) peer_->Discard(transport_->endpoint(), id);
        }
    }
    std::vector<std::pair<int32_t, int32_t>> copies;
    for (const kv::CopyOp& c : plan.block_copies) copies.emplace_back(c.src_block, c.dst_block);
    KV_RETURN_IF_ERROR(runner_.CopyBlocks(copies));

    double transfer_seconds = 0.0;
    auto timed = [&](auto&& fn) {
        const auto start = std::chrono::steady_clock::now();
        fn();
        transfer_seconds +=
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    // Sequences whose KV did not arrive sit out this step.
    std::vector<int64_t> skipped;
    if (!plan.kv_recvs.empty()) {
        std::optional<Result<std::vector<TransferFailure>>> received;
        timed([&] { received.emplace(ReceiveTransfers(plan, &result)); });
        receive_guard.Received();
        Result<std::vector<TransferFailure>>& failures = *received;
        KV_RETURN_IF_ERROR(failures.status());
        for (const TransferFailure& f : *failures) {
            for (const KvRecvOp& op : plan.kv_recvs) {
                if (op.transfer_id == f.transfer_id) skipped.push_back(op.seq_id);
            }
        }
        result.failed_transfers = std::move(*failures);
    }
    auto send_failed = [&](const KvSendOp& op, const Status& st) {
        TransferFailure& f = result.failed_transfers.emplace_back(TransferFailure::Of(
            op.transfer_id,
            Status(st.code(),
                   "rank " + std::to_string(runner_.layout().shard.rank) + ": " + st.message())));
        MarkPairsDown(op.dst_instance, &f);
    };
    auto has_failed = [&](uint64_t id) {
        return std::any_of(result.failed_transfers.begin(), result.failed_transfers.end(),
                           [&](const TransferFailure& f) { return f.transfer_id == id; });
    };

    // Checked once, before the forward pass; a send that cannot be done fails its transfer only.
    std::vector<PreparedSend> sends;
    for (const KvSendOp& op : plan.kv_sends) {
        Result<PreparedSend> prepared = PrepareSend(op);
        if (prepared.ok()) {
            sends.push_back(std::move(*prepared));
        } else {
            send_failed(op, prepared.status());
        }
    }

    std::vector<const ScheduledSequence*> run;
    for (const ScheduledSequence& s : plan.sequences) {
        if (std::find(skipped.begin(), skipped.end(), s.seq_id) == skipped.end()) run.push_back(&s);
    }
    if (!run.empty()) {
        std::vector<SequenceChunk> chunks;
        chunks.reserve(run.size());
        for (const ScheduledSequence* s : run) {
            chunks.push_back({.seq_id = s->seq_id,
                              .tokens = s->token_ids,
                              .start_pos = s->start_pos,
                              .block_table = s->block_table,
                              .slot_mapping = s->slot_mapping,
                              .group_block_tables = s->group_block_tables,
                              .group_slot_mappings = s->group_slot_mappings,
                              .all_logits = ScoresPrompt(*s)});
        }
        // Every rank classifies the rows (the classifier's AllGather pairs up) and holds the
        // same logits, but only rank 0 scores them: the coordinator reads rank 0's StepResult
        // (TpGroup, RemoteExecutor), so the other ranks would spend vocab × rows of host work
        // on scores that are dropped.
        RowLogitsFn on_rows;
        if (runner_.layout().shard.rank == 0) {
            on_rows = [&](size_t chunk, int64_t first_row, int64_t num_rows, const float* logits) {
                ScoreRows(*run[chunk], first_row, num_rows, logits, &result);
            };
        }
        std::function<void(int64_t)> after_layer;
        // The peer-copy path posts after the pass (the receiver copies whenever its step runs).
        // So does the pair path (its senders hold a copy until the receiver asks).
        if (peer_ == nullptr && pairs_ == nullptr &&
            std::any_of(sends.begin(), sends.end(),
                        [](const PreparedSend& s) { return s.op->layerwise; })) {
            after_layer = [&](int64_t layer) {
                for (const PreparedSend& send : sends) {
                    if (!send.op->layerwise || has_failed(send.op->transfer_id)) continue;
                    timed([&] {
                        if (Status st = SendLayers(send, layer, layer + 1, &result); !st.ok())
                            send_failed(*send.op, st);
                    });
                }
            };
        }
        KV_RETURN_IF_ERROR(runner_.Forward(chunks, &logits_, after_layer, on_rows));
        const int64_t vocab = runner_.spec().vocab_size;
        for (size_t i = 0; i < run.size(); ++i) {
            if (run[i]->sample) result.tokens.push_back(SampleRow(*run[i], &logits_[i * vocab]));
        }
    }
    if (peer_ != nullptr && !sends.empty()) {
        // The receivers read the blocks once posted: the step's writes must be done.
        const Status synced = runner_.backend().Synchronize();
        for (const PreparedSend& send : sends) {
            if (has_failed(send.op->transfer_id)) continue;
            const Status st = synced.ok() ? PostPeerSources(send, &result) : synced;
            if (!st.ok()) send_failed(*send.op, st);
        }
        sends.clear();  // nothing to send or flush through the transport
    }
    if (pairs_ != nullptr && !sends.empty()) {
        // Offered after the pass: the offers pack the blocks now, on the rank's stream behind
        // the pass's writes, and wait for the packing.
        for (const PreparedSend& send : sends) {
            if (has_failed(send.op->transfer_id)) continue;
            timed([&] {
                Result<int64_t> bytes = pairs_->Offer(*send.op, send.blocks);
                if (bytes.ok()) {
                    result.kv_bytes_sent += *bytes;
                } else {
                    send_failed(*send.op, bytes.status());
                }
            });
        }
        sends.clear();  // nothing to send or flush through the transport
    }
    for (const PreparedSend& send : sends) {
        const KvSendOp& op = *send.op;
        // A layer-wise send whose sequence did not run (its own KV had not arrived) never streamed.
        const bool streamed = op.layerwise && !run.empty() &&
                              std::any_of(run.begin(), run.end(), [&](const ScheduledSequence* s) {
                                  return s->seq_id == op.seq_id;
                              });
        if (streamed || has_failed(op.transfer_id)) continue;
        timed([&] {
            if (Status st = SendLayers(send, 0, runner_.spec().num_layers, &result); !st.ok())
                send_failed(op, st);
        });
    }
    // The verdicts of every send's pieces (sent pipelined): a transfer the receiver refused fails
    // here, as if its Send had.
    for (const PreparedSend& send : sends) {
        timed([&] {
            Status st = FlushSend(send);
            if (!st.ok() && !has_failed(send.op->transfer_id)) send_failed(*send.op, st);
        });
    }
    result.kv_transfer_seconds = transfer_seconds;
    result.compute_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return result;
}

}  // namespace kvshard
