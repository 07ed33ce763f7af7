// The choice of the KV handoff path between pools (worker/kv_handoff_path.h), as a table: auto
// takes peer copies only for cuda pools of one process whose GPUs reach each other, the explicit
// settings are honoured or refused with a line naming kv_transfer.path.
#include "worker/kv_handoff_path.h"

#include <gtest/gtest.h>

#include <optional>
#include <set>
#include <string>
#include <utility>

namespace kvshard {
namespace {

// GPUs 0-1 and 2-3 are NVLink pairs; no other pair has peer access.
bool Pairs(int to, int from) { return to / 2 == from / 2; }

struct PathCase {
    const char* name;
    std::optional<KvHandoffPath> requested;
    BackendKind backend;
    bool embedded;
    std::vector<int> src, dst;
    std::optional<KvHandoffPath> want;  // empty: refused
    const char* message = "";           // in the refusal
};

TEST(KvHandoffPathChoice, Table) {
    const auto cpu = BackendKind::kCpu, cuda = BackendKind::kCuda;
    const auto host = KvHandoffPath::kHostStaged, peer = KvHandoffPath::kPeerCopy,
               nccl = KvHandoffPath::kNccl;
    const PathCase cases[] = {
        {"auto cpu embedded", std::nullopt, cpu, true, {}, {}, host},
        {"auto cuda one GPU", std::nullopt, cuda, true, {0}, {0}, peer},
        {"auto cuda NVLink pair", std::nullopt, cuda, true, {0}, {1}, peer},
        {"auto cuda tp 2 to tp 2 over pairs", std::nullopt, cuda, true, {0, 1}, {0, 1}, peer},
        {"auto cuda without peer access", std::nullopt, cuda, true, {0}, {2}, host},
        {"auto cuda worker processes", std::nullopt, cuda, false, {0}, {1}, host},
        {"host-staged", host, cuda, true, {0}, {1}, host},
        {"peer cpu embedded", peer, cpu, true, {}, {}, peer},
        {"peer cuda pair", peer, cuda, true, {2}, {3}, peer},
        {"peer cuda without access",
         peer,
         cuda,
         true,
         {1},
         {2},
         std::nullopt,
         "GPU 2 cannot access GPU 1"},
        {"peer worker processes", peer, cpu, false, {}, {}, std::nullopt, "workers.mode: embedded"},
        {"nccl", nccl, cuda, false, {0}, {1}, std::nullopt, "nccl: this kvshard was built"},
    };
    for (const PathCase& c : cases) {
        KvHandoffPathFacts f;
        f.requested = c.requested;
        f.backend = c.backend;
        f.embedded = c.embedded;
        f.backend_has_peer_copies = true;
        f.src_gpus = c.src;
        f.dst_gpus = c.dst;
        f.can_access_peer = Pairs;
        Result<KvHandoffPath> got = ChooseKvHandoffPath(f);
        if (c.want.has_value()) {
            ASSERT_TRUE(got.ok()) << c.name << ": " << got.status().ToString();
            EXPECT_EQ(*got, *c.want) << c.name;
        } else {
            ASSERT_FALSE(got.ok()) << c.name;
            EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument) << c.name;
            EXPECT_NE(got.status().message().find("kv_transfer.path"), std::string::npos)
                << got.status().message();
            EXPECT_NE(got.status().message().find(c.message), std::string::npos)
                << c.name << ": " << got.status().message();
        }
    }
}

TEST(KvHandoffPathChoice, ABackendWithoutPeerCopies) {
    KvHandoffPathFacts f;
    f.backend = BackendKind::kCuda;
    f.src_gpus = {0};
    f.dst_gpus = {0};
    f.can_access_peer = Pairs;
    f.backend_has_peer_copies = false;
    EXPECT_EQ(*ChooseKvHandoffPath(f), KvHandoffPath::kHostStaged);
    f.requested = KvHandoffPath::kPeerCopy;
    EXPECT_NE(ChooseKvHandoffPath(f).status().message().find("no peer copies"), std::string::npos);
}

TEST(KvHandoffPathChoice, TheLogLineNamesThePath) {
    for (KvHandoffPath p :
         {KvHandoffPath::kHostStaged, KvHandoffPath::kPeerCopy, KvHandoffPath::kNccl}) {
        const std::string line = KvHandoffPathLine(p);
        EXPECT_EQ(
            line.rfind("KV handoff between pools: " + std::string(KvHandoffPathName(p)) + " (", 0),
            0u)
            << line;
    }
    for (const char* name : {"host-staged", "peer", "nccl"}) {
        Result<KvHandoffPath> p = ParseKvHandoffPath(name);
        ASSERT_TRUE(p.ok()) << name;
        EXPECT_EQ(KvHandoffPathName(*p), name);
    }
    EXPECT_FALSE(ParseKvHandoffPath("nvlink").ok());
}

}  // namespace
}  // namespace kvshard
