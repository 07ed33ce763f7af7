#include "worker/tp_group.h"

#include <algorithm>
#include <string>

#include "common/build_config.h"
#include "kernels/cpu_ops.h"
#include "worker/generator.h"
#include "worker/kv_handoff.h"

namespace kvshard {

TpGroup::TpGroup(const TpGroupConfig& config) : config_(config) {}

Result<std::unique_ptr<TpGroup>> TpGroup::Create(const ModelFile& model,
                                                 const TpGroupConfig& config) {
    // Refuse a bad tp here, before any thread starts, with MakeShardLayout's message.
    KV_RETURN_IF_ERROR(MakeShardLayout(model.spec(), {.rank = 0, .tp = config.tp}).status());
    std::unique_ptr<TpGroup> g(new TpGroup(config));
    const auto n = static_cast<size_t>(config.tp);
    if (g->config_.threads_per_rank <= 0) {
        const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
        g->config_.threads_per_rank = std::max(1, hw / config.tp);
    }
    if (config.tp > 1) {
        g->saved_blas_threads_ = cpu::BlasNumThreads();
        cpu::SetBlasNumThreads(1);
    }
    g->group_ = LocalGroup::Create(config.tp, config.timeout_ms);
    for (int r = 0; r < config.tp; ++r) g->collectives_.push_back(g->group_->Collective(r));
    // Each rank's GPU, and the path of the ranks' collectives (the same for every rank).
    std::vector<int> devices = config.devices;
    const bool cuda = config.runner.backend.kind == BackendKind::kCuda;
    if (cuda && devices.empty()) {
        for (int r = 0; r < config.tp; ++r) devices.push_back(config.runner.backend.device + r);
    }
    if (cuda && devices.size() != n) {
        return InvalidArgument("tp " + std::to_string(config.tp) + ": " +
                               std::to_string(devices.size()) + " devices given, one per rank");
    }
    g->path_ = config.tp == 1 ? CollectivePath::kHost
                              : ChooseCollectivePath({.backend = config.runner.backend.kind,
                                                      .tp = config.tp,
                                                      .devices = devices,
                                                      .nccl_available = KVSHARD_WITH_CUDA != 0,
                                                      .force_staged = config.force_staged});
    std::string nccl_id;
    if (g->path_ == CollectivePath::kNccl) {
        KV_ASSIGN_OR_RETURN(nccl_id, NewNcclUniqueId());
    }
    for (int r = 0; r < config.tp; ++r) {
        g->rank_collectives_.push_back(std::make_unique<RankCollective>(r, config.tp));
    }
    if (config.peer_exchange != nullptr && config.kv_transport_name.empty())
        return InvalidArgument("a peer-copy KV handoff needs the instance's KV transport name");
    g->runners_.resize(n);
    g->transports_.resize(n);
    if (!config.kv_transport_name.empty()) {
        for (int r = 0; r < config.tp; ++r) {
            KV_ASSIGN_OR_RETURN(
                g->transports_[static_cast<size_t>(r)],
                MakeLocalKvTransport(config.kv_transport_name + "/" + std::to_string(r)));
        }
    }
    g->step_runners_.resize(n);
    g->step_results_.resize(n);
    g->job_status_.resize(n);
    for (int r = 0; r < config.tp; ++r) g->threads_.emplace_back(&TpGroup::RankMain, g.get(), r);
    // Each rank loads its slices on its own thread (in parallel, and first-touched there).
    KV_RETURN_IF_ERROR(g->RunJob([&](int rank) -> Status {
        const auto r = static_cast<size_t>(rank);
        RankCollective* c = config.tp > 1 ? g->rank_collectives_[r].get() : nullptr;
        RunnerOptions runner_options = config.runner;
        if (cuda) runner_options.backend.device = devices[r];
        runner_options.collective_path = g->path_;
        KV_ASSIGN_OR_RETURN(
            std::unique_ptr<ModelRunner> runner,
            MakeModelRunner(model, {.rank = rank, .tp = config.tp}, runner_options, c));
        if (c != nullptr) {
            // The backend exists now: the collective of the group's path goes on it (NCCL
            // initializes here, every rank at once).
            KV_RETURN_IF_ERROR(AttachBackendCollective({.path = g->path_,
                                                        .rank = rank,
                                                        .size = config.tp,
                                                        .host = g->collectives_[r].get(),
                                                        .nccl_unique_id = nccl_id,
                                                        .timeout_ms = config.timeout_ms},
                                                       runner->backend(), *c));
        }
        KvTransport* transport = g->transports_[static_cast<size_t>(rank)].get();
        // Pieces that cannot fit this rank's pool are refused before anything is allocated.
        if (transport != nullptr) {
            KV_RETURN_IF_ERROR(
                transport->SetReceiveGeometry(ReceiveGeometryOf(*runner->pool(), runner->layout())));
        }
        g->step_runners_[static_cast<size_t>(rank)] =
            std::make_unique<StepRunner>(*runner, transport, config.peer_exchange.get());
        g->runners_[static_cast<size_t>(rank)] = std::move(runner);
        return Status::Ok();
    }));
    return g;
}

TpGroup::~TpGroup() {
    // Each rank's runner and communicator are released on its own thread, all at once: an NCCL
    // communicator's teardown waits for its peers'.
    if (!threads_.empty()) {
        (void)RunJobUnchecked([this](int rank) {
            const auto r = static_cast<size_t>(rank);
            step_runners_[r].reset();
            runners_[r].reset();
            rank_collectives_[r].reset();
            return Status::Ok();
        });
    }
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
    cpu::SetBlasNumThreads(saved_blas_threads_);
}

void TpGroup::RankMain(int rank) {
    cpu::SetThisThreadNumThreads(config_.threads_per_rank);
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
        cv_.wait(lock, [&] { return stopping_ || job_generation_ != seen; });
        if (stopping_) return;
        seen = job_generation_;
        const Job* job = job_;
        lock.unlock();
        Status status = (*job)(rank);
        lock.lock();
        job_status_[static_cast<size_t>(rank)] = std::move(status);
        if (++num_done_ == tp()) cv_.notify_all();
    }
}

