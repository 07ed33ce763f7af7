#include "comm/local_collective.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "common/check.h"

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;

std::string_view OpName(LocalGroup::Op op) {
    switch (op) {
        case LocalGroup::Op::kAllReduceSum:
            return "AllReduceSum";
        case LocalGroup::Op::kAllGather:
            return "AllGather";
        case LocalGroup::Op::kBroadcast:
            return "Broadcast";
        case LocalGroup::Op::kBarrier:
            return "Barrier";
    }
    return "?";
}

std::string Describe(int rank, const LocalGroup::OpDesc& desc) {
    std::string text = "rank " + std::to_string(rank) + " called " + std::string(OpName(desc.op));
    switch (desc.op) {
        case LocalGroup::Op::kAllReduceSum:
        case LocalGroup::Op::kAllGather:
            return text + "(count=" + std::to_string(desc.count) + ")";
        case LocalGroup::Op::kBroadcast:
            return text + "(bytes=" + std::to_string(desc.count) +
                   ", root=" + std::to_string(desc.root) + ")";
        case LocalGroup::Op::kBarrier:
            return text;
    }
    return text;
}

// Adds the ranks' values of elements [begin, end) in rank order and stores the sum in every
// rank's buffer. Works through a small block so that each rank's buffer is streamed once.
void SumInRankOrder(const std::vector<float*>& buffers, int64_t begin, int64_t end) {
    constexpr int64_t kBlock = 1024;
    float sum[kBlock];
    for (int64_t lo = begin; lo < end; lo += kBlock) {
        const int64_t n = std::min(kBlock, end - lo);
        std::memcpy(sum, buffers[0] + lo, static_cast<size_t>(n) * sizeof(float));
        for (size_t r = 1; r < buffers.size(); ++r) {
            const float* src = buffers[r] + lo;
            for (int64_t i = 0; i < n; ++i) sum[i] += src[i];
        }
        for (float* dst : buffers) {
            std::memcpy(dst + lo, sum, static_cast<size_t>(n) * sizeof(float));
        }
    }
}

class LocalCollective final : public Collective {
  public:
    LocalCollective(std::shared_ptr<LocalGroup> group, int rank)
        : group_(std::move(group)), rank_(rank) {}

    int rank() const override { return rank_; }
    int size() const override { return group_->size(); }

    Status AllReduceSum(float* data, int64_t count) override {
        if (count < 0) return InvalidArgument("AllReduceSum: count " + std::to_string(count));
        uint64_t gen = 0;
        KV_RETURN_IF_ERROR(Start({LocalGroup::Op::kAllReduceSum, count, 0, data}, &gen));
        const int n = size();
        std::vector<float*> buffers(static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) {
            buffers[r] = static_cast<float*>(group_->Published(gen, r).data);
        }
        // Rank r owns elements [count*r/n, count*(r+1)/n).
        SumInRankOrder(buffers, count * rank_ / n, count * (rank_ + 1) / n);
        KV_RETURN_IF_ERROR(Finish(gen));
        bytes_all_reduced_.fetch_add(count * static_cast<int64_t>(sizeof(float)),
                                     std::memory_order_relaxed);
        return Status::Ok();
    }

    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override {
        if (count_per_rank < 0) {
            return InvalidArgument("AllGather: count " + std::to_string(count_per_rank));
        }
        uint64_t gen = 0;
        KV_RETURN_IF_ERROR(
            Start({LocalGroup::Op::kAllGather, count_per_rank, 0, const_cast<float*>(send)}, &gen));
        for (int r = 0; r < size(); ++r) {
            const auto* src = static_cast<const float*>(group_->Published(gen, r).data);
            if (count_per_rank > 0) {
                std::memcpy(recv + r * count_per_rank, src,
                            static_cast<size_t>(count_per_rank) * sizeof(float));
            }
        }
        return Finish(gen);
    }

    Status Broadcast(void* data, int64_t bytes, int root) override {
        if (bytes < 0 || root < 0 || root >= size()) {
            return InvalidArgument("Broadcast: bytes " + std::to_string(bytes) + ", root " +
                                   std::to_string(root) + " of " + std::to_string(size()));
        }
        uint64_t gen = 0;
        KV_RETURN_IF_ERROR(Start({LocalGroup::Op::kBroadcast, bytes, root, data}, &gen));
        if (rank_ != root && bytes > 0) {
            std::memcpy(data, group_->Published(gen, root).data, static_cast<size_t>(bytes));
        }
        return Finish(gen);
    }

    Status Barrier() override {
        uint64_t gen = 0;
        const Clock::time_point deadline = Deadline();
        KV_RETURN_IF_ERROR(group_->Arrive(rank_, {LocalGroup::Op::kBarrier, 0, 0, nullptr},
                                          deadline, /*then_touch_peers=*/false, &gen));
        return CheckAgreement(gen);
    }

    void Abort(const std::string& reason) override {
        group_->Abort("rank " + std::to_string(rank_) + " aborted: " + reason);
    }

    int64_t bytes_all_reduced() const override {
        return bytes_all_reduced_.load(std::memory_order_relaxed);
    }

  private:
    Clock::time_point Deadline() const {
        return Clock::now() + std::chrono::milliseconds(group_->timeout_ms());
    }

