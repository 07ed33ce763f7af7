#include "comm/local_collective.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <thread>

#include "common/check.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kvshard {
namespace {

using Clock = std::chrono::steady_clock;

// How long a waiting rank spins before it yields the CPU, and yields before it sleeps. Spinning
// meets a peer on another core in a fraction of a microsecond; past a few microseconds the peer
// is most likely descheduled (more ranks than cores), and the waiter's core is better given to
// it. A sleeping rank costs a wake-up (tens of microseconds), so it sleeps only once yielding
// has not helped either.
constexpr auto kSpinFor = std::chrono::microseconds(4);
constexpr auto kYieldUntil = std::chrono::microseconds(50);

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
}

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
        const LocalGroup::OpDesc desc{LocalGroup::Op::kAllReduceSum, count, 0, data};
        const int n = size();
        uint64_t gen = 0;
        if (count <= LocalGroup::kMaxStagedFloats) {
            // One barrier: every rank adds the staged values itself, in rank order.
            KV_RETURN_IF_ERROR(Staged(desc, data, count * sizeof(float), &gen));
            if (count > 0) {
                const auto* first = static_cast<const float*>(group_->Published(gen, 0).data);
                std::memcpy(data, first, static_cast<size_t>(count) * sizeof(float));
                for (int r = 1; r < n; ++r) {
                    const auto* src = static_cast<const float*>(group_->Published(gen, r).data);
                    for (int64_t i = 0; i < count; ++i) data[i] += src[i];
                }
            }
        } else {
            KV_RETURN_IF_ERROR(Start(desc, &gen));
            std::vector<float*> buffers(static_cast<size_t>(n));
            for (int r = 0; r < n; ++r) {
                buffers[r] = static_cast<float*>(group_->Published(gen, r).data);
            }
            // Rank r owns elements [count*r/n, count*(r+1)/n).
            SumInRankOrder(buffers, count * rank_ / n, count * (rank_ + 1) / n);
            KV_RETURN_IF_ERROR(Finish(gen));
        }
        bytes_all_reduced_.fetch_add(count * static_cast<int64_t>(sizeof(float)),
                                     std::memory_order_relaxed);
        return Status::Ok();
    }

    Status AllGather(const float* send, int64_t count_per_rank, float* recv) override {
        if (count_per_rank < 0) {
            return InvalidArgument("AllGather: count " + std::to_string(count_per_rank));
        }
        const LocalGroup::OpDesc desc{LocalGroup::Op::kAllGather, count_per_rank, 0,
                                      const_cast<float*>(send)};
        const bool staged = count_per_rank <= LocalGroup::kMaxStagedFloats;
        uint64_t gen = 0;
        KV_RETURN_IF_ERROR(staged ? Staged(desc, send, count_per_rank * sizeof(float), &gen)
                                  : Start(desc, &gen));
        for (int r = 0; r < size() && count_per_rank > 0; ++r) {
            const auto* src = static_cast<const float*>(group_->Published(gen, r).data);
            std::memcpy(recv + r * count_per_rank, src,
                        static_cast<size_t>(count_per_rank) * sizeof(float));
        }
        return staged ? Status::Ok() : Finish(gen);
    }

    Status Broadcast(void* data, int64_t bytes, int root) override {
        if (bytes < 0 || root < 0 || root >= size()) {
            return InvalidArgument("Broadcast: bytes " + std::to_string(bytes) + ", root " +
                                   std::to_string(root) + " of " + std::to_string(size()));
        }
        const LocalGroup::OpDesc desc{LocalGroup::Op::kBroadcast, bytes, root, data};
        const bool staged = bytes <= LocalGroup::kMaxStagedFloats * int64_t{sizeof(float)};
        uint64_t gen = 0;
        KV_RETURN_IF_ERROR(staged ? Staged(desc, data, rank_ == root ? bytes : 0, &gen)
                                  : Start(desc, &gen));
        if (rank_ != root && bytes > 0) {
            std::memcpy(data, group_->Published(gen, root).data, static_cast<size_t>(bytes));
        }
        return staged ? Status::Ok() : Finish(gen);
    }

    Status Barrier() override {
        uint64_t gen = 0;
        KV_RETURN_IF_ERROR(group_->Arrive(rank_, {LocalGroup::Op::kBarrier, 0, 0, nullptr},
                                          Deadline(), /*then_touch_peers=*/false, &gen));
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

    // The only barrier of a small operation: copies `bytes` of `src` into this rank's staging
    // buffer and publishes the staging buffer in place of the caller's. Nobody touches the
    // caller's buffer, and a rank overwrites its staging only after the next barrier (which
    // every rank has left the reading of this one for), so one barrier suffices.
    Status Staged(LocalGroup::OpDesc desc, const void* src, size_t bytes, uint64_t* gen) {
        float* staging = group_->staging(group_->next_generation(rank_), rank_);
        if (bytes > 0) std::memcpy(staging, src, bytes);
        desc.data = staging;
        KV_RETURN_IF_ERROR(
            group_->Arrive(rank_, desc, Deadline(), /*then_touch_peers=*/false, gen));
        return CheckAgreement(*gen);
    }

    // First barrier of a large operation: every rank's buffer is published and the ranks agree
    // on the operation. The deadline covers the whole operation.
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

    // Second barrier of a large operation: nobody touches a peer's buffer after it.
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
    : size_(size), timeout_ms_(timeout_ms), ranks_(static_cast<size_t>(size)) {
    for (int parity = 0; parity < 2; ++parity) {
        slots_[parity] = std::vector<Slot>(static_cast<size_t>(size));
        staging_[parity].assign(static_cast<size_t>(size),
                                std::vector<float>(static_cast<size_t>(kMaxStagedFloats)));
    }
}

std::unique_ptr<Collective> LocalGroup::Collective(int rank) {
    KV_CHECK(rank >= 0 && rank < size_) << "rank " << rank << " of " << size_;
    return std::make_unique<LocalCollective>(shared_from_this(), rank);
}

void LocalGroup::Abort(const std::string& reason) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        if ((state_.load() & kBroken) == 0) {
            failure_ = kvshard::Aborted("LocalGroup: " + reason);
            state_.fetch_or(kBroken);
        }
    }
    WakeSleepers();
}

