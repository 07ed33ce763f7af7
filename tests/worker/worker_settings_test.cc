// The settings a worker process is told in RegisterAck (worker/worker_service.h): what the
// coordinator encodes comes back decoded, including where each rank runs and how the ranks'
// collectives go; a bad value is one line naming the key.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "worker/worker_service.h"

namespace kvshard {
namespace {

using Settings = std::vector<std::pair<std::string, std::string>>;

TEST(WorkerSettings, RoundTripTheBackendDevicesAndCollective) {
    WorkerRunSettings s;
    s.runner.num_kv_blocks = 40;
    s.runner.backend.kind = BackendKind::kCuda;
    s.devices = {1, 1};
    s.force_staged_collective = true;
    s.runner.cuda_graphs = true;  // serve's cuda_graphs reaches worker processes
    Result<WorkerRunSettings> back = DecodeWorkerSettings(EncodeWorkerSettings(s));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->runner.backend.kind, BackendKind::kCuda);
    EXPECT_EQ(back->devices, (std::vector<int>{1, 1}));
    EXPECT_TRUE(back->force_staged_collective);
    EXPECT_EQ(back->runner.num_kv_blocks, 40);
    EXPECT_EQ(back->runner.cuda_graphs, std::optional<bool>(true));

    // One device for every rank, and the defaults.
    WorkerRunSettings one;
    one.runner.num_kv_blocks = 8;
    one.runner.backend.device = 3;
    back = DecodeWorkerSettings(EncodeWorkerSettings(one));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(back->runner.backend.kind, BackendKind::kCpu);
    EXPECT_EQ(back->runner.backend.device, 3);
    EXPECT_TRUE(back->devices.empty());
    EXPECT_FALSE(back->force_staged_collective);
    EXPECT_FALSE(back->runner.cuda_graphs.has_value());
}

TEST(WorkerSettings, BadValuesNameTheKey) {
    const struct {
        std::string key, value, message;
    } cases[] = {
        {"backend", "tpu", "worker setting backend: 'tpu' is not one of cpu, cuda"},
        {"devices", "0,,1", "worker setting devices: '0,,1' is not a list of GPU ordinals"},
        {"devices", "0,-1", "worker setting devices: '0,-1' is not a list of GPU ordinals"},
        {"collective", "nccl", "worker setting collective: 'nccl' is not one of auto, staged"},
        {"cuda_graphs", "yes", "worker setting cuda_graphs: 'yes' is not one of true, false"},
    };
    for (const auto& c : cases) {
        Result<WorkerRunSettings> r =
            DecodeWorkerSettings(Settings{{"num_kv_blocks", "4"}, {c.key, c.value}});
        ASSERT_FALSE(r.ok()) << c.key;
        EXPECT_EQ(r.status().message(), c.message);
    }
}

}  // namespace
}  // namespace kvshard
