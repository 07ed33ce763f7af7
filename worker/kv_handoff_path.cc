#include "worker/kv_handoff_path.h"

namespace kvshard {
namespace {

// The first (receiving GPU, sending GPU) pair without peer access, if any.
std::optional<std::pair<int, int>> PairWithoutPeerAccess(const KvHandoffPathFacts& f) {
    for (int to : f.dst_gpus) {
        for (int from : f.src_gpus) {
            if (to == from) continue;
            if (!f.can_access_peer || !f.can_access_peer(to, from)) return std::pair{to, from};
        }
    }
    return std::nullopt;
}

// kv_transfer.path: nccl where NCCL point-to-point cannot work: the line says why for this
// placement; Ok where it can (GPU worker processes launched here on distinct GPUs, NCCL built).
Status NcclRefusal(const KvHandoffPathFacts& f) {
    const std::string key = "kv_transfer.path: nccl: ";
    if (f.backend != BackendKind::kCuda) {
        return InvalidArgument(key + "the " + std::string(BackendKindName(f.backend)) +
                               " backend has no device memory to send from; NCCL point-to-point "
                               "needs GPU worker processes (use auto or host-staged)");
    }
    if (f.embedded) {
        return InvalidArgument(key +
                               "both pools are in this process (workers.mode: embedded): GPUs "
                               "of one process hand KV over by peer copies (use auto or peer)");
    }
    if (!f.nccl_built) {
        return InvalidArgument(key + "this kvshard was built without CUDA, so without NCCL");
    }
    if (!f.one_node) {
        return InvalidArgument(key +
                               "the worker processes are not all launched on this node "
                               "(workers.launcher external or mpirun); NCCL point-to-point over "
                               "NVLink is a one-node path: use host-staged between nodes");
    }
    for (int to : f.dst_gpus) {
        for (int from : f.src_gpus) {
            if (to == from) {
                return InvalidArgument(
                    key + "GPU " + std::to_string(to) +
                    " holds a prefill rank and a decode rank; NCCL cannot put both ranks of a "
                    "communicator on one GPU (use host-staged)");
            }
        }
    }
    if (f.socket_pair_link) {
        return InvalidArgument(key +
                               "KVSHARD_KV_PAIR_LINK=socket is the CPU workers' test link: it "
                               "sends host memory and GPU ranks stage a pair's KV in device "
                               "memory; unset it to run the pairs over NCCL");
    }
    return Status::Ok();
}

}  // namespace

Result<KvHandoffPath> ChooseKvHandoffPath(const KvHandoffPathFacts& f) {
    const bool cuda = f.backend == BackendKind::kCuda;
    if (!f.requested.has_value()) {
        if (f.embedded && cuda && f.backend_has_peer_copies && !PairWithoutPeerAccess(f))
            return KvHandoffPath::kPeerCopy;
        return KvHandoffPath::kHostStaged;
    }
    switch (*f.requested) {
        case KvHandoffPath::kHostStaged:
            return KvHandoffPath::kHostStaged;
        case KvHandoffPath::kPeerCopy: {
            if (!f.embedded) {
                return InvalidArgument(
                    "kv_transfer.path: peer copies need both pools in this process "
                    "(workers.mode: embedded); worker processes hand KV over host-staged");
            }
            if (!f.backend_has_peer_copies) {
                return InvalidArgument("kv_transfer.path: peer: the " +
                                       std::string(BackendKindName(f.backend)) +
                                       " backend has no peer copies");
            }
            if (cuda) {
                if (std::optional<std::pair<int, int>> p = PairWithoutPeerAccess(f)) {
                    return InvalidArgument(
                        "kv_transfer.path: peer: GPU " + std::to_string(p->first) +
                        " cannot access GPU " + std::to_string(p->second) +
                        "'s memory (no NVLink or PCIe peer access); use host-staged or auto");
                }
            }
            return KvHandoffPath::kPeerCopy;
        }
        case KvHandoffPath::kNccl:
            // The test link: the whole pair path between CPU worker processes of this machine.
            if (f.socket_pair_link && !cuda && !f.embedded && f.one_node)
                return KvHandoffPath::kNccl;
            KV_RETURN_IF_ERROR(NcclRefusal(f));
            return KvHandoffPath::kNccl;
    }
    return KvHandoffPath::kHostStaged;
}

std::string KvHandoffPathLine(KvHandoffPath path) {
    std::string how;
    switch (path) {
        case KvHandoffPath::kHostStaged:
            how =
                "the sending pool's blocks copied to host memory, sent over the instances' KV "
                "transport, copied into the receiving pool's blocks";
            break;
        case KvHandoffPath::kPeerCopy:
            how =
                "the receiving rank copies the sending pool's blocks pool to pool (GPUs: "
                "cudaMemcpyPeerAsync), no host buffer";
            break;
        case KvHandoffPath::kNccl:
            how =
                "one pair channel per prefill and decode rank that exchange KV heads, each "
                "rank's heads packed and sent by the prefill rank once the decode rank is ready";
            break;
    }
    return "KV handoff between pools: " + std::string(KvHandoffPathName(path)) + " (" + how + ")";
}

}  // namespace kvshard
