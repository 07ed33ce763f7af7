// The NCCL KV handoff's pairs as a RegisterAck carries them (comm/kv_nccl_pairs.h): they
// round-trip, and every bound on what the coordinator can make a worker create is refused with one
// line naming the setting and the field — before anything is allocated for it.
#include "comm/kv_nccl_pairs.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvshard {
namespace {

KvNcclPairAssignment Pair(const std::string& instance, int32_t peer_rank, int32_t nccl_rank,
                          char id_byte) {
    return {.peer_instance = instance,
            .peer_rank = peer_rank,
            .nccl_rank = nccl_rank,
            .head_begin = 2,
            .head_end = 4,
            .nccl_unique_id = std::string(kKvNcclUniqueIdBytes, id_byte)};
}

TEST(KvNcclPairs, RoundTrip) {
    const std::vector<KvNcclPairAssignment> pairs = {
        Pair("decode-0", 0, 0, 'a'), Pair("decode-0", 1, 0, 'b'), Pair("decode-1", 0, 0, '\0')};
    Result<std::vector<KvNcclPairAssignment>> back = DecodeKvNcclPairs(EncodeKvNcclPairs(pairs));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, pairs);
    Result<std::vector<KvNcclPairAssignment>> none = DecodeKvNcclPairs(EncodeKvNcclPairs({}));
    ASSERT_TRUE(none.ok());
    EXPECT_TRUE(none->empty());
}

TEST(KvNcclPairs, RefusesEachBoundNamingIt) {
    struct Case {
        const char* name;
        KvNcclPairAssignment pair;
        const char* message;
    };
    std::vector<Case> cases;
    auto with = [](auto edit) {
        KvNcclPairAssignment p = Pair("decode-0", 0, 1, 'x');
        edit(p);
        return p;
    };
    cases.push_back({"empty instance", with([](auto& p) { p.peer_instance.clear(); }),
                     "peer instance name of 0 bytes"});
    cases.push_back({"long instance",
                     with([](auto& p) { p.peer_instance.assign(kMaxKvNcclInstanceName + 1, 'i'); }),
                     "peer instance name of 257 bytes"});
    cases.push_back(
        {"negative peer rank", with([](auto& p) { p.peer_rank = -1; }), "peer rank -1 outside"});
    cases.push_back({"huge peer rank", with([](auto& p) { p.peer_rank = kMaxKvNcclPeerRank; }),
                     "peer rank 1024 outside"});
    cases.push_back({"nccl rank 2", with([](auto& p) { p.nccl_rank = 2; }),
                     "nccl rank 2 must be 0 (sender) or 1 (receiver)"});
    cases.push_back({"empty heads", with([](auto& p) { p.head_end = p.head_begin; }),
                     "heads [2, 2) must be a non-empty range"});
    cases.push_back({"negative heads", with([](auto& p) { p.head_begin = -1; }), "heads [-1, 4)"});
    cases.push_back({"too many heads", with([](auto& p) { p.head_end = kMaxKvNcclHeads + 1; }),
                     "heads [2, 65537)"});
    cases.push_back({"short id", with([](auto& p) { p.nccl_unique_id.resize(16); }),
                     "NCCL unique id of 16 bytes, expected 128"});
    for (const Case& c : cases) {
        Result<std::vector<KvNcclPairAssignment>> got =
            DecodeKvNcclPairs(EncodeKvNcclPairs({c.pair}));
        ASSERT_FALSE(got.ok()) << c.name;
        EXPECT_EQ(got.status().code(), StatusCode::kInvalidArgument) << c.name;
        EXPECT_NE(got.status().message().find("kv_nccl_pairs: pair 0: "), std::string::npos)
            << got.status().message();
        EXPECT_NE(got.status().message().find(c.message), std::string::npos)
            << c.name << ": " << got.status().message();
    }
    Result<std::vector<KvNcclPairAssignment>> twice =
        DecodeKvNcclPairs(EncodeKvNcclPairs({Pair("d", 1, 1, 'a'), Pair("d", 1, 1, 'b')}));
    ASSERT_FALSE(twice.ok());
    EXPECT_NE(twice.status().message().find("pair 1: a second pair with instance 'd' rank 1"),
              std::string::npos)
        << twice.status().message();
}

TEST(KvNcclPairs, RefusesMorePairsThanTheBoundBeforeReadingThem) {
    std::vector<KvNcclPairAssignment> many;
    for (size_t i = 0; i <= kMaxKvNcclPairsPerRank; ++i)
        many.push_back(Pair("d", static_cast<int32_t>(i), 0, 'p'));
    Result<std::vector<KvNcclPairAssignment>> got = DecodeKvNcclPairs(EncodeKvNcclPairs(many));
    ASSERT_FALSE(got.ok());
    EXPECT_NE(got.status().message().find("257 elements, at most 256"), std::string::npos)
        << got.status().message();
    // A count that claims more pairs than the bytes can hold is refused before any reserve.
    std::string bytes = EncodeKvNcclPairs({Pair("d", 0, 0, 'p')});
    bytes[0] = 100;
    got = DecodeKvNcclPairs(bytes);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status().code(), StatusCode::kDataLoss);
}

TEST(KvNcclPairs, RefusesTruncatedAndTrailingBytes) {
    const std::string bytes = EncodeKvNcclPairs({Pair("decode-0", 0, 0, 'a')});
    for (size_t cut : {size_t{1}, size_t{10}, bytes.size() - 1}) {
        Result<std::vector<KvNcclPairAssignment>> got =
            DecodeKvNcclPairs(std::string_view(bytes).substr(0, cut));
        ASSERT_FALSE(got.ok()) << cut;
        EXPECT_EQ(got.status().code(), StatusCode::kDataLoss) << cut;
        EXPECT_NE(got.status().message().find("kv_nccl_pairs: "), std::string::npos);
    }
    Result<std::vector<KvNcclPairAssignment>> trailing = DecodeKvNcclPairs(bytes + "z");
    ASSERT_FALSE(trailing.ok());
    EXPECT_NE(trailing.status().message().find("1 bytes after the last field"), std::string::npos)
        << trailing.status().message();
}

}  // namespace
}  // namespace kvshard
