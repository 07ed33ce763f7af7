// NcclComm (comm/nccl_comm.h): the polling and first-failure abort of a non-blocking NCCL
// communicator.
#include "comm/nccl_comm.h"

#include <cstring>
#include <thread>

namespace kvshard::internal {

Status NcclStatus(ncclResult_t result, std::string_view call) {
    if (result == ncclSuccess) return Status::Ok();
    return Status(StatusCode::kUnavailable, std::string(call) + " failed: NCCL error " +
                                                std::to_string(static_cast<int>(result)) + ": " +
                                                ncclGetErrorString(result));
}

NcclComm::NcclComm(ncclComm_t comm, DeadlineMessage deadline_message, WaitCheck check)
    : comm_(comm), deadline_message_(std::move(deadline_message)), check_(std::move(check)) {}

NcclComm::~NcclComm() { Abort(); }

Status NcclComm::StartInit(int nranks, int rank, const std::string& unique_id) {
    ncclUniqueId id;
    std::memcpy(id.internal, unique_id.data(), NCCL_UNIQUE_ID_BYTES);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return CheckIssued(ncclCommInitRankConfig(&comm_, nranks, id, rank, &config),
                       "ncclCommInitRankConfig");
}

Status NcclComm::Fail(Status status) {
    if (status.ok()) return status;
    if (failure_.ok()) {
        failure_ = status;
        Abort();
    }
    return status;
}

Status NcclComm::CheckIssued(ncclResult_t issued, std::string_view what) {
    if (issued == ncclSuccess || issued == ncclInProgress) return Status::Ok();
    return Fail(NcclStatus(issued, what));
}

Status NcclComm::PollComm(std::string_view what, Clock::time_point deadline) {
    for (int64_t polls = 0;; ++polls) {
        ncclResult_t state = ncclSuccess;
        KV_RETURN_IF_ERROR(
            Fail(NcclStatus(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError")));
        if (state == ncclSuccess) return Status::Ok();
        if (state != ncclInProgress) return Fail(NcclStatus(state, what));
        KV_RETURN_IF_ERROR(CheckWaiting(what, deadline, polls));
    }
}

Status NcclComm::WaitStream(std::string_view what, StreamHandle stream,
                            Clock::time_point deadline) {
    KV_RETURN_IF_ERROR(PollComm(what, deadline));
    for (int64_t polls = 0;; ++polls) {
        const Result<bool> done = StreamIsDone(stream);
        if (!done.ok()) return Fail(done.status());
        if (*done) return Status::Ok();
        // A peer's failure shows up here, not on the stream.
        ncclResult_t state = ncclSuccess;
        KV_RETURN_IF_ERROR(
            Fail(NcclStatus(ncclCommGetAsyncError(comm_, &state), "ncclCommGetAsyncError")));
        if (state != ncclSuccess && state != ncclInProgress) {
            return Fail(NcclStatus(state, what));
        }
        KV_RETURN_IF_ERROR(CheckWaiting(what, deadline, polls));
    }
}

Status NcclComm::Finalize(Clock::time_point deadline) {
    if (comm_ == nullptr || !failure_.ok()) return Status::Ok();
    // Finalize flushes outstanding work without blocking; abort if it does not end.
    Status done = NcclStatus(ncclCommFinalize(comm_), "ncclCommFinalize");
    if (done.ok()) done = PollComm("ncclCommFinalize", deadline);
    if (done.ok()) {
        ncclCommDestroy(comm_);
        comm_ = nullptr;
        return done;
    }
    return Fail(done);  // aborts the communicator
}

void NcclComm::Abort() {
    if (comm_ != nullptr) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
    }
}

Status NcclComm::CheckWaiting(std::string_view what, Clock::time_point deadline, int64_t polls) {
    if (check_) KV_RETURN_IF_ERROR(Fail(check_(what)));
    if (Clock::now() > deadline) {
        return Fail(Status(StatusCode::kDeadlineExceeded, deadline_message_(what)));
    }
    if (polls > 1000) std::this_thread::yield();
    return Status::Ok();
}

}  // namespace kvshard::internal
