// NcclComm: what comm/nccl_collective.cc and comm/nccl_kv_transport.cc share about driving a
// non-blocking NCCL communicator (ncclConfig_t::blocking = 0). Internal to comm/ and built only
// with KVSHARD_WITH_CUDA.
//
// It owns an ncclComm_t, remembers the first failure and aborts the communicator on it
// (ncclCommAbort releases GPU work stuck waiting for a lost peer), and polls
// ncclCommGetAsyncError and cudaStreamQuery until the work is done, the deadline passes or the
// owner's extra check fails. One thread at a time (NCCL communicators are not thread-safe).
#pragma once

#include <nccl.h>

#include <chrono>
#include <functional>
#include <string>
#include <string_view>

#include "common/device.h"
#include "common/status.h"

namespace kvshard::internal {

// Unavailable with the call, the result's number and text; Ok for ncclSuccess.
Status NcclStatus(ncclResult_t result, std::string_view call);

class NcclComm {
  public:
    using Clock = std::chrono::steady_clock;
    // The message of the DeadlineExceeded status when `what` is not done by the deadline.
    using DeadlineMessage = std::function<std::string(std::string_view what)>;
    // Run on every poll before the deadline check; a failure ends the wait and aborts.
    using WaitCheck = std::function<Status(std::string_view what)>;

    // Takes over `comm` (may be nullptr, for StartInit).
    NcclComm(ncclComm_t comm, DeadlineMessage deadline_message, WaitCheck check = {});
    // Aborts a communicator still held.
    ~NcclComm();
    NcclComm(const NcclComm&) = delete;
    NcclComm& operator=(const NcclComm&) = delete;

    ncclComm_t get() const { return comm_; }
    // The first failure (Ok while none).
    const Status& failure() const { return failure_; }

    // Starts a non-blocking ncclCommInitRankConfig (the comm must be empty); PollComm waits for
    // it. `unique_id` holds NCCL_UNIQUE_ID_BYTES bytes.
    Status StartInit(int nranks, int rank, const std::string& unique_id);

    // The first failure aborts the communicator; every later call returns it.
    Status Fail(Status status);

    // Fails unless `issued` (what an NCCL call returned) is ncclSuccess or ncclInProgress.
    Status CheckIssued(ncclResult_t issued, std::string_view what);

    // Waits until the communicator's queued NCCL call has been issued (ncclInProgress ends).
    Status PollComm(std::string_view what, Clock::time_point deadline);

    // PollComm, then waits until `stream` has run the work, watching the communicator for a
    // peer's failure (it shows up there, not on the stream).
    Status WaitStream(std::string_view what, StreamHandle stream, Clock::time_point deadline);

    // Finalizes and destroys the communicator when nothing failed; when finalizing fails or does
    // not end by the deadline, aborts it and returns why. Ok when there is nothing to do.
    Status Finalize(Clock::time_point deadline);

    // ncclCommAbort on a communicator still held.
    void Abort();

  private:
    Status CheckWaiting(std::string_view what, Clock::time_point deadline, int64_t polls);

    ncclComm_t comm_;
    DeadlineMessage deadline_message_;
    WaitCheck check_;
    Status failure_;
};

}  // namespace kvshard::internal
