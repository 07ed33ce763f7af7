// ModelRunner (worker/model_runner.h): a step's inputs, checked against the pool and packed into
// the backend, and the workspace they and the activations live in.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <string>
#include <unordered_set>

#include "worker/decode_buckets.h"
#include "worker/model_runner.h"

namespace kvshard {
namespace {

constexpr size_t kAlign = 64;
size_t Aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Offsets of the sections of a step's packed inputs, for a capacity of rows, sequences and
// block-table entries (over all groups) and `groups` KV cache groups: slots and table starts
// repeat per group. The block tables come last, so a step copies only up to their end.
struct InputLayout {
    size_t ids, positions, slots, query_starts, context_lens, table_starts, last_rows, tables;
    size_t total;
    InputLayout(int64_t rows, int64_t seqs, int64_t entries, int64_t groups) {
        size_t o = 0;
        auto take = [&o](size_t bytes) {
            const size_t at = o;
            o += Aligned(bytes);
            return at;
        };
        ids = take(rows * sizeof(int32_t));
        positions = take(rows * sizeof(int32_t));
        slots = take(groups * rows * sizeof(int64_t));
        query_starts = take((seqs + 1) * sizeof(int32_t));
        context_lens = take(seqs * sizeof(int32_t));
        table_starts = take(groups * (seqs + 1) * sizeof(int32_t));
        last_rows = take(seqs * sizeof(int32_t));
        tables = take(entries * sizeof(int32_t));
        total = o;
    }
};

}  // namespace

Status ModelRunner::EnsureWorkspace(int64_t rows, int64_t num_seqs, int64_t table_entries) {
    if (rows <= ws_rows_ && num_seqs <= ws_seqs_ && table_entries <= ws_table_entries_) {
        return Status::Ok();
    }
    if (ws_rows_ > 0) {
        spdlog::info(
            "model runner: step of {} tokens, {} sequences exceeds the workspace of {}, {}:"
            " growing it",
            rows, num_seqs, ws_rows_, ws_seqs_);
    }
    rows = std::max(rows, ws_rows_);
    num_seqs = std::max(num_seqs, ws_seqs_);
    table_entries = std::max(table_entries, ws_table_entries_);
    const int64_t hidden = spec_.hidden_size;
    const int tp = weights_.layout.shard.tp;
    const int64_t pad = tp == 1 ? spec_.vocab_size : weights_.layout.vocab_padded;
    const std::vector<int64_t> sizes = {
        rows * hidden, rows * hidden,       rows * qkv_dim_,
        rows * q_dim_, rows * 2 * ffn_dim_, rows * ffn_dim_,
        rows * hidden, num_seqs * pad,      tp > 1 ? tp * num_seqs * pad : 0};
    size_t total = 0;
    for (int64_t n : sizes) total += Aligned(static_cast<size_t>(n) * sizeof(float));
    KV_ASSIGN_OR_RETURN(workspace_, backend_->Allocate(total));
    float** slots[] = {&x_, &xn_, &qkv_, &att_, &gate_up_, &act_, &partial_, &logits_, &gathered_};
    auto* base = workspace_.As<uint8_t>();
    size_t o = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
        *slots[i] = reinterpret_cast<float*>(base + o);
        o += Aligned(static_cast<size_t>(sizes[i]) * sizeof(float));
    }
    const InputLayout layout(rows, num_seqs, table_entries, kv_groups_.num_groups());
    KV_ASSIGN_OR_RETURN(inputs_, backend_->Allocate(layout.total));
    host_inputs_.assign(layout.total, 0);
    auto* in = inputs_.As<uint8_t>();
    ids_ = reinterpret_cast<int32_t*>(in + layout.ids);
    positions_ = reinterpret_cast<int32_t*>(in + layout.positions);
    slots_ = reinterpret_cast<int64_t*>(in + layout.slots);
    query_starts_ = reinterpret_cast<int32_t*>(in + layout.query_starts);
    context_lens_ = reinterpret_cast<int32_t*>(in + layout.context_lens);
    table_starts_ = reinterpret_cast<int32_t*>(in + layout.table_starts);
    last_rows_ = reinterpret_cast<int32_t*>(in + layout.last_rows);
    tables_ = reinterpret_cast<int32_t*>(in + layout.tables);
    ws_rows_ = rows;
    ws_seqs_ = num_seqs;
    ws_table_entries_ = table_entries;
    ++buffers_generation_;  // graphs captured with the old buffers are stale
    return Status::Ok();
}

