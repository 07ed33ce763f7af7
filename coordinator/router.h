// Router: the Engine the HTTP front end talks to when an instance is not alone — it places each
// request on an instance and, in disaggregated serving, pairs a prefill instance with a decode
// instance for it (the handoff itself is InstanceEngine's, see engine.h).
//
// Placement:
//   - mixed instances only (colocated): the least loaded instance (its requests not yet finished),
//     ties broken by the longest prefix of the prompt in its prefix cache;
//   - prefill and decode instances: prefill = among instances whose load is within
//     prefix_load_slack of the least loaded, the one whose prefix cache holds the longest prefix
//     of the prompt (then the least loaded); decode = the least loaded decode instance. A request
//     with n > 1 is served whole by its prefill instance (n choices fork after the prompt, on one
//     instance).
//   - a request with cache breakpoints goes to the instance (mixed or prefill) whose prompt-cache
//     pins hold the longest prefix of its prompt, unless that instance is more than
//     pin_load_slack requests busier than the least loaded one (then the rules above apply, and
//     the instance it lands on pins the prefix too).
// What the router reads of an instance: its load (NumRequests, counted as requests arrive), its
// health, and the prefix cache as of the snapshot the instance's engine thread last published
// (InstanceEngine::snapshot, engine_snapshot.h) — never the instance's block manager, which only
// its engine thread touches.
// Thread-safety: Submit, Abort and Stats may be called from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coordinator/engine.h"
#include "coordinator/engine_api.h"

namespace kvshard {

struct RouterConfig {
    int64_t prefix_load_slack = 4;
    int64_t pin_load_slack = 32;
};

class Router : public Engine {
  public:
    // `instances` (not owned) must outlive the router. REQUIRES: not empty; either some mixed
    // instances and no prefill/decode ones, or at least one prefill and one decode instance; one
    // clock for all (InstanceEngineConfig::clock).
    static Result<std::unique_ptr<Router>> Create(std::vector<InstanceEngine*> instances,
                                                  const RouterConfig& config = {});

    Status Submit(GenerationRequest request, std::shared_ptr<RequestSink> sink) override;
    void Abort(const std::string& request_id) override;
    // Summed over instances (kv_cache_usage: used / all blocks over all instances).
    EngineStats Stats() const override;
    int64_t max_context() const override;
    // The id the next handoff will carry (ids are handed out in increasing order).
    uint64_t next_transfer_id() const { return next_transfer_id_.load(); }
    // Runs `fn` with the id the next handoff will carry, handing out none until it returns. The
    // KV pair path's re-plan tells the workers their new pairs inside (cli/kv_pair_replan.h):
    // a transfer numbered from that id on is planned on both instances after the new pairs,
    // on the same control channels, so both sides meet it on the new pairs; those numbered
    // before it are kept off them.
    void WithTransferNumberingPaused(const std::function<void(uint64_t next)>& fn);
    // OK while requests can be served: some mixed instance (colocated) or some prefill instance
    // (disaggregated: a prefill instance decodes by itself when no decode instance can) is
    // healthy; otherwise the first instance's error.
    Status Health() const override;
    // The instances' clock (Create checks they read one).
    const Clock& clock() const override { return all_[0]->clock(); }

    bool disaggregated() const { return !prefill_.empty(); }

  private:
    Router(std::vector<InstanceEngine*> instances, const RouterConfig& config);
    InstanceEngine* PickPrefix(const std::vector<InstanceEngine*>& candidates,
                               const std::vector<int32_t>& prompt) const;
    // The instance holding the pins of the longest prefix of `request`'s prompt, within
    // pin_load_slack of the least loaded; null when none holds any, or without breakpoints.
    InstanceEngine* PickPinned(const std::vector<InstanceEngine*>& candidates,
                               const GenerationRequest& request) const;
    // PickPinned, else PickPrefix.
    InstanceEngine* Pick(const std::vector<InstanceEngine*>& candidates,
                         const GenerationRequest& request) const;

    RouterConfig config_;
    std::vector<InstanceEngine*> all_;
    std::vector<InstanceEngine*> mixed_, prefill_, decode_;
    std::mutex numbering_mu_;                    // held while an id is handed out
    std::atomic<uint64_t> next_transfer_id_{1};  // written under numbering_mu_
};

}  // namespace kvshard