    // First barrier of an operation: every rank's buffer is published and the ranks agree on
    // the operation. The deadline covers the whole operation.
    Status Start(const LocalGroup::OpDesc& desc, uint64_t* gen) {
        deadline_ = Deadline();
        KV_RETURN_IF_ERROR(group_->Arrive(rank_, desc, deadline_, /*then_touch_peers=*/true, gen));
        const Status agreed = CheckAgreement(*gen);
        if (!agreed.ok()) {
            // Leave through the second barrier, which now fails for every rank, so that no rank
            // returns while another still counts it as touching peers' buffers.
            uint64_t unused = 0;
            (void)group_->Arrive(rank_, desc, deadline_, false, &unused);
            return group_->status();
        }
        return Status::Ok();
    }

    // Second barrier: nobody touches a peer's buffer after it.
    Status Finish(uint64_t gen) {
        uint64_t unused = 0;
        return group_->Arrive(rank_, group_->Published(gen, rank_), deadline_, false, &unused);
    }

    // Every rank compares all descriptors, so every rank sees the same disagreement.
    Status CheckAgreement(uint64_t gen) {
        const LocalGroup::OpDesc& first = group_->Published(gen, 0);
        for (int r = 1; r < size(); ++r) {
            const LocalGroup::OpDesc& other = group_->Published(gen, r);
            if (other.op != first.op || other.count != first.count || other.root != first.root) {
                group_->Abort("ranks disagree on the operation: " + Describe(0, first) + ", " +
                              Describe(r, other));
                return group_->status();
            }
        }
        return Status::Ok();
    }

    const std::shared_ptr<LocalGroup> group_;
    const int rank_;
    Clock::time_point deadline_;
    std::atomic<int64_t> bytes_all_reduced_{0};
};

}  // namespace

std::shared_ptr<LocalGroup> LocalGroup::Create(int size, int64_t timeout_ms) {
    KV_CHECK_GE(size, 1);
    KV_CHECK_GT(timeout_ms, 0);
    return std::shared_ptr<LocalGroup>(new LocalGroup(size, timeout_ms));
}

LocalGroup::LocalGroup(int size, int64_t timeout_ms)
    : size_(size), timeout_ms_(timeout_ms), busy_(static_cast<size_t>(size), false) {
    slots_[0].resize(static_cast<size_t>(size));
    slots_[1].resize(static_cast<size_t>(size));
}

std::unique_ptr<Collective> LocalGroup::Collective(int rank) {
    KV_CHECK(rank >= 0 && rank < size_) << "rank " << rank << " of " << size_;
    return std::make_unique<LocalCollective>(shared_from_this(), rank);
}

void LocalGroup::Abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = kvshard::Aborted("LocalGroup: " + reason);
    cv_.notify_all();
}

Status LocalGroup::status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
}

Status LocalGroup::Arrive(int rank, const OpDesc& desc, Clock::time_point deadline,
                          bool then_touch_peers, uint64_t* generation) {
    std::unique_lock<std::mutex> lock(mu_);
    if (busy_[rank]) {
        busy_[rank] = false;
        if (--num_busy_ == 0) cv_.notify_all();
    }
    if (!failure_.ok()) return FailLocked(lock);

    const uint64_t gen = generation_;
    Slot& slot = slots_[gen & 1][rank];
    slot.desc = desc;
    slot.generation = gen;
    slot.then_touch_peers = then_touch_peers;
    if (++arrived_ == size_) {
        arrived_ = 0;
        ++generation_;
        // Each rank's own flag: ranks that disagree on the operation may disagree on it too.
        for (int r = 0; r < size_; ++r) {
            busy_[r] = slots_[gen & 1][r].then_touch_peers;
            num_busy_ += busy_[r] ? 1 : 0;
        }
        cv_.notify_all();
        *generation = gen;
        return Status::Ok();
    }
    cv_.wait_until(lock, deadline, [&] { return generation_ != gen || !failure_.ok(); });
    if (generation_ != gen) {  // the barrier completed, even if the group failed right after
        *generation = gen;
        return Status::Ok();
    }
    if (failure_.ok()) {
        std::string missing;
        for (int r = 0; r < size_; ++r) {
            if (slots_[gen & 1][r].generation != gen) {
                missing += (missing.empty() ? "" : ", ") + std::to_string(r);
            }
        }
        const auto waited_ms = timeout_ms_;
        failure_ =
            Status(StatusCode::kDeadlineExceeded,
                   "LocalGroup: " + Describe(rank, desc) + " and waited more than " +
                       std::to_string(waited_ms) + " ms for rank(s) " + missing + " (" +
                       std::to_string(arrived_) + " of " + std::to_string(size_) + " arrived)");
        cv_.notify_all();
    }
    return FailLocked(lock);
}

Status LocalGroup::FailLocked(std::unique_lock<std::mutex>& lock) {
    // Ranks still copying to or from this rank's buffer finish without blocking; wait for them.
    cv_.wait(lock, [&] { return num_busy_ == 0; });
    return failure_;
}

const LocalGroup::OpDesc& LocalGroup::Published(uint64_t generation, int rank) const {
    return slots_[generation & 1][rank].desc;
}

}  // namespace kvshard
