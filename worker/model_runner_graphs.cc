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
    if (tp > 1) {
        return InvalidArgument("cuda_graphs: true at tp " + std::to_string(tp) +
                               ": decode steps of tp > 1 are not captured (their collectives "
                               "are not); leave cuda_graphs unset, or false");
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
    const Result<int> graph = [&]() -> Result<int> {
        KV_RETURN_IF_ERROR(capture_->BeginCapture());
        const Status queued = QueueStep(rows, num_seqs, {});
        Result<int> captured = capture_->EndCapture();  // always closes the capture
        if (!queued.ok() && captured.ok()) {
            capture_->ReleaseGraph(*captured);
            return queued;
        }
        return captured;
    }();
    graphs_->Captured(bucket, graph);
    if (!graph.ok()) return QueueStep(rows, num_seqs, {});
    // The capture ran nothing: this step is the graph's first replay.
    KV_RETURN_IF_ERROR(capture_->Replay(*graph));
    graphs_->Replayed();
    return Status::Ok();
}

}  // namespace kvshard
