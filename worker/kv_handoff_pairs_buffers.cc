// KvPairBuffers and KvPairStaging (worker/kv_handoff_pairs_buffers.h).
#include "worker/kv_handoff_pairs_buffers.h"

#include <algorithm>
#include <bit>
#include <string>
#include <utility>

namespace kvshard {

namespace {

constexpr int64_t kMinClassBytes = int64_t{64} << 10;

std::string MiB(int64_t bytes) { return std::to_string((bytes + (1 << 20) - 1) >> 20) + " MiB"; }

}  // namespace

int64_t KvPairBufferClass(int64_t bytes) {
    KV_CHECK(bytes > 0) << bytes;
    const int64_t step = std::max<int64_t>(
        kMinClassBytes, int64_t(std::bit_floor(static_cast<uint64_t>(bytes))) / 8);
    return (bytes + step - 1) / step * step;
}

// What the handles share with the pool: the buffers given back, and the bytes held.
struct KvPairBuffers::Shared {
    std::mutex mu;
    std::vector<BackendBuffer> returned;  // guarded by mu
    int64_t held_bytes = 0;               // guarded by mu
};

KvPairBuffers::KvPairBuffers(Backend* backend, int64_t max_bytes)
    : backend_(backend), max_bytes_(max_bytes), shared_(std::make_shared<Shared>()) {
    KV_CHECK(backend_ != nullptr);
    KV_CHECK(max_bytes_ > 0) << max_bytes_;
}

KvPairBuffers::~KvPairBuffers() = default;

void KvPairBuffers::Reclaim() {
    std::vector<BackendBuffer> back;
    {
        std::lock_guard lock(shared_->mu);
        back.swap(shared_->returned);
    }
    for (BackendBuffer& b : back) {
        const auto size = static_cast<int64_t>(b.bytes());
        kept_.emplace(size, std::move(b));
    }
}

int64_t KvPairBuffers::held_bytes() const {
    std::lock_guard lock(shared_->mu);
    return shared_->held_bytes;
}

int64_t KvPairBuffers::allocated_bytes() const {
    int64_t bytes = held_bytes();
    std::lock_guard lock(shared_->mu);
    for (const BackendBuffer& b : shared_->returned) bytes += static_cast<int64_t>(b.bytes());
    for (const auto& [size, b] : kept_) bytes += size;
    return bytes;
}

Result<KvPairBuffers::Held> KvPairBuffers::Take(int64_t bytes) {
    KV_CHECK(bytes > 0) << bytes;
    Reclaim();
    const int64_t size = KvPairBufferClass(bytes);
    BackendBuffer buffer;
    if (auto it = kept_.find(size); it != kept_.end()) {
        buffer = std::move(it->second);
        kept_.erase(it);
    } else if (auto larger = kept_.lower_bound(size);
               allocated_bytes() + size > max_bytes_ && larger != kept_.end()) {
        // At the bound a larger kept buffer serves as it is: nothing freed (header comment).
        buffer = std::move(larger->second);
        kept_.erase(larger);
    } else {
        // Room first: kept buffers of smaller classes go before the bound refuses.
        while (allocated_bytes() + size > max_bytes_ && !kept_.empty()) kept_.erase(kept_.begin());
        if (allocated_bytes() + size > max_bytes_) {
            return Status(StatusCode::kResourceExhausted,
                          "KV pair offer buffers: " + MiB(size) +
                              " more would pass the rank's bound of " + MiB(max_bytes_) + " (" +
                              MiB(held_bytes()) +
                              " held by offers not yet sent; the decode instance is not taking "
                              "them fast enough)");
        }
        KV_ASSIGN_OR_RETURN(buffer, backend_->Allocate(static_cast<size_t>(size)));
    }
    {
        std::lock_guard lock(shared_->mu);
        shared_->held_bytes += static_cast<int64_t>(buffer.bytes());
    }
    std::shared_ptr<Shared> shared = shared_;
    return Held(new BackendBuffer(std::move(buffer)), [shared](BackendBuffer* b) {
        std::lock_guard lock(shared->mu);
        shared->held_bytes -= static_cast<int64_t>(b->bytes());
        shared->returned.push_back(std::move(*b));
        delete b;
    });
}

Result<KvPairStaging> KvPairStaging::Of(Backend* backend) {
    auto* copies = dynamic_cast<PeerCopy*>(backend);
    if (copies == nullptr || !copies->CanCopyFromPeer(*backend)) {
        return InvalidArgument("KV pair path: the " + backend->Describe() +
                               " backend cannot copy within its own memory (PeerCopy), so it "
                               "cannot stage a pair's KV (kv_transfer.path: nccl)");
    }
    return KvPairStaging(backend, copies);
}

Status KvPairStaging::Pack(std::span<const KvCopyRun> runs, const uint8_t* pool_base,
                           uint8_t* buffer) const {
    for (const KvCopyRun& run : runs) {
        KV_RETURN_IF_ERROR(copies_->CopyFromPeer(buffer + run.piece_offset, *backend_,
                                                 pool_base + run.pool_offset,
                                                 static_cast<size_t>(run.bytes)));
    }
    return Status::Ok();
}

Status KvPairStaging::Unpack(std::span<const KvCopyRun> runs, const uint8_t* buffer,
                             uint8_t* pool_base) const {
    for (const KvCopyRun& run : runs) {
        KV_RETURN_IF_ERROR(copies_->CopyFromPeer(pool_base + run.pool_offset, *backend_,
                                                 buffer + run.piece_offset,
                                                 static_cast<size_t>(run.bytes)));
    }
    return Status::Ok();
}

}  // namespace kvshard
