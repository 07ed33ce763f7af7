// Which way the KV of a handoff travels between a prefill pool and a decode pool
// (KvHandoffPath, config/engine_config.h), chosen once at serve's start from kv_transfer.path and
// where the two pools' ranks are. A pure function of the facts passed in (the device query is one
// of them), so every case is tested on the CPU (tests/worker/kv_handoff_path_test.cc).
//
//   kv_transfer.path  | embedded (one process)                          | worker processes
//   ------------------+-------------------------------------------------+------------------
//   auto              | peer where both pools are cuda and every pair    | host-staged
//                     | of a sending and a receiving GPU is one device   |
//                     | or has peer access; else host-staged              |
//   host-staged       | host-staged                                     | host-staged
//   peer              | peer; refused (naming the setting) on a backend  | refused
//                     | without peer copies or GPUs without peer access  |
//   nccl              | refused: one process hands over by peer copies   | see below
//
// nccl with worker processes is refused, each with its own line naming kv_transfer.path, where it
// cannot work: the CPU backend (no device memory to send from), a build without NCCL, workers
// not all launched on this node (launcher external or mpirun: the GPU ordinals may name devices
// of other machines, and NVLink p2p is a one-node path), a GPU that holds both a prefill and a
// decode rank (NCCL refuses two ranks of one communicator on one GPU), and GPUs with the socket
// test knob (it sends host memory; the GPU ranks' pair buffers are device memory). It is accepted
// for GPU worker processes launched here on distinct GPUs with NCCL built: serve plans the pairs
// with NCCL unique ids and each rank stages its pairs' KV in device memory and runs them over
// NCCL channels on its GPU (worker/kv_handoff_pairs.h) — wired, never run on a GPU in kvshard's
// tests (serve logs so). It is also accepted for CPU worker processes launched here with the
// TEST knob socket_pair_link (KVSHARD_KV_PAIR_LINK=socket): the same wiring over a TCP pair link
// (comm/socket_kv_pair_channel.h), so the pair path runs end to end without GPUs. auto never
// picks nccl.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "config/engine_config.h"
#include "kernels/backend.h"

namespace kvshard {

struct KvHandoffPathFacts {
    std::optional<KvHandoffPath> requested;   // kv_transfer.path; empty: auto
    BackendKind backend = BackendKind::kCpu;  // both pools' (one config gives one backend)
    bool embedded = true;                     // every rank a thread of this process
    // The backend copies between two of its instances of this process without the host
    // (implements PeerCopy: cuda, and the CPU backend's memcpy).
    bool backend_has_peer_copies = false;
    // The GPUs of the sending pools' ranks and of the receiving pools' ranks (cuda only).
    std::vector<int> src_gpus;
    std::vector<int> dst_gpus;
    // Whether GPU `to` can read GPU `from`'s memory (DevicesCanAccessPeer, common/device.h).
    std::function<bool(int to, int from)> can_access_peer;
    // Worker processes: every one is launched by this coordinator on this machine (the direct
    // launcher), so src_gpus and dst_gpus are ordinals of one node's GPUs.
    bool one_node = false;
    // This kvshard has NCCL (KVSHARD_WITH_CUDA).
    bool nccl_built = false;
    // Tests only (KVSHARD_KV_PAIR_LINK=socket): the pairs run over TCP sockets between CPU
    // worker processes of this machine instead of NCCL.
    bool socket_pair_link = false;
};

// The path, or InvalidArgument naming kv_transfer.path and why that path cannot serve here.
Result<KvHandoffPath> ChooseKvHandoffPath(const KvHandoffPathFacts& facts);

// The startup log's line: "KV handoff between pools: <name> (<how>)".
std::string KvHandoffPathLine(KvHandoffPath path);

}  // namespace kvshard