Status LocalGroup::status() const {
    if ((state_.load() & kBroken) == 0) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
}

Status LocalGroup::Arrive(int rank, const OpDesc& desc, Clock::time_point deadline,
                          bool then_touch_peers, uint64_t* generation) {
    RankState& me = ranks_[rank];
    // Set before arriving, so that a rank that sees this barrier complete and then fails sees
    // it too; cleared on the failure path, so that waiting for it never blocks for long.
    me.touching_peers.store(then_touch_peers);
    const uint64_t gen = me.next_generation;
    Slot& slot = slots_[gen & 1][rank];
    slot.desc = desc;
    slot.generation.store(gen, std::memory_order_relaxed);  // published by the increment below

    // Count this arrival unless the group is broken: a broken group's count never completes a
    // barrier, so a rank either passed a barrier with every other rank or failed.
    uint64_t state = state_.load(std::memory_order_relaxed);
    do {
        if ((state & kBroken) != 0) return Fail(rank);
    } while (!state_.compare_exchange_weak(state, state + 1));
    KV_CHECK_EQ(state / size_, gen) << "rank " << rank << " is out of step with its group";

    const uint64_t target = (gen + 1) * static_cast<uint64_t>(size_);
    auto passed = [&] { return (state_.load() & ~kBroken) >= target; };
    if (state + 1 == target) {
        WakeSleepers();
    } else if (!WaitUntil([&] { return (state_.load() & kBroken) != 0 || passed(); }, deadline)) {
        const Status timeout(StatusCode::kDeadlineExceeded,
                             "LocalGroup: " + Describe(rank, desc) + " and waited more than " +
                                 std::to_string(timeout_ms_) + " ms for rank(s) " +
                                 MissingRanks(gen));
        BreakUnlessCompleted(target, timeout);
    }
    // A barrier that completed counts even if the group broke right after.
    if (!passed()) return Fail(rank);
    me.next_generation = gen + 1;
    *generation = gen;
    return Status::Ok();
}

bool LocalGroup::BreakUnlessCompleted(uint64_t target, const Status& failure) {
    bool completed = false;
    {
        std::lock_guard<std::mutex> lock(mu_);
        uint64_t state = state_.load();
        while (true) {
            if ((state & ~kBroken) >= target) {
                completed = true;
                break;
            }
            if ((state & kBroken) != 0) break;
            if (state_.compare_exchange_weak(state, state | kBroken)) {
                const uint64_t arrived = (state & ~kBroken) % static_cast<uint64_t>(size_);
                failure_ =
                    Status(failure.code(), failure.message() + " (" + std::to_string(arrived) +
                                               " of " + std::to_string(size_) + " arrived)");
                break;
            }
        }
    }
    if (!completed) WakeSleepers();
    return completed;
}

std::string LocalGroup::MissingRanks(uint64_t generation) const {
    std::string missing;
    for (int r = 0; r < size_; ++r) {
        if (slots_[generation & 1][r].generation.load() != generation) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
    }
    return missing;
}

Status LocalGroup::Fail(int rank) {
    ranks_[rank].touching_peers.store(false);
    WakeSleepers();
    // Ranks still copying to or from this rank's buffer finish without blocking; wait for them.
    WaitUntil(
        [&] {
            for (const RankState& other : ranks_) {
                if (other.touching_peers.load()) return false;
            }
            return true;
        },
        Clock::time_point::max());
    std::lock_guard<std::mutex> lock(mu_);
    return failure_;
}

template <typename Done>
bool LocalGroup::WaitUntil(const Done& done, Clock::time_point deadline) {
    if (done()) return true;
    const Clock::time_point start = Clock::now();
    for (int i = 1;; ++i) {
        CpuRelax();
        if (done()) return true;
        if (i % 16 == 0 && Clock::now() - start >= kSpinFor) break;
    }
    while (true) {
        std::this_thread::yield();
        if (done()) return true;
        const Clock::time_point now = Clock::now();
        if (now >= deadline) return false;
        if (now - start >= kYieldUntil) break;
    }
    // Sleep. The waker changes the state and then looks for sleepers; a sleeper counts itself
    // and then looks at the state (both sequentially consistent), so one of them sees the
    // other, and the waker's notify happens under mu_ after this sleeper checked or began to
    // wait.
    std::unique_lock<std::mutex> lock(mu_);
    num_sleepers_.fetch_add(1);
    bool ok;
    if (deadline == Clock::time_point::max()) {
        cv_.wait(lock, done);
        ok = true;
    } else {
        ok = cv_.wait_until(lock, deadline, done);
    }
    num_sleepers_.fetch_sub(1);
    return ok;
}

void LocalGroup::WakeSleepers() {
    if (num_sleepers_.load() == 0) return;
    { std::lock_guard<std::mutex> lock(mu_); }
    cv_.notify_all();
}

const LocalGroup::OpDesc& LocalGroup::Published(uint64_t generation, int rank) const {
    return slots_[generation & 1][rank].desc;
}

}  // namespace kvshard
