#include "coordinator/router.h"

#include <algorithm>
#include <limits>

namespace kvshard {
namespace {

// Requests on the instance now, those in its inbox included: the counts of its last step would
// send a burst of arrivals between two steps all to the same instance.
int64_t Load(const InstanceEngine* e) { return e->NumRequests(); }

// The instances that can serve now (their workers are up); an instance whose workers died is
// skipped until they are re-formed, so no request pays for its failure.
std::vector<InstanceEngine*> Up(const std::vector<InstanceEngine*>& instances) {
    std::vector<InstanceEngine*> up;
    for (InstanceEngine* e : instances) {
        if (e->Health().code() != StatusCode::kUnavailable) up.push_back(e);
    }
    return up;
}

InstanceEngine* LeastLoaded(const std::vector<InstanceEngine*>& candidates) {
    InstanceEngine* best = nullptr;
    int64_t best_load = std::numeric_limits<int64_t>::max();
    for (InstanceEngine* e : candidates) {
        const int64_t load = Load(e);
        if (load < best_load) {
            best = e;
            best_load = load;
        }
    }
    return best;
}

}  // namespace

Result<std::unique_ptr<Router>> Router::Create(std::vector<InstanceEngine*> instances,
                                               const RouterConfig& config) {
    if (instances.empty()) return InvalidArgument("the router needs at least one instance");
    std::unique_ptr<Router> router(new Router(std::move(instances), config));
    for (InstanceEngine* e : router->all_) {
        if (&e->clock() != &router->all_[0]->clock()) {
            return InvalidArgument("instance " + e->config().name + " reads another clock than " +
                                   router->all_[0]->config().name +
                                   ": a request's times must be read from one clock");
        }
    }
    if (!router->mixed_.empty() && !router->prefill_.empty()) {
        return InvalidArgument("mixed instances cannot be combined with prefill/decode instances");
    }
    if (router->prefill_.empty() != router->decode_.empty()) {
        return InvalidArgument(router->prefill_.empty()
                                   ? "decode instances need at least one prefill instance"
                                   : "prefill instances need at least one decode instance");
    }
    if (router->disaggregated()) {
        const int64_t bs = router->prefill_[0]->config().blocks.block_size;
        for (InstanceEngine* e : router->all_) {
            if (e->config().blocks.block_size != bs) {
                return InvalidArgument(
                    "KV handoff needs one block size on every instance: " + e->config().name +
                    " has " + std::to_string(e->config().blocks.block_size) + ", " +
                    router->prefill_[0]->config().name + " " + std::to_string(bs));
            }
        }
        for (InstanceEngine* d : router->decode_) {
            if (static_cast<int32_t>(d->config().kv_endpoints.size()) != d->config().tp) {
                return InvalidArgument("decode instance " + d->config().name + " has " +
                                       std::to_string(d->config().kv_endpoints.size()) +
                                       " KV endpoints for tp " + std::to_string(d->config().tp));
            }
        }
    }
    return router;
}

Router::Router(std::vector<InstanceEngine*> instances, const RouterConfig& config)
    : config_(config), all_(std::move(instances)) {
    for (InstanceEngine* e : all_) {
        switch (e->config().role) {
            case PoolRole::kMixed:
                mixed_.push_back(e);
                break;
            case PoolRole::kPrefill:
                prefill_.push_back(e);
                break;
            case PoolRole::kDecode:
                decode_.push_back(e);
                break;
        }
    }
}

InstanceEngine* Router::PickPrefix(const std::vector<InstanceEngine*>& candidates,
                                   const std::vector<int32_t>& prompt) const {
    if (candidates.size() == 1) return candidates[0];
    std::vector<int64_t> loads;
    for (InstanceEngine* e : candidates) loads.push_back(Load(e));
    const int64_t min_load = *std::min_element(loads.begin(), loads.end());
    InstanceEngine* best = nullptr;
    int64_t best_cached = -1, best_load = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
        if (loads[i] > min_load + config_.prefix_load_slack) continue;
        const int64_t cached = candidates[i]->snapshot()->prefix.CachedPrefixTokens(prompt);
        if (cached > best_cached || (cached == best_cached && loads[i] < best_load)) {
            best = candidates[i];
            best_cached = cached;
            best_load = loads[i];
        }
    }
    return best;
}

