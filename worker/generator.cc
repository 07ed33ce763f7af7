#include "worker/generator.h"

#include <algorithm>
#include <chrono>
#include <optional>

#include "kv/block_manager.h"

namespace kvshard {
namespace {

// Where the sequence's KV lives: the runner's paged pool, blocks from a private BlockManager.
class SequenceKvPlacement {
  public:
    SequenceKvPlacement(ModelRunner& runner, int64_t seq_id) : seq_id_(seq_id) {
        kv::BlockManagerConfig c;
        c.num_blocks = runner.pool()->config().num_blocks;
        c.block_size = runner.pool()->config().block_size;
        c.watermark = 0.0;
        c.enable_prefix_caching = false;
        c.group_windows = runner.kv_groups().BlockManagerWindows();
        blocks_.emplace(c);
    }
    ~SequenceKvPlacement() { Reset(); }

    void Reset() {
        if (blocks_ && blocks_->HasSequence(seq_id_)) blocks_->Free(seq_id_);
    }

    // Fills `chunk` for computing context[begin..]: allocates or appends slots.
    Status Place(const std::vector<int32_t>& context, int64_t begin, SequenceChunk* chunk) {
        chunk->seq_id = seq_id_;
        chunk->tokens = std::span<const int32_t>(context).subspan(static_cast<size_t>(begin));
        chunk->start_pos = begin;
        if (!blocks_->HasSequence(seq_id_)) {
            kv::SequenceRequest req{.seq_id = seq_id_, .prompt_token_ids = chunk->tokens};
            if (begin != 0 || !blocks_->CanAllocate(req))
                return OutOfRange("the KV pool cannot hold the prompt");
            blocks_->Allocate(req);
        } else {
            // Positions before `begin` are computed: a window's blocks no query reads go back.
            blocks_->MarkComputed(seq_id_, begin);
            if (!blocks_->CanAppend(seq_id_, static_cast<int64_t>(chunk->tokens.size()))) {
                return OutOfRange("the KV pool is full");
            }
            blocks_->AppendSlots(seq_id_, chunk->tokens);
        }
        slots_ = blocks_->SlotMapping(seq_id_, begin, static_cast<int64_t>(context.size()));
        table_.assign(blocks_->BlockTable(seq_id_).begin(), blocks_->BlockTable(seq_id_).end());
        chunk->block_table = table_;
        chunk->slot_mapping = slots_;
        group_tables_.resize(static_cast<size_t>(blocks_->num_groups() - 1));
        group_slots_.resize(group_tables_.size());
        for (int64_t g = 1; g < blocks_->num_groups(); ++g) {
            const std::span<const kv::BlockId> table = blocks_->BlockTable(seq_id_, g);
            group_tables_[static_cast<size_t>(g - 1)].assign(table.begin(), table.end());
            group_slots_[static_cast<size_t>(g - 1)] =
                blocks_->SlotMapping(seq_id_, begin, static_cast<int64_t>(context.size()), g);
        }
        chunk->group_block_tables = group_tables_;
        chunk->group_slot_mappings = group_slots_;
        return Status::Ok();
    }

  private:
    int64_t seq_id_;
    std::optional<kv::BlockManager> blocks_;
    std::vector<int32_t> table_;
    std::vector<int64_t> slots_;
    std::vector<std::vector<int32_t>> group_tables_;  // KV cache groups 1 ..
    std::vector<std::vector<int64_t>> group_slots_;
};

}  // namespace

Result<GenerateResult> Generate(ModelRunner& runner, const Tokenizer& tokenizer,
                                const std::vector<int32_t>& prompt_ids,
                                const GenerateOptions& options,
                                const std::function<void(std::string_view)>& on_text,
                                int64_t seq_id) {
    if (prompt_ids.empty()) return InvalidArgument("the prompt has no tokens");
    if (options.max_tokens < 0) return InvalidArgument("max_tokens must be >= 0");
    KV_RETURN_IF_ERROR(ValidateSamplingParams(options.sampling));
    const auto prompt_len = static_cast<int64_t>(prompt_ids.size());
    if (prompt_len > runner.max_context()) {
        return OutOfRange("the prompt has " + std::to_string(prompt_len) +
                          " tokens, more than the context of " +
                          std::to_string(runner.max_context()));
    }

    GenerateResult result;
    Sampler sampler(options.sampling);
    TextStream stream(tokenizer, options.stop_strings, prompt_ids.back());
    auto emit = [&](const std::string& s) {
        result.text += s;
        if (on_text && !s.empty()) on_text(s);
    };

    std::vector<int32_t> context = prompt_ids;  // every token so far
    std::vector<float> logits;
    const int64_t processed_before = runner.tokens_processed();
    SequenceKvPlacement kv(runner, seq_id);
    int64_t computed = 0;  // positions whose KV is cached
    using Clock = std::chrono::steady_clock;
    for (int64_t step = 0; step < options.max_tokens; ++step) {
        if (static_cast<int64_t>(context.size()) > runner.max_context())
            break;  // context full: "length"
        if (!options.use_kv_cache) {
            kv.Reset();
            computed = 0;
        }
        SequenceChunk chunk;
        KV_RETURN_IF_ERROR(kv.Place(context, computed, &chunk));
        const auto t0 = Clock::now();
        KV_RETURN_IF_ERROR(runner.Forward(std::span<const SequenceChunk>(&chunk, 1), &logits));
        computed = static_cast<int64_t>(context.size());
        const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
        (step == 0 ? result.prefill_seconds : result.decode_seconds) += secs;

        const int32_t token = sampler.Sample(logits.data(), runner.spec().vocab_size);
        result.token_ids.push_back(token);
        if (std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), token) !=
            options.stop_token_ids.end()) {
            result.finish_reason = FinishReason::kStop;
            break;
        }
        emit(stream.Push(token));
        if (stream.stopped()) {
            result.finish_reason = FinishReason::kStop;
            break;
        }
        context.push_back(token);
    }
    if (!stream.stopped()) emit(stream.Finish());
    result.tokens_processed = runner.tokens_processed() - processed_before;
    return result;
}

}  // namespace kvshard
