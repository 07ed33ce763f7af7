// How the ranks of one tensor-parallel instance reach each other, decided from what every rank
// (and the serving config's device plan) is told alike: the one rule that worker/rank_collective.h
// (the ranks), config/device_plan.h (whether serve may capture decode graphs at tp > 1) and
// cli/process_instance.h (whether the coordinator hands out an NCCL unique id) share.
//
//   kHost    the ranks' buffers are host memory (the CPU backend): the host collective (Local,
//            Gloo, Mpi) as it is.
//   kNccl    on GPUs, every rank of the instance on a GPU of its own, NCCL available (a build
//            with CUDA, and for worker processes a unique id from the coordinator): NCCL queued
//            on each backend's stream, which a CUDA graph capture records.
//   kStaged  anything else on GPUs (ranks sharing a GPU, where NCCL refuses to run; no NCCL;
//            asked for): the host collective behind host copies, which waits on the host and so
//            cannot be captured.
#pragma once

#include <string_view>
#include <vector>

namespace kvshard {

enum class CollectivePath { kHost, kStaged, kNccl };
std::string_view CollectivePathName(CollectivePath path);

struct CollectivePathFacts {
    // The ranks' buffers are device memory (the cuda backend).
    bool on_gpus = false;
    int tp = 1;
    // The GPU of each rank (empty or fewer than tp: not known, taken as shared).
    std::vector<int> devices;
    // NCCL can connect the ranks: a build with CUDA (and so NCCL), and for worker processes a
    // unique id the ranks share.
    bool nccl_available = false;
    // Stage even where the buffers are host memory or NCCL could run: how the staged path is
    // exercised on the CPU, and a way around a broken NCCL on a device.
    bool force_staged = false;
};

CollectivePath DecideCollectivePath(const CollectivePathFacts& facts);

// Whether each of `tp` ranks has a GPU of its own in `devices` (tp entries, none repeated):
// NCCL refuses two ranks of one communicator on one GPU. False at tp 1 (no collective).
bool RanksHaveOwnGpus(const std::vector<int>& devices, int tp);

}  // namespace kvshard
