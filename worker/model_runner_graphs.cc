// ModelRunner (worker/model_runner.h): which steps are padded to a decode bucket and how a
// padded step is captured as a graph (worker/decode_buckets.h, worker/decode_graphs.h).
#include <string>

#include "worker/decode_buckets.h"
#include "worker/model_runner.h"

namespace kvshard {

Status CheckCudaGraphs(const RunnerOptions& options, BackendKind kind, bool captures, int tp) {
    if (!options.cuda_graphs.value_or(false)) return Status::Ok();
    if (!captures) {
        return InvalidArgument("cuda_graphs: true, but the " + std::string(BackendKindName(kind)) +
                               " backend does not capture CUDA graphs (leave cuda_graphs unset, "
                               "or false)");
    }
    if (tp > 1 && options.collective_path != CollectivePath::kNccl) {
        // NCCL on the backend's stream is recorded by a capture like a kernel; the host and
        // host-staged collectives run on the host, between the kernels, and wait there.
        return InvalidArgument(
            "cuda_graphs: true at tp " + std::to_string(tp) + " with the " +
            std::string(CollectivePathName(options.collective_path)) +
            " collective: its all-reduces run on the host and wait there, which a graph cannot "
            "hold (graphs at tp > 1 need the nccl collective: every rank on a GPU of its own, "
            "collectives not staged); leave cuda_graphs unset, or false");
    }
    return Status::Ok();
}

int64_t ModelRunner::PaddedBucket(std::span<const SequenceChunk> batch, bool has_layer_hook) const {
    if ((graphs_ == nullptr && !options_.pad_decode_to_buckets) || has_layer_hook) return 0;
    for (const SequenceChunk& c : batch) {
        if (c.tokens.size() != 1 || c.all_logits) return 0;
    }
    return batch.empty() ? 0 : BucketFor(buckets_, static_cast<int64_t>(batch.size()));
}

Status ModelRunner::CaptureStep(int64_t bucket, int64_t rows, int64_t num_seqs) {
    const CommStats before = comm_stats_;
    const int64_t counted_before = collective_ != nullptr ? collective_->bytes_all_reduced() : 0;
    Result<int> graph = [&]() -> Result<int> {
        KV_RETURN_IF_ERROR(capture_->BeginCapture());
        const Status queued = QueueStep(rows, num_seqs, {});
        Result<int> captured = capture_->EndCapture();  // always closes the capture
        if (!queued.ok() && captured.ok()) {
            capture_->ReleaseGraph(*captured);
            return queued;
        }
        return captured;
    }();
    // What the capture queued: the sizes each replay counts again.
    const CapturedCollectives captured{
        .layer_all_reduce_bytes =
            comm_stats_.layer_all_reduce_bytes - before.layer_all_reduce_bytes,
        .embedding_all_reduce_bytes =
            comm_stats_.embedding_all_reduce_bytes - before.embedding_all_reduce_bytes};
    const int64_t counted_in_capture =
        collective_ != nullptr ? collective_->bytes_all_reduced() - counted_before : 0;
    if (collective_ != nullptr) {
        // Whether a launch of a captured NCCL operation is a graph's must be the same on every
        // rank (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/usage/cudagraph.html):
        // one rank's failed capture makes every rank run the bucket eagerly. The vote is host
        // memory, so it waits for the stream (outside the capture, which is closed).
        float captured_here = graph.ok() ? 1.0f : 0.0f;
        KV_RETURN_IF_ERROR(collective_->AllReduceSum(&captured_here, 1));
        if (graph.ok() && captured_here < static_cast<float>(collective_->size())) {
            capture_->ReleaseGraph(*graph);
            graph = Unavailable("another rank's capture of decode bucket " +
                                std::to_string(bucket) + " failed");
        }
    }
    graphs_->Captured(bucket, graph, captured);
    if (!graph.ok()) {
        // Nothing the capture queued ran: the eager step below counts its collectives.
        comm_stats_.layer_all_reduce_bytes = before.layer_all_reduce_bytes;
        comm_stats_.embedding_all_reduce_bytes = before.embedding_all_reduce_bytes;
        if (rank_collective_ != nullptr)
            rank_collective_->AddGraphAllReduceBytes(-counted_in_capture);
        return QueueStep(rows, num_seqs, {});
    }
    // The capture ran nothing: this step is the graph's first replay.
    KV_RETURN_IF_ERROR(capture_->Replay(*graph));
    graphs_->Replayed();
    return Status::Ok();
}

void ModelRunner::CountReplayedCollectives(const CapturedCollectives& collectives) {
    comm_stats_.embedding_all_reduce_bytes += collectives.embedding_all_reduce_bytes;
    comm_stats_.layer_all_reduce_bytes += collectives.layer_all_reduce_bytes;
    if (rank_collective_ != nullptr)
        rank_collective_->AddGraphAllReduceBytes(collectives.all_reduce_bytes());
}

}  // namespace kvshard
