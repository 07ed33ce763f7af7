// The choice of kv_transfer.path: nccl (worker/kv_handoff_path.h) by placement: refused, naming
// the setting, for each placement where NCCL point-to-point cannot work (CPU backend, pools of one
// process, no CUDA in the build, workers not all on this node, a GPU holding both sides, the
// socket test knob on GPUs), and accepted where it can (GPU worker processes on distinct GPUs of
// this node); auto keeps the paths it picked before on every placement.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "worker/kv_handoff_path.h"

namespace kvshard {
namespace {

struct NcclCase {
    const char* name;
    std::optional<KvHandoffPath> requested;
    BackendKind backend;
    bool embedded, one_node, nccl_built;
    std::vector<int> src, dst;
    std::optional<KvHandoffPath> want;  // empty: refused
    const char* message = "";
    bool socket_pair_link = false;
};

TEST(KvHandoffPathChoice, NcclByPlacement) {
    const auto cpu = BackendKind::kCpu, cuda = BackendKind::kCuda;
    const auto host = KvHandoffPath::kHostStaged, peer = KvHandoffPath::kPeerCopy,
               nccl = KvHandoffPath::kNccl;
    const auto none = std::nullopt;
    const NcclCase cases[] = {
        // auto never picks nccl: the paths it picked before, for every placement.
        {"auto gpu processes one node", none, cuda, false, true, true, {0}, {1}, host},
        {"auto gpu processes other nodes", none, cuda, false, false, true, {0}, {1}, host},
        {"auto gpu processes shared gpu", none, cuda, false, true, true, {0}, {0}, host},
        {"auto cpu processes", none, cpu, false, true, false, {}, {}, host},
        {"auto gpus of one process", none, cuda, true, true, true, {0}, {1}, peer},
        // nccl where it cannot work, each with its reason.
        {"nccl cpu backend",
         nccl,
         cpu,
         false,
         true,
         true,
         {},
         {},
         none,
         "the cpu backend has no device memory"},
        {"nccl embedded", nccl, cuda, true, true, true, {0}, {1}, none, "peer copies"},
        {"nccl not built", nccl, cuda, false, true, false, {0}, {1}, none, "built without CUDA"},
        {"nccl other nodes",
         nccl,
         cuda,
         false,
         false,
         true,
         {0},
         {1},
         none,
         "not all launched on this node"},
        {"nccl shared gpu",
         nccl,
         cuda,
         false,
         true,
         true,
         {0, 1},
         {1, 2},
         none,
         "GPU 1 holds a prefill rank and a decode rank"},
        // and where it can: accepted.
        {"nccl distinct gpus of one node", nccl, cuda, false, true, true, {0, 1}, {2, 3}, nccl},
        // the socket test knob is for CPU workers: refused on GPUs, naming it.
        {"nccl gpus with the socket knob",
         nccl,
         cuda,
         false,
         true,
         true,
         {0},
         {1},
         none,
         "KVSHARD_KV_PAIR_LINK=socket",
         true},
    };
    for (const NcclCase& c : cases) {
        KvHandoffPathFacts f;
        f.requested = c.requested;
        f.backend = c.backend;
        f.embedded = c.embedded;
        f.one_node = c.one_node;
        f.nccl_built = c.nccl_built;
        f.socket_pair_link = c.socket_pair_link;
        f.backend_has_peer_copies = true;
        f.src_gpus = c.src;
        f.dst_gpus = c.dst;
        f.can_access_peer = [](int, int) { return true; };
        Result<KvHandoffPath> got = ChooseKvHandoffPath(f);
        if (c.want.has_value()) {
            ASSERT_TRUE(got.ok()) << c.name << ": " << got.status().ToString();
            EXPECT_EQ(*got, *c.want) << c.name;
        } else {
            ASSERT_FALSE(got.ok()) << c.name;
            EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument) << c.name;
            EXPECT_EQ(got.status().message().rfind("kv_transfer.path: nccl: ", 0), 0u)
                << got.status().message();
            EXPECT_NE(got.status().message().find(c.message), std::string::npos)
                << c.name << ": " << got.status().message();
        }
    }
}

}  // namespace
}  // namespace kvshard