InstanceEngine* Router::PickPinned(const std::vector<InstanceEngine*>& candidates,
                                   const GenerationRequest& request) const {
    if (request.cache_breakpoints.empty()) return nullptr;
    std::vector<int64_t> loads;
    for (InstanceEngine* e : candidates) loads.push_back(Load(e));
    const int64_t min_load = *std::min_element(loads.begin(), loads.end());
    InstanceEngine* best = nullptr;
    int64_t best_pinned = 0, best_load = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
        if (loads[i] > min_load + config_.pin_load_slack) continue;
        const int64_t pinned =
            candidates[i]->snapshot()->prefix.PinnedPrefixTokens(request.prompt_token_ids);
        if (pinned > best_pinned || (pinned == best_pinned && best != nullptr && loads[i] < best_load)) {
            best = candidates[i];
            best_pinned = pinned;
            best_load = loads[i];
        }
    }
    return best;
}

InstanceEngine* Router::Pick(const std::vector<InstanceEngine*>& candidates,
                             const GenerationRequest& request) const {
    if (candidates.size() > 1) {
        if (InstanceEngine* pinned = PickPinned(candidates, request)) return pinned;
    }
    return PickPrefix(candidates, request.prompt_token_ids);
}

Status Router::Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) {
    const std::vector<InstanceEngine*> serving = Up(disaggregated() ? prefill_ : mixed_);
    if (serving.empty()) {
        return Status(StatusCode::kUnavailable,
                      disaggregated() ? "no prefill instance can serve now: their workers are down"
                                      : "no instance can serve now: their workers are down");
    }
    if (!disaggregated()) {
        return Pick(serving, request)->Submit(std::move(request), std::move(sink));
    }
    InstanceEngine* prefill = Pick(serving, request);
    const std::vector<InstanceEngine*> decoding = Up(decode_);
    // With every decode instance down, the prefill instance decodes the request itself.
    if (request.n != 1 || decoding.empty())
        return prefill->Submit(std::move(request), std::move(sink));
    InstanceEngine* decode = LeastLoaded(decoding);
    uint64_t transfer_id = 0;
    {
        std::lock_guard<std::mutex> lock(numbering_mu_);
        transfer_id = next_transfer_id_++;
    }
    return prefill->SubmitWithHandoff(std::move(request), std::move(sink), decode, transfer_id);
}

void Router::WithTransferNumberingPaused(const std::function<void(uint64_t next)>& fn) {
    std::lock_guard<std::mutex> lock(numbering_mu_);
    fn(next_transfer_id_.load());
}

void Router::Abort(const std::string& request_id) {
    for (InstanceEngine* e : all_) e->Abort(request_id);
}

EngineStats Router::Stats() const {
    EngineStats out;
    int64_t used = 0, total = 0;
    for (const InstanceEngine* e : all_) {
        const EngineStats s = e->Stats();
        out.instances.insert(out.instances.end(), s.instances.begin(), s.instances.end());
        out.cache_configs.insert(out.cache_configs.end(), s.cache_configs.begin(),
                                 s.cache_configs.end());
        out.num_running += s.num_running;
        out.num_waiting += s.num_waiting;
        out.prefix_cache_queries_tokens += s.prefix_cache_queries_tokens;
        out.prefix_cache_hits_tokens += s.prefix_cache_hits_tokens;
        out.num_preemptions += s.num_preemptions;
        out.pinned_blocks += s.pinned_blocks;
        out.pin_hits_total += s.pin_hits_total;
        out.pins_expired_total += s.pins_expired_total;
        out.pins_refused_total += s.pins_refused_total;
        const int64_t blocks = e->config().blocks.num_blocks;
        used += static_cast<int64_t>(s.kv_cache_usage * static_cast<double>(blocks) + 0.5);
        total += blocks;
    }
    out.kv_cache_usage = total > 0 ? static_cast<double>(used) / static_cast<double>(total) : 0.0;
    return out;
}

Status Router::Health() const {
    const std::vector<InstanceEngine*>& serving = disaggregated() ? prefill_ : mixed_;
    Status first;
    for (const InstanceEngine* e : serving) {
        Status st = e->Health();
        if (st.ok()) return st;
        if (first.ok()) first = Status(st.code(), e->config().name + ": " + st.message());
    }
    return first;
}

int64_t Router::max_context() const {
    int64_t out = std::numeric_limits<int64_t>::max();
    for (const InstanceEngine* e : all_) out = std::min(out, e->max_context());
    return out;
}

}  // namespace kvshard