Status ModelRunner::ValidatePaged(const SequenceChunk& c) const {
    // Built only for an error: a step validates every chunk, and most steps are valid.
    const auto seq = [&c] { return "sequence " + std::to_string(c.seq_id); };
    const int64_t groups = kv_groups_.num_groups();
    if (static_cast<int64_t>(c.group_block_tables.size()) != groups - 1 ||
        static_cast<int64_t>(c.group_slot_mappings.size()) != groups - 1) {
        return InvalidArgument(
            seq() + ": " + std::to_string(c.group_block_tables.size() + 1) + " block tables and " +
            std::to_string(c.group_slot_mappings.size() + 1) + " slot mappings for the model's " +
            std::to_string(groups) + " KV cache groups");
    }
    KV_RETURN_IF_ERROR(ValidateGroup(c, 0, c.block_table, c.slot_mapping));
    for (int64_t g = 1; g < groups; ++g) {
        const auto i = static_cast<size_t>(g - 1);
        KV_RETURN_IF_ERROR(ValidateGroup(c, g, c.group_block_tables[i], c.group_slot_mappings[i]));
    }
    return Status::Ok();
}

Status ModelRunner::ValidateGroup(const SequenceChunk& c, int64_t group,
                                  std::span<const int32_t> table,
                                  std::span<const int64_t> slots) const {
    const auto seq = [&c, group] {
        return "sequence " + std::to_string(c.seq_id) +
               (group > 0 ? " KV cache group " + std::to_string(group) : "");
    };
    if (table.empty()) return InvalidArgument(seq() + ": no block table");
    const int64_t bs = pool_->config().block_size;
    const auto n = static_cast<int64_t>(c.tokens.size());
    if (static_cast<int64_t>(slots.size()) != n) {
        return InvalidArgument(seq() + ": " + std::to_string(slots.size()) + " slots for " +
                               std::to_string(n) + " tokens");
    }
    const int64_t end = c.start_pos + n;
    if (static_cast<int64_t>(table.size()) * bs < end) {
        return InvalidArgument(seq() + ": block table of " + std::to_string(table.size()) +
                               " blocks cannot hold " + std::to_string(end) + " positions");
    }
    // A window lets a released block (kNoBlock) stand only where no query of the chunk reads it:
    // wholly before the window of its first token. The kernels never read those entries.
    const int64_t window = kv_groups_.windows[static_cast<size_t>(group)];
    const int64_t first_read = window > 0 ? std::max<int64_t>(0, c.start_pos - window + 1) : 0;
    for (size_t i = 0; i < table.size(); ++i) {
        const int32_t b = table[i];
        if (b == kv::kNoBlock && static_cast<int64_t>(i + 1) * bs <= first_read) continue;
        if (!pool_->ValidBlock(b)) {
            return InvalidArgument(seq() + ": block " + std::to_string(b) + " at entry " +
                                   std::to_string(i) + " outside the pool");
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = c.start_pos + i;
        const int64_t expected = int64_t(table[pos / bs]) * bs + pos % bs;
        if (slots[i] != expected) {
            return InvalidArgument(seq() + ": slot " + std::to_string(slots[i]) + " for position " +
                                   std::to_string(pos) + " is not in its block");
        }
    }
    return Status::Ok();
}

Status ModelRunner::Validate(std::span<const SequenceChunk> batch) const {
    std::unordered_set<int64_t> seen;
    for (const SequenceChunk& c : batch) {
        const auto seq = [&c] { return "sequence " + std::to_string(c.seq_id); };
        if (c.tokens.empty()) return InvalidArgument(seq() + ": empty chunk");
        if (!seen.insert(c.seq_id).second) return InvalidArgument(seq() + ": twice in one batch");
        const int64_t end = c.start_pos + static_cast<int64_t>(c.tokens.size());
        if (c.start_pos < 0) return InvalidArgument(seq() + ": negative start_pos");
        if (end > max_context_) {
            return OutOfRange(seq() + ": " + std::to_string(end) +
                              " positions exceed the context of " + std::to_string(max_context_));
        }
        KV_RETURN_IF_ERROR(ValidatePaged(c));
        for (int32_t t : c.tokens) {
            if (t < 0 || t >= spec_.vocab_size) {
                return InvalidArgument(seq() + ": token id " + std::to_string(t) +
                                       " outside the vocabulary of " +
                                       std::to_string(spec_.vocab_size));
            }
        }
    }
    return Status::Ok();
}

Status ModelRunner::PackInputs(std::span<const SequenceChunk> batch, int64_t rows,
                               int64_t step_rows, int64_t step_seqs) {
    const auto num_seqs = static_cast<int64_t>(batch.size());
    const int64_t groups = kv_groups_.num_groups();
    // Group g's table and slots of a chunk (validated: every group is there).
    auto table_of = [](const SequenceChunk& c, int64_t g) {
        return g == 0 ? c.block_table
                      : std::span<const int32_t>(c.group_block_tables[static_cast<size_t>(g - 1)]);
    };
    auto slots_of = [](const SequenceChunk& c, int64_t g) {
        return g == 0 ? c.slot_mapping
                      : std::span<const int64_t>(c.group_slot_mappings[static_cast<size_t>(g - 1)]);
    };
    int64_t entries = 0;
    for (const SequenceChunk& c : batch) {
        for (int64_t g = 0; g < groups; ++g) entries += static_cast<int64_t>(table_of(c, g).size());
    }
    KV_RETURN_IF_ERROR(EnsureWorkspace(step_rows, step_seqs, entries));
    const InputLayout layout(ws_rows_, ws_seqs_, ws_table_entries_, groups);
    uint8_t* h = host_inputs_.data();
    auto* ids = reinterpret_cast<int32_t*>(h + layout.ids);
    auto* positions = reinterpret_cast<int32_t*>(h + layout.positions);
    auto* slots = reinterpret_cast<int64_t*>(h + layout.slots);
    auto* query_starts = reinterpret_cast<int32_t*>(h + layout.query_starts);
    auto* context_lens = reinterpret_cast<int32_t*>(h + layout.context_lens);
    auto* table_starts = reinterpret_cast<int32_t*>(h + layout.table_starts);
    auto* last_rows = reinterpret_cast<int32_t*>(h + layout.last_rows);
    auto* tables = reinterpret_cast<int32_t*>(h + layout.tables);
    int32_t r = 0;
    query_starts[0] = 0;
    // Padded sequences (PadStepInputs) bring at most one row each.
    step_max_query_rows_ = step_seqs > num_seqs ? 1 : 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
        const SequenceChunk& c = batch[static_cast<size_t>(s)];
        const auto n = static_cast<int32_t>(c.tokens.size());
        step_max_query_rows_ = std::max<int64_t>(step_max_query_rows_, n);
        for (int32_t i = 0; i < n; ++i) {
            ids[r + i] = c.tokens[static_cast<size_t>(i)];
            positions[r + i] = static_cast<int32_t>(c.start_pos + i);
        }
        for (int64_t g = 0; g < groups; ++g) {
            const std::span<const int64_t> group_slots = slots_of(c, g);
            std::copy(group_slots.begin(), group_slots.end(), slots + g * ws_rows_ + r);
        }
        r += n;
        query_starts[s + 1] = r;
        context_lens[s] = static_cast<int32_t>(c.start_pos + n);
        last_rows[s] = r - 1;
    }
    int32_t e = 0;
    for (int64_t g = 0; g < groups; ++g) {
        int32_t* starts = table_starts + g * (ws_seqs_ + 1);
        starts[0] = e;
        for (int64_t s = 0; s < num_seqs; ++s) {
            const std::span<const int32_t> table = table_of(batch[static_cast<size_t>(s)], g);
            std::copy(table.begin(), table.end(), tables + e);
            e += static_cast<int32_t>(table.size());
            starts[s + 1] = e;
        }
    }
    PadStepInputs({.ids = ids,
                   .positions = positions,
                   .slots = slots,
                   .slots_stride = ws_rows_,
                   .query_starts = query_starts,
                   .context_lens = context_lens,
                   .table_starts = table_starts,
                   .table_starts_stride = ws_seqs_ + 1,
                   .last_rows = last_rows,
                   .num_groups = groups},
                  rows, num_seqs, step_rows, step_seqs);
    const size_t used = layout.tables + static_cast<size_t>(e) * sizeof(int32_t);
    return backend_->CopyToDevice(inputs_.data(), h, used);
}

}  // namespace kvshard
