// The collective rule the ranks, the device plan and the coordinator's NCCL bootstrap share
// (config/collective_path.h), as a table.
#include "config/collective_path.h"

#include <gtest/gtest.h>

#include <vector>

namespace kvshard {
namespace {

TEST(CollectivePathRule, Table) {
    struct Case {
        bool on_gpus;
        int tp;
        std::vector<int> devices;
        bool nccl, force;
        CollectivePath want;
    };
    using enum CollectivePath;
    const Case cases[] = {
        {false, 2, {}, true, false, kHost},
        {false, 2, {}, true, true, kStaged},
        {true, 2, {0, 1}, true, false, kNccl},
        {true, 8, {7, 6, 5, 4, 3, 2, 1, 0}, true, false, kNccl},
        {true, 2, {0, 1}, true, true, kStaged},
        {true, 2, {0, 1}, false, false, kStaged},  // no NCCL (or no id)
        {true, 2, {0, 0}, true, false, kStaged},   // one GPU, two ranks
        {true, 4, {0, 1, 2, 1}, true, false, kStaged},
        {true, 2, {0}, true, false, kStaged},  // fewer devices than ranks: not known
        {true, 2, {}, true, false, kStaged},
        {true, 1, {0}, true, false, kStaged},  // tp 1 has no collective to choose
    };
    for (const Case& c : cases) {
        EXPECT_EQ(DecideCollectivePath({.on_gpus = c.on_gpus,
                                        .tp = c.tp,
                                        .devices = c.devices,
                                        .nccl_available = c.nccl,
                                        .force_staged = c.force}),
                  c.want)
            << "gpus " << c.on_gpus << " tp " << c.tp << " devices " << c.devices.size() << " nccl "
            << c.nccl << " force " << c.force;
    }
    EXPECT_EQ(CollectivePathName(kNccl), "nccl");
    EXPECT_EQ(CollectivePathName(kStaged), "host-staged");
    EXPECT_EQ(CollectivePathName(kHost), "host");
}

TEST(CollectivePathRule, RanksHaveOwnGpus) {
    EXPECT_TRUE(RanksHaveOwnGpus({0, 1}, 2));
    EXPECT_TRUE(RanksHaveOwnGpus({3, 1, 2}, 3));
    EXPECT_FALSE(RanksHaveOwnGpus({0, 0}, 2));
    EXPECT_FALSE(RanksHaveOwnGpus({0, 1}, 3));
    EXPECT_FALSE(RanksHaveOwnGpus({0, 1, 2}, 2));
    EXPECT_FALSE(RanksHaveOwnGpus({0}, 1));
}

}  // namespace
}  // namespace kvshard
