#include "kv/capacity_report.h"

#include <cstdio>
#include <nlohmann/json.hpp>

namespace kvshard::kv {
namespace {

std::string AttentionName(AttentionKind kind) {
    switch (kind) {
        case AttentionKind::kMultiHead:
            return "mha";
        case AttentionKind::kMultiLatent:
            return "mla";
    }
    return "?";
}

// 1234567 -> "1,234,567".
std::string Grouped(int64_t v) {
    std::string digits = std::to_string(v < 0 ? -v : v);
    std::string out;
    for (size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return v < 0 ? "-" + out : out;
}

std::string Fixed(double v, int decimals) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", decimals, v);
    return buf;
}

// "131,072 B (128.0 KiB)" or "141,107,412,992 B (131.42 GiB, 141.11 GB)".
std::string Bytes(int64_t v) {
    const double d = static_cast<double>(v);
    if (v >= (int64_t{1} << 30)) {
        return Grouped(v) + " B (" + Fixed(d / (1 << 30), 2) + " GiB, " + Fixed(d / 1e9, 2) +
               " GB)";
    }
    if (v >= (1 << 20)) return Grouped(v) + " B (" + Fixed(d / (1 << 20), 2) + " MiB)";
    if (v >= (1 << 10)) return Grouped(v) + " B (" + Fixed(d / (1 << 10), 2) + " KiB)";
    return Grouped(v) + " B";
}

}  // namespace

std::string CapacityPlanJson(const CapacityPlan& p) {
    nlohmann::ordered_json j;
    j["config"] = p.config_path;
    j["model_type"] = p.model_type;
    j["attention"] = AttentionName(p.attention);
    j["num_layers"] = p.num_layers;
    j["num_sliding_layers"] = p.num_sliding_layers;
    j["sliding_window"] = p.sliding_window;
    j["tp"] = p.input.tp;
    j["gpus"] = p.input.num_gpus;
    j["instances"] = p.num_instances;
    j["kv_dtype"] = std::string(KvDtypeName(p.input.kv_dtype));
    j["weight_dtype"] = std::string(WeightDtypeName(p.input.weight_dtype));
    j["gpu_memory_bytes"] = p.input.gpu_memory_bytes;
    j["memory_utilization"] = p.input.memory_utilization;
    j["overhead_bytes_per_gpu"] = p.input.overhead_bytes_per_gpu;
    j["context_tokens"] = p.input.context_tokens;
    j["block_size"] = p.input.block_size;
    j["kv_bytes_per_token"] = p.kv_bytes_per_token;
    j["kv_heads_per_gpu"] = p.kv_heads_per_gpu;
    j["kv_head_replication"] = p.kv_head_replication;
    j["kv_bytes_per_token_per_gpu"] = p.kv_bytes_per_token_per_gpu;
    j["kv_bytes_per_token_real"] = p.kv_bytes_per_token_real;
    j["kv_bytes_per_block_per_gpu"] = p.kv_bytes_per_block_per_gpu;
    j["kv_bytes_per_sequence"] = p.kv_bytes_per_sequence;
    j["kv_bytes_per_sequence_real"] = p.kv_bytes_per_sequence_real;
    j["parameter_count"] = p.weights.parameter_count;
    j["weight_bytes_total"] = p.weights.bytes_total;
    j["weight_bytes_per_gpu"] = p.weights.bytes_per_gpu;
    j["usable_bytes_per_gpu"] = p.usable_bytes_per_gpu;
    j["kv_budget_bytes_per_gpu"] = p.kv_budget_bytes_per_gpu;
    j["kv_budget_bytes_total"] = p.kv_budget_bytes_total;
    j["weights_fit"] = p.weights_fit;
    j["kv_blocks_per_gpu"] = p.kv_blocks_per_gpu;
    j["kv_tokens_per_instance"] = p.kv_tokens_per_instance;
    j["kv_tokens_capacity"] = p.kv_tokens_capacity;
    j["blocks_per_sequence"] = p.blocks_per_sequence;
    j["max_sequences_per_instance"] = p.max_sequences_per_instance;
    j["max_concurrent_sequences"] = p.max_concurrent_sequences;
    j["sequences_per_instance_exact"] = p.sequences_per_instance_exact;
    j["max_concurrent_sequences_real"] = p.max_concurrent_sequences_real;
    j["notes"] = p.notes;
    return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string CapacityPlanTable(const CapacityPlan& p) {
    const PlannerInput& in = p.input;
    std::string s;
    auto row = [&s](const std::string& name, const std::string& value) {
        std::string line = "  " + name;
        if (line.size() < 40) line.resize(40, ' ');
        s += line + value + "\n";
    };
    s += "model     " + p.model_type + " (" + p.config_path + "), " + std::to_string(p.num_layers) +
         " layers, attention " + AttentionName(p.attention);
    if (p.num_sliding_layers > 0) {
        s += ", " + std::to_string(p.num_sliding_layers) + " sliding-window layers of " +
             Grouped(p.sliding_window) + " tokens";
    }
    s += "\ncluster   " + std::to_string(in.num_gpus) + " GPU(s) of " + Bytes(in.gpu_memory_bytes) +
         ", tp " + std::to_string(in.tp) + " (" + std::to_string(p.num_instances) +
         " instance(s)), utilization " + Fixed(in.memory_utilization, 2) + ", KV " +
         std::string(KvDtypeName(in.kv_dtype)) + ", weights " +
         std::string(WeightDtypeName(in.weight_dtype)) + ", block " +
         std::to_string(in.block_size) + ", context " + Grouped(in.context_tokens) + "\n";
    s += "KV cache\n";
    row("bytes per token (all layers global)", Bytes(p.kv_bytes_per_token));
    std::string layout;
    if (p.attention == AttentionKind::kMultiLatent) {
        layout = "the whole MLA latent on every GPU";
    } else {
        layout = std::to_string(p.kv_heads_per_gpu) + " KV head(s) per GPU";
        if (p.kv_head_replication > 1) {
            layout += ", each on " + std::to_string(p.kv_head_replication) + " GPUs";
        }
    }
    row("bytes per token per GPU", Bytes(p.kv_bytes_per_token_per_gpu) + ", " + layout);
    row("bytes per block per GPU", Bytes(p.kv_bytes_per_block_per_gpu));
    row("bytes per sequence at context", Bytes(p.kv_bytes_per_sequence));
    if (p.num_sliding_layers > 0) {
        row("... sliding windows honoured", Bytes(p.kv_bytes_per_sequence_real) + " (" +
                                                Fixed(p.kv_bytes_per_token_real, 0) +
                                                " B per token on average)");
    }
    s += "weights\n";
    row("parameters", Grouped(p.weights.parameter_count) + " (" +
                          Fixed(static_cast<double>(p.weights.parameter_count) / 1e9, 2) +
                          " billion)");
    row("bytes (whole model)", Bytes(p.weights.bytes_total));
    row("bytes per GPU", Bytes(p.weights.bytes_per_gpu));
    s += "per GPU\n";
    row("usable (memory x utilization)", Bytes(p.usable_bytes_per_gpu));
    row("overhead reserve", Bytes(in.overhead_bytes_per_gpu));
    row("KV budget", Bytes(p.kv_budget_bytes_per_gpu));
    row("KV blocks", Grouped(p.kv_blocks_per_gpu));
    s += "capacity\n";
    row("KV budget, all GPUs", Bytes(p.kv_budget_bytes_total));
    row("tokens per instance", Grouped(p.kv_tokens_per_instance));
    row("tokens, all instances", Grouped(p.kv_tokens_capacity));
    row("sequences at context", Grouped(p.max_concurrent_sequences) + " (" +
                                    Fixed(p.sequences_per_instance_exact, 2) + " per instance)");
    if (p.num_sliding_layers > 0) {
        row("... sliding windows honoured", Grouped(p.max_concurrent_sequences_real));
    }
    if (!p.weights_fit) {
        s += "the weights (" + Bytes(p.weights.bytes_per_gpu) +
             " per GPU) and the overhead reserve do not fit in the usable memory: raise tp, use "
             "more memory or a smaller weight dtype\n";
    }
    for (const std::string& n : p.notes) s += "note: " + n + "\n";
    return s;
}

}  // namespace kvshard::kv