Status TpGroup::RunJob(const Job& job) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if (!broken_.ok()) return broken_;
    }
    return RunJobUnchecked(job);
}

Status TpGroup::RunJobUnchecked(const Job& job) {
    std::unique_lock<std::mutex> lock(mu_);
    job_ = &job;
    num_done_ = 0;
    ++job_generation_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return num_done_ == tp(); });
    job_ = nullptr;
    Status first;
    int num_failed = 0;
    for (const Status& s : job_status_) {
        if (s.ok()) continue;
        if (first.ok()) first = s;
        ++num_failed;
    }
    if (num_failed > 0 && num_failed < tp()) {
        // Only some ranks failed: their state (KV, samplers) may now differ from the others'.
        broken_ = Status(first.code(),
                         "tensor-parallel group broken: " + std::to_string(num_failed) + " of " +
                             std::to_string(tp()) + " ranks failed: " + first.message());
        group_->Abort(broken_.message());
        for (const auto& c : rank_collectives_) c->Abort(broken_.message());
        return broken_;
    }
    return first;
}

Status TpGroup::RunOnEveryRank(const std::function<Status(int rank, ModelRunner& runner)>& fn) {
    return RunJob([&](int rank) { return fn(rank, *runners_[static_cast<size_t>(rank)]); });
}

Result<StepResult> TpGroup::Execute(const StepPlan& plan) {
    KV_RETURN_IF_ERROR(RunJob([&](int rank) -> Status {
        const auto r = static_cast<size_t>(rank);
        Result<StepResult> result = step_runners_[r]->Execute(plan);
        if (!result.ok()) return result.status();
        step_results_[r] = std::move(*result);
        return Status::Ok();
    }));
    // Same logits on every rank, same samplers: the same tokens (checked; it is cheap).
    for (int r = 1; r < tp(); ++r) {
        if (step_results_[static_cast<size_t>(r)].tokens != step_results_[0].tokens) {
            return Internal("step " + std::to_string(plan.step_id) + ": rank " + std::to_string(r) +
                            " sampled other tokens than rank 0");
        }
    }
    StepResult out = step_results_[0];
    for (int r = 1; r < tp(); ++r) {
        const StepResult& other = step_results_[static_cast<size_t>(r)];
        out.kv_bytes_sent += other.kv_bytes_sent;
        out.kv_bytes_received += other.kv_bytes_received;
        MergeTransferFailures(other.failed_transfers, &out.failed_transfers);
    }
    return out;
}

int64_t TpGroup::kv_staged_bytes() const {
    int64_t out = 0;
    for (const auto& t : transports_) out += t == nullptr ? 0 : t->staged_bytes();
    return out;
}

std::vector<std::string> TpGroup::kv_endpoints() const {
    std::vector<std::string> out;
    for (const auto& t : transports_) out.push_back(t == nullptr ? std::string() : t->endpoint());
    return out;
}

Result<GenerateResult> GenerateOnEveryRank(TpGroup& group, const Tokenizer& tokenizer,
                                           const std::vector<int32_t>& prompt_ids,
                                           const GenerateOptions& options,
                                           const std::function<void(std::string_view)>& on_text,
                                           int64_t seq_id) {
    std::vector<GenerateResult> results(static_cast<size_t>(group.tp()));
    KV_RETURN_IF_ERROR(group.RunOnEveryRank([&](int rank, ModelRunner& runner) -> Status {
        std::function<void(std::string_view)> no_text;
        KV_ASSIGN_OR_RETURN(results[static_cast<size_t>(rank)],
                            Generate(runner, tokenizer, prompt_ids, options,
                                     rank == 0 ? on_text : no_text, seq_id));
        return Status::Ok();
    }));
    for (size_t r = 1; r < results.size(); ++r) {
        if (results[r].token_ids != results[0].token_ids) {
            return Internal("rank " + std::to_string(r) + " generated other tokens than rank 0");
        }
    }
    return results[0];
}

}  // namespace kvshard
