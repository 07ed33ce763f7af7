// InMemoryKvPairLink (comm/kv_pair_channel.h): the fake pair the protocol's tests run on. It
// keeps NCCL's rules that matter to the protocol: sends match receives in issue order, a send
// waits for its receive, an abort is local (the peer's matching call waits until its deadline),
// and a failed endpoint stays failed.
#include "comm/kv_pair_channel.h"

#include <cstring>
#include <string>

namespace kvshard {

struct InMemoryKvPairLink::Shared {
    struct PendingSend {
        const void* src = nullptr;
        size_t bytes = 0;
        bool done = false;
        Status result;
    };

    std::mutex mu;
    std::condition_variable cv;
    Status failed[2];                                // guarded by mu
    std::deque<std::shared_ptr<PendingSend>> sends;  // guarded by mu; issue order
    int64_t completed = 0;                           // guarded by mu

    // REQUIRES: mu held.
    void FailLocked(int rank, Status why) {
        if (failed[rank].ok()) failed[rank] = std::move(why);
        if (rank == 0) {
            for (auto& send : sends) {
                send->done = true;
                send->result = failed[0];
            }
            sends.clear();
        }
        cv.notify_all();
    }
};

class InMemoryKvPairLink::Endpoint final : public KvPairChannel {
  public:
    Endpoint(std::shared_ptr<Shared> shared, int rank) : shared_(std::move(shared)), rank_(rank) {}

    Status Send(const void* src, size_t bytes, Clock::time_point deadline) override {
        if (rank_ != 0) return InvalidArgument("in-memory KV pair: Send on rank 1");
        std::unique_lock lock(shared_->mu);
        if (!shared_->failed[0].ok()) return shared_->failed[0];
        auto send = std::make_shared<Shared::PendingSend>();
        send->src = src;
        send->bytes = bytes;
        shared_->sends.push_back(send);
        shared_->cv.notify_all();
        if (!shared_->cv.wait_until(lock, deadline, [&] { return send->done; })) {
            shared_->FailLocked(
                0, Status(StatusCode::kDeadlineExceeded, "in-memory KV pair rank 0 send of " +
                                                             std::to_string(bytes) +
                                                             " bytes: not done by the deadline"));
        }
        return send->result;
    }

    Status Recv(void* dst, size_t bytes, Clock::time_point deadline) override {
        if (rank_ != 1) return InvalidArgument("in-memory KV pair: Recv on rank 0");
        std::unique_lock lock(shared_->mu);
        const bool woke = shared_->cv.wait_until(
            lock, deadline, [&] { return !shared_->failed[1].ok() || !shared_->sends.empty(); });
        if (!shared_->failed[1].ok()) return shared_->failed[1];
        if (!woke) {
            shared_->FailLocked(
                1, Status(StatusCode::kDeadlineExceeded, "in-memory KV pair rank 1 receive of " +
                                                             std::to_string(bytes) +
                                                             " bytes: not done by the deadline"));
            return shared_->failed[1];
        }
        std::shared_ptr<Shared::PendingSend> send = shared_->sends.front();
        shared_->sends.pop_front();
        send->done = true;
        if (send->bytes != bytes) {
            // NCCL leaves a size mismatch undefined; the fake fails both sides so tests see it.
            const Status mismatch =
                Internal("in-memory KV pair: send of " + std::to_string(send->bytes) +
                         " bytes met receive of " + std::to_string(bytes));
            send->result = mismatch;
            shared_->FailLocked(0, mismatch);
            shared_->FailLocked(1, mismatch);
            return mismatch;
        }
        if (bytes > 0) std::memcpy(dst, send->src, bytes);
        send->result = Status::Ok();
        ++shared_->completed;
        shared_->cv.notify_all();
        return Status::Ok();
    }

    void Abort(const Status& why) override {
        std::lock_guard lock(shared_->mu);
        shared_->FailLocked(rank_, Aborted("in-memory KV pair rank " + std::to_string(rank_) +
                                           " aborted: " + why.ToString()));
    }

    int rank() const override { return rank_; }

  private:
    std::shared_ptr<Shared> shared_;
    const int rank_;
};

InMemoryKvPairLink::InMemoryKvPairLink() : shared_(std::make_shared<Shared>()) {
    for (int rank = 0; rank < 2; ++rank)
        endpoints_[rank] = std::make_unique<Endpoint>(shared_, rank);
}

InMemoryKvPairLink::~InMemoryKvPairLink() = default;

KvPairChannel* InMemoryKvPairLink::endpoint(int rank) { return endpoints_[rank].get(); }

namespace {

class BorrowedKvPairChannel final : public KvPairChannel {
  public:
    explicit BorrowedKvPairChannel(KvPairChannel* endpoint) : endpoint_(endpoint) {}
    Status Send(const void* src, size_t bytes, Clock::time_point deadline) override {
        return endpoint_->Send(src, bytes, deadline);
    }
    Status Recv(void* dst, size_t bytes, Clock::time_point deadline) override {
        return endpoint_->Recv(dst, bytes, deadline);
    }
    void Abort(const Status& why) override { endpoint_->Abort(why); }
    int rank() const override { return endpoint_->rank(); }

  private:
    KvPairChannel* endpoint_;
};

}  // namespace

std::unique_ptr<KvPairChannel> InMemoryKvPairLink::Borrow(int rank) {
    return std::make_unique<BorrowedKvPairChannel>(endpoint(rank));
}

void InMemoryKvPairLink::Kill(int rank) {
    std::lock_guard lock(shared_->mu);
    shared_->FailLocked(rank,
                        Unavailable("in-memory KV pair rank " + std::to_string(rank) + " died"));
    shared_->FailLocked(
        1 - rank, Unavailable("in-memory KV pair: peer rank " + std::to_string(rank) + " died"));
}

int64_t InMemoryKvPairLink::completed() const {
    std::lock_guard lock(shared_->mu);
    return shared_->completed;
}

}  // namespace kvshard
