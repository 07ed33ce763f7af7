#include "worker/rank_collective.h"

#include "common/build_config.h"
#include "common/check.h"
#include "worker/staged_collective.h"
#if KVSHARD_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace kvshard {

CollectivePath ChooseCollectivePath(const CollectivePathInputs& in) {
    return DecideCollectivePath({.on_gpus = in.backend == BackendKind::kCuda,
                                 .tp = in.tp,
                                 .devices = in.devices,
                                 .nccl_available = in.nccl_available,
                                 .force_staged = in.force_staged});
}

// ---- RankCollective ----

void RankCollective::Attach(std::unique_ptr<Collective> owned) {
    Collective* target = owned.get();
    owned_ = std::move(owned);
    Attach(target);
}

void RankCollective::Attach(Collective* borrowed) {
    KV_CHECK(borrowed != nullptr && target_.load() == nullptr);
    KV_CHECK(borrowed->rank() == rank_ && borrowed->size() == size_)
        << "collective rank " << borrowed->rank() << "/" << borrowed->size() << " attached to rank "
        << rank_ << "/" << size_;
    std::lock_guard<std::mutex> lock(mu_);
    if (!abort_reason_.empty()) borrowed->Abort(abort_reason_);
    target_.store(borrowed);
}

Status RankCollective::Unattached(std::string_view what) const {
    return Internal("rank " + std::to_string(rank_) + " " + std::string(what) +
                    ": the collective is used before its backend's was attached");
}

Status RankCollective::AllReduceSum(float* data, int64_t count) {
    Collective* t = target_.load();
    return t != nullptr ? t->AllReduceSum(data, count) : Unattached("AllReduceSum");
}

Status RankCollective::AllGather(const float* send, int64_t count_per_rank, float* recv) {
    Collective* t = target_.load();
    return t != nullptr ? t->AllGather(send, count_per_rank, recv) : Unattached("AllGather");
}

Status RankCollective::Broadcast(void* data, int64_t bytes, int root) {
    Collective* t = target_.load();
    return t != nullptr ? t->Broadcast(data, bytes, root) : Unattached("Broadcast");
}

Status RankCollective::Barrier() {
    Collective* t = target_.load();
    return t != nullptr ? t->Barrier() : Unattached("Barrier");
}

void RankCollective::Abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (Collective* t = target_.load(); t != nullptr) {
        t->Abort(reason);
    } else if (abort_reason_.empty()) {
        abort_reason_ = reason.empty() ? "(no reason given)" : reason;
    }
}

int64_t RankCollective::bytes_all_reduced() const {
    Collective* t = target_.load();
    return (t != nullptr ? t->bytes_all_reduced() : 0) +
           graph_bytes_.load(std::memory_order_relaxed);
}

void RankCollective::AddGraphAllReduceBytes(int64_t bytes) {
    graph_bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

// ---- attaching ----

Status AttachBackendCollective(const BackendCollectiveOptions& options, Backend& backend,
                               RankCollective& rank_collective) {
    const std::string who = "rank " + std::to_string(options.rank) + " of tp " +
                            std::to_string(options.size) + " (" +
                            std::string(CollectivePathName(options.path)) + " collective)";
    switch (options.path) {
        case CollectivePath::kHost:
        case CollectivePath::kStaged:
            if (options.host == nullptr) {
                return InvalidArgument(who + ": no host collective to use");
            }
            if (options.path == CollectivePath::kHost) {
                rank_collective.Attach(options.host);
            } else {
                rank_collective.Attach(std::make_unique<StagedCollective>(*options.host, backend));
            }
            return Status::Ok();
        case CollectivePath::kNccl: {
#if KVSHARD_WITH_CUDA
            auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
            if (cuda_backend == nullptr) {
                return InvalidArgument(who + ": the " +
                                       std::string(BackendKindName(backend.kind())) +
                                       " backend has no CUDA stream for NCCL");
            }
            CollectiveConfig cc;
            cc.kind = CollectiveConfig::Kind::kNccl;
            cc.rank = options.rank;
            cc.size = options.size;
            cc.nccl_unique_id = options.nccl_unique_id;
            cc.timeout_ms = options.timeout_ms;
            cc.cuda_device = cuda_backend->device();
            cc.cuda_stream = cuda_backend->stream();
            cc.nccl_stream_ordered = true;
            Result<std::unique_ptr<Collective>> nccl = MakeCollective(cc);
            if (!nccl.ok()) return nccl.status().WithContext(who);
            rank_collective.Attach(std::move(*nccl));
            return Status::Ok();
#else
            return InvalidArgument(who + ": this kvshard was built without CUDA (no NCCL)");
#endif
        }
    }
    return InvalidArgument(who + ": unknown collective path");
}

}  // namespace kvshard
