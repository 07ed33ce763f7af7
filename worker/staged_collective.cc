#include "worker/staged_collective.h"

namespace kvshard {

Status StagedCollective::CopyOut(const void* src, size_t bytes, size_t extra) {
    if (staging_.size() < bytes + extra) staging_.resize(bytes + extra);
    // The ops that wrote `src` may still be queued: the copy is ordered after them, and the
    // Synchronize returns their first error too.
    KV_RETURN_IF_ERROR(backend_.CopyToHost(staging_.data(), src, bytes));
    return backend_.Synchronize().WithContext("staged collective: copying the payload out");
}

Status StagedCollective::CopyIn(void* dst, const void* src, size_t bytes) {
    KV_RETURN_IF_ERROR(backend_.CopyToDevice(dst, src, bytes));
    return backend_.Synchronize().WithContext("staged collective: copying the result back");
}

Status StagedCollective::AllReduceSum(float* data, int64_t count) {
    if (count < 0) return InvalidArgument("AllReduceSum: count " + std::to_string(count));
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    if (count > 0) KV_RETURN_IF_ERROR(CopyOut(data, bytes, 0));
    float* host = reinterpret_cast<float*>(staging_.data());
    KV_RETURN_IF_ERROR(host_.AllReduceSum(count > 0 ? host : nullptr, count));
    if (count > 0) KV_RETURN_IF_ERROR(CopyIn(data, host, bytes));
    bytes_all_reduced_ += static_cast<int64_t>(bytes);
    return Status::Ok();
}

Status StagedCollective::AllGather(const float* send, int64_t count_per_rank, float* recv) {
    if (count_per_rank < 0) {
        return InvalidArgument("AllGather: count " + std::to_string(count_per_rank));
    }
    const size_t bytes = static_cast<size_t>(count_per_rank) * sizeof(float);
    const size_t gathered = bytes * static_cast<size_t>(size());
    // staging_: this rank's slice, then the gathered rows (they must not overlap).
    KV_RETURN_IF_ERROR(CopyOut(send, bytes, gathered));
    float* host_send = reinterpret_cast<float*>(staging_.data());
    float* host_recv = host_send + count_per_rank;
    KV_RETURN_IF_ERROR(host_.AllGather(host_send, count_per_rank, host_recv));
    return gathered > 0 ? CopyIn(recv, host_recv, gathered) : Status::Ok();
}

Status StagedCollective::Broadcast(void* data, int64_t bytes, int root) {
    if (bytes < 0) return InvalidArgument("Broadcast: bytes " + std::to_string(bytes));
    const auto n = static_cast<size_t>(bytes);
    if (n > 0) KV_RETURN_IF_ERROR(CopyOut(data, n, 0));
    KV_RETURN_IF_ERROR(host_.Broadcast(n > 0 ? staging_.data() : nullptr, bytes, root));
    return n > 0 ? CopyIn(data, staging_.data(), n) : Status::Ok();
}

}  // namespace kvshard
