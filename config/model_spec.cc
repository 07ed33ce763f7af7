#include "config/model_spec.h"

#include <sstream>

namespace kvshard {

bool IsSupportedArchitecture(const std::string& architecture) {
    return architecture == "llama" || architecture == "mistral" || architecture == "qwen2" ||
           architecture == "qwen3" || architecture == "gemma3";
}

Status ModelSpec::Validate() const {
    auto positive = [](const char* name, int64_t v) -> Status {
        if (v <= 0) return InvalidArgument(std::string(name) + " must be positive, got " + std::to_string(v));
        // Far above any real model; keeps products of sizes (heads * head_dim, ...) in int64
        // whatever a corrupted file says.
        constexpr int64_t kMaxSize = int64_t{1} << 31;
        if (v > kMaxSize) {
            return InvalidArgument(std::string(name) + " of " + std::to_string(v) +
                                   " is larger than kvshard supports (2^31)");
        }
        return Status::Ok();
    };
    if (!IsSupportedArchitecture(architecture)) {
        return Unimplemented("architecture '" + architecture +
                             "' is not supported (kvshard runs llama, mistral, qwen2, qwen3, "
                             "gemma3)");
    }
    KV_RETURN_IF_ERROR(positive("num_layers", num_layers));
    KV_RETURN_IF_ERROR(positive("hidden_size", hidden_size));
    KV_RETURN_IF_ERROR(positive("num_heads", num_heads));
    KV_RETURN_IF_ERROR(positive("num_kv_heads", num_kv_heads));
    KV_RETURN_IF_ERROR(positive("head_dim", head_dim));
    KV_RETURN_IF_ERROR(positive("ffn_size", ffn_size));
    KV_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
    if (num_heads % num_kv_heads != 0) {
        return InvalidArgument("num_heads (" + std::to_string(num_heads) +
                               ") is not a multiple of num_kv_heads (" +
                               std::to_string(num_kv_heads) + ")");
    }
    if (head_dim % 2 != 0) return InvalidArgument("head_dim must be even, got " + std::to_string(head_dim));
    if (!(rope_theta > 0)) return InvalidArgument("rope_theta must be positive");
    if (!(norm_eps > 0)) return InvalidArgument("norm_eps must be positive");
    if (sliding_window < 0 || sliding_window_pattern < 0) {
        return InvalidArgument("sliding_window (" + std::to_string(sliding_window) +
                               ") and sliding_window_pattern (" +
                               std::to_string(sliding_window_pattern) + ") must not be negative");
    }
    if (!(rope_theta_local >= 0)) return InvalidArgument("rope_theta_local must not be negative");
    if (!(embedding_scale > 0)) return InvalidArgument("embedding_scale must be positive");
    if (bos_token_id >= vocab_size || eos_token_id >= vocab_size) {
        return InvalidArgument("bos/eos token id (" + std::to_string(bos_token_id) + "/" +
                               std::to_string(eos_token_id) + ") outside vocab of " +
                               std::to_string(vocab_size));
    }
    return Status::Ok();
}

std::string ModelSpec::ToString() const {
    std::ostringstream s;
    s << architecture << ": layers=" << num_layers << " hidden=" << hidden_size
      << " heads=" << num_heads << " kv_heads=" << num_kv_heads << " head_dim=" << head_dim
      << " ffn=" << ffn_size << " vocab=" << vocab_size << " rope_theta=" << rope_theta
      << " eps=" << norm_eps << " tied=" << (tied_embeddings ? 1 : 0) << " bos=" << bos_token_id
      << " eos=" << eos_token_id;
    if (attn_bias) s << " qkv_bias=1";
    if (qk_norm) s << " qk_norm=1";
    if (post_norms) s << " post_norms=1";
    if (activation == Activation::kGeluTanh) s << " act=gelu_tanh";
    if (sliding_window > 0) {
        s << " window=" << sliding_window << " window_pattern=" << sliding_window_pattern;
    }
    if (rope_theta_local > 0) s << " rope_theta_local=" << rope_theta_local;
    return s.str();
}

}  // namespace kvshard
