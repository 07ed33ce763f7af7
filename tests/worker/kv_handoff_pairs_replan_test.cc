// KvPairHandoff::Replan (worker/kv_handoff_pairs.h, Re-forming) on CPU pools over in-memory pair
// links: a prefill rank with pairs to two decode instances re-plans those with one of them (it
// re-formed): the other instance's channel is kept (an offer held on it is still sent), the old
// channel's held offer is dropped and never reaches the new channel (the new receiver gets the
// bytes of the transfer it asked for), transfers older than the new pairs are refused on both
// sides without failing the pair, and a peer whose new channel cannot be made stays down with
// its offers and receives failing at once. A background re-plan (the NCCL link: joining waits for
// the re-formed peer) returns at once, fails the instance's offers fast until the join is done,
// then carries KV. The settings carry kv_pair_first_transfer. DownPairs tells the coordinator
// which pairs to re-plan: those that failed (either side) or could not be made, not those being
// joined, refusing an older transfer, or up; after a re-plan of both sides of a failed set
// (the coordinator's repair, both instances healthy) KV flows again.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tests/worker/kv_pair_test_pools.h"
#include "worker/kv_handoff_nccl_pairs.h"
#include "worker/kv_handoff_pairs.h"

namespace kvshard {
namespace {

struct Rank {
    std::unique_ptr<Backend> backend;
    std::unique_ptr<KvPool> pool;
    ShardLayout layout;
};

Rank MakeRank(uint32_t seed) {
    Rank r;
    Result<std::unique_ptr<Backend>> b = MakeBackend({.kind = BackendKind::kCpu});
    KV_CHECK(b.ok()) << b.status().ToString();
    r.backend = std::move(*b);
    r.layout = testing::PairLayout(0, 1);
    r.pool = testing::RandomPairPool(r.layout, *r.backend, seed);
    return r;
}

KvPairPool PoolOf(Rank& r) {
    return {.backend = r.backend.get(),
            .pool = r.pool.get(),
            .layout = r.layout,
            .group_of_layer = {0, 0}};
}

// In-memory links by pair id; `refuse` names ids whose channel cannot be made; making the
// channel of an id in `held` waits until Release() (as an NCCL join waits for its peer).
struct Links {
    std::mutex mu;
    std::condition_variable cv;
    std::map<std::string, std::unique_ptr<InMemoryKvPairLink>> by_id;  // guarded by mu
    std::set<std::string> refuse;
    std::set<std::string> held;  // guarded by mu
    void Hold(const std::string& id) {
        std::lock_guard<std::mutex> lock(mu);
        held.insert(id);
    }
    void Release() {
        std::lock_guard<std::mutex> lock(mu);
        held.clear();
        cv.notify_all();
    }
    KvNcclRankChannels::MakeChannel Maker() {
        return [this](const KvNcclPairAssignment& p) -> Result<std::unique_ptr<KvPairChannel>> {
            if (refuse.count(p.nccl_unique_id) != 0) return Unavailable("no port for this pair");
            std::unique_lock<std::mutex> lock(mu);
            cv.wait(lock, [&] { return held.count(p.nccl_unique_id) == 0; });
            auto& link = by_id[p.nccl_unique_id];
            if (link == nullptr) link = std::make_unique<InMemoryKvPairLink>();
            return link->Borrow(p.nccl_rank);
        };
    }
};

// One prefill rank ("prefill") and two decode instances ("decode", "decode2"), tp 1 each; ids
// "<generation>:<decode instance>".
std::vector<KvNcclPair> Plan(const std::string& generation) {
    Result<std::vector<KvNcclPair>> pairs =
        PlanKvNcclPairs(testing::PairSpec(), {{"prefill", 1}}, {{"decode", 1}, {"decode2", 1}},
                        [] { return Result<std::string>(std::string()); });
    KV_CHECK(pairs.ok()) << pairs.status().ToString();
    for (KvNcclPair& p : *pairs) {
        p.nccl_unique_id = generation + ":" + p.decode_instance;
        p.nccl_unique_id.resize(kKvNcclUniqueIdBytes, '.');
    }
    return *pairs;
}

std::string Id(const std::string& generation, const std::string& decode) {
    std::string id = generation + ":" + decode;
    id.resize(kKvNcclUniqueIdBytes, '.');
    return id;
}

// Plan("g1") with the pairs of instance "decode" re-planned as `generation`.
std::vector<KvNcclPair> Replanned(const std::string& generation) {
    std::vector<KvNcclPair> pairs = Plan("g1");
    for (KvNcclPair& p : pairs) {
        if (p.decode_instance == "decode") p.nccl_unique_id = Id(generation, "decode");
    }
    return pairs;
}

KvSendOp Send(uint64_t id, const std::string& to) {
    KvSendOp op = testing::PairSendOp(id);
    op.dst_instance = to;
    return op;
}

struct ThreeRanks {
    Links links;
    Rank prefill = MakeRank(1), decode = MakeRank(2), decode2 = MakeRank(3);
    std::unique_ptr<KvPairHandoff> send, recv, recv2;

    std::unique_ptr<KvPairHandoff> Make(const std::vector<KvNcclPair>& plan,
                                        const std::string& instance, Rank& rank,
                                        uint64_t first = 0) {
        Result<std::unique_ptr<KvPairHandoff>> h =
            KvPairHandoff::Create(KvNcclPairsOfRank(plan, instance, 0), links.Maker(), "in-memory",
                                  2'000, PoolOf(rank), kKvPairMaxOfferBytes, first);
        KV_CHECK(h.ok()) << h.status().ToString();
        return std::move(*h);
    }
    ThreeRanks() {
        const std::vector<KvNcclPair> plan = Plan("g1");
        send = Make(plan, "prefill", prefill);
        recv = Make(plan, "decode", decode);
        recv2 = Make(plan, "decode2", decode2);
    }
};

const std::vector<int32_t> kA = {1}, kB = {4};
std::vector<std::span<const int32_t>> Blocks(const std::vector<int32_t>& b) {
    return {std::span<const int32_t>(b)};
}

TEST(KvPairReplan, KeepsOtherInstancesPairsAndNeverSendsAnOldOfferOnTheNewChannel) {
    ThreeRanks s;
    // Held on the old channels: 5 to "decode" (never readied), 6 to "decode2".
    ASSERT_TRUE(s.send->Offer(Send(5, "decode"), Blocks(kA)).ok());
    ASSERT_TRUE(s.send->Offer(Send(6, "decode2"), Blocks(kA)).ok());

    // "decode" re-forms: the prefill rank's pairs with it get new ids from transfer 10 on.
    const std::vector<KvNcclPair> replanned = Replanned("g2");
    std::vector<std::string> changed;
    ASSERT_TRUE(s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 10, &changed).ok());
    EXPECT_EQ(changed, std::vector<std::string>{"decode"});
    s.recv = s.Make(replanned, "decode", s.decode, 10);  // the re-formed rank

    // The kept channel still sends what it held.
    s.send->Ready(6);
    const std::vector<int32_t> into = {2};
    ASSERT_TRUE(s.recv2->Receive(testing::PairRecvOp(6), Blocks(into)).ok());
    EXPECT_EQ(testing::PairHeadBytes(*s.decode2.pool, s.decode2.layout, 2, 1, 3),
              testing::PairHeadBytes(*s.prefill.pool, s.prefill.layout, kA[0], 1, 3));

    // 5 went with the old channel: readying it sends nothing on the new one, whose first
    // transfer carries 10's blocks (kB), not 5's (kA).
    s.send->Ready(5);
    ASSERT_TRUE(s.send->Offer(Send(10, "decode"), Blocks(kB)).ok());
    s.send->Ready(10);
    ASSERT_TRUE(s.recv->Receive(testing::PairRecvOp(10), Blocks(into)).ok());
    for (int64_t head = 0; head < 4; ++head) {
        EXPECT_EQ(testing::PairHeadBytes(*s.decode.pool, s.decode.layout, 2, 0, head),
                  testing::PairHeadBytes(*s.prefill.pool, s.prefill.layout, kB[0], 0, head))
            << "head " << head;
    }
    // The same pairs again: nothing changes.
    changed.clear();
    ASSERT_TRUE(s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 20, &changed).ok());
    EXPECT_TRUE(changed.empty());
}

TEST(KvPairReplan, OlderTransfersAreRefusedOnBothSidesAndThePairStaysUp) {
    ThreeRanks s;
    std::vector<KvNcclPair> replanned = Replanned("g2");
    ASSERT_TRUE(s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 10).ok());
    s.recv = s.Make(replanned, "decode", s.decode, 10);

    Result<int64_t> offered = s.send->Offer(Send(9, "decode"), Blocks(kA));
    EXPECT_EQ(offered.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(offered.status().message().find("planned before the KV pairs with instance decode "
                                              "were re-planned"),
              std::string::npos)
        << offered.status().ToString();
    const std::vector<int32_t> into = {3};
    Result<int64_t> received = s.recv->Receive(testing::PairRecvOp(9), Blocks(into));
    EXPECT_EQ(received.status().code(), StatusCode::kUnavailable) << received.status().ToString();
    s.recv->Abandon(testing::PairRecvOp(9), Aborted("the step ended"));  // the step's guard

    // Still in order: transfer 11 goes through.
    ASSERT_TRUE(s.send->Offer(Send(11, "decode"), Blocks(kB)).ok());
    s.send->Ready(11);
    Result<int64_t> got = s.recv->Receive(testing::PairRecvOp(11), Blocks(into));
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(testing::PairHeadBytes(*s.decode.pool, s.decode.layout, 3, 1, 0),
              testing::PairHeadBytes(*s.prefill.pool, s.prefill.layout, kB[0], 1, 0));
}

TEST(KvPairReplan, APeerWhoseNewChannelCannotBeMadeStaysDownOthersServe) {
    ThreeRanks s;
    std::vector<KvNcclPair> replanned = Replanned("g2");
    s.links.refuse.insert(Id("g2", "decode"));
    const Status st = s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 10);
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.message().find("no port for this pair"), std::string::npos) << st.ToString();
    Result<int64_t> offered = s.send->Offer(Send(12, "decode"), Blocks(kA));
    EXPECT_EQ(offered.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(offered.status().message().find("stay down"), std::string::npos)
        << offered.status().ToString();
    // The healthy instance's pair is untouched.
    ASSERT_TRUE(s.send->Offer(Send(13, "decode2"), Blocks(kA)).ok());
    s.send->Ready(13);
    const std::vector<int32_t> into = {0};
    EXPECT_TRUE(s.recv2->Receive(testing::PairRecvOp(13), Blocks(into)).ok());
    // Pairs Create would refuse change nothing.
    std::vector<KvNcclPairAssignment> bad = KvNcclPairsOfRank(replanned, "prefill", 0);
    bad[0].head_end = 9;
    EXPECT_EQ(s.send->Replan(bad, 20).code(), StatusCode::kInvalidArgument);
}

TEST(KvPairReplan, InTheBackgroundOffersFailFastUntilTheJoinIsDone) {
    ThreeRanks s;
    std::vector<KvNcclPair> replanned = Replanned("g2");
    s.links.Hold(Id("g2", "decode"));
    // Returns while the join waits.
    ASSERT_TRUE(s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 10, nullptr, true).ok());
    Result<int64_t> offered = s.send->Offer(Send(10, "decode"), Blocks(kA));
    EXPECT_EQ(offered.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(offered.status().message().find("being joined"), std::string::npos)
        << offered.status().ToString();
    EXPECT_TRUE(s.send->Offer(Send(11, "decode2"), Blocks(kA)).ok());  // others serve meanwhile
    s.send->Discard(11);
    s.links.Release();
    s.recv = s.Make(replanned, "decode", s.decode, 10);
    // Taken up by a later call once made.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    do {
        offered = s.send->Offer(Send(12, "decode"), Blocks(kB));
    } while (!offered.ok() && std::chrono::steady_clock::now() < deadline);
    ASSERT_TRUE(offered.ok()) << offered.status().ToString();
    s.send->Ready(12);
    const std::vector<int32_t> into = {5};
    ASSERT_TRUE(s.recv->Receive(testing::PairRecvOp(12), Blocks(into)).ok());
    EXPECT_EQ(testing::PairHeadBytes(*s.decode.pool, s.decode.layout, 5, 1, 1),
              testing::PairHeadBytes(*s.prefill.pool, s.prefill.layout, kB[0], 1, 1));
}

TEST(KvPairReplan, DownPairsNamesTheFailedPairsAndARepairOfBothSidesBringsThemBack) {
    ThreeRanks s;
    EXPECT_EQ(s.send->DownPairs("decode"), std::nullopt);
    EXPECT_EQ(s.recv->DownPairs("prefill"), std::nullopt);
    EXPECT_EQ(s.send->DownPairs("nobody"), std::nullopt);

    // The link between "prefill" and "decode" dies mid-transfer: the receive fails and aborts
    // the receiver's pairs; the sender's send fails on its thread.
    ASSERT_TRUE(s.send->Offer(Send(3, "decode"), Blocks(kA)).ok());
    {
        std::lock_guard<std::mutex> lock(s.links.mu);
        s.links.by_id.at(Id("g1", "decode"))->Kill(0);
    }
    s.send->Ready(3);
    const std::vector<int32_t> into = {2};
    EXPECT_FALSE(s.recv->Receive(testing::PairRecvOp(3), Blocks(into)).ok());
    EXPECT_EQ(s.recv->DownPairs("prefill"), std::optional<uint64_t>(0));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!s.send->DownPairs("decode").has_value() && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(s.send->DownPairs("decode"), std::optional<uint64_t>(0));
    EXPECT_EQ(s.send->DownPairs("decode2"), std::nullopt);  // the other instance's pairs serve
    // Down: offers fail at once, and say the coordinator re-plans them.
    Result<int64_t> refused = s.send->Offer(Send(4, "decode"), Blocks(kA));
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("the coordinator re-plans"), std::string::npos)
        << refused.status().ToString();

    // The coordinator re-plans the set (new ids from transfer 10) on both healthy sides, in the
    // background as on NCCL: being joined is not down.
    std::vector<KvNcclPair> replanned = Replanned("g2");
    s.links.Hold(Id("g2", "decode"));
    ASSERT_TRUE(s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 10, nullptr, true).ok());
    ASSERT_TRUE(s.recv->Replan(KvNcclPairsOfRank(replanned, "decode", 0), 10, nullptr, true).ok());
    EXPECT_EQ(s.send->DownPairs("decode"), std::nullopt);
    EXPECT_EQ(s.recv->DownPairs("prefill"), std::nullopt);
    s.links.Release();
    // An older transfer is refused on the new pairs without putting them down.
    Result<int64_t> offered = s.send->Offer(Send(9, "decode"), Blocks(kA));
    EXPECT_EQ(offered.status().code(), StatusCode::kUnavailable);
    do {
        offered = s.send->Offer(Send(11, "decode"), Blocks(kB));
    } while (!offered.ok() && std::chrono::steady_clock::now() < deadline);
    ASSERT_TRUE(offered.ok()) << offered.status().ToString();
    EXPECT_EQ(s.send->DownPairs("decode"), std::nullopt);
    s.send->Ready(11);
    Result<int64_t> got = Unavailable("not yet");
    do {
        got = s.recv->Receive(testing::PairRecvOp(11), Blocks(into));
    } while (!got.ok() && got.status().code() == StatusCode::kUnavailable &&
             std::chrono::steady_clock::now() < deadline);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(testing::PairHeadBytes(*s.decode.pool, s.decode.layout, 2, 1, 2),
              testing::PairHeadBytes(*s.prefill.pool, s.prefill.layout, kB[0], 1, 2));
    EXPECT_EQ(s.recv->DownPairs("prefill"), std::nullopt);

    // A re-plan whose channels cannot be made leaves them down, carrying its first transfer.
    replanned = Replanned("g3");
    s.links.refuse.insert(Id("g3", "decode"));
    EXPECT_FALSE(s.send->Replan(KvNcclPairsOfRank(replanned, "prefill", 0), 20).ok());
    EXPECT_EQ(s.send->DownPairs("decode"), std::optional<uint64_t>(20));
}

// A background join (the NCCL link: it waits for its peer) is cancelled when a later re-plan
// supersedes it and when the handoff closes, instead of waiting out its maker's timeout.
TEST(KvPairReplan, ABackgroundJoinIsCancelledWhenSupersededOrClosed) {
    Links links;
    Rank prefill = MakeRank(1);
    std::atomic<int> cancelled{0};
    // As Links::Maker, but a held id waits until released or cancelled.
    KvPairHandoff::MakePairChannel maker =
        [&](const KvNcclPairAssignment& p,
            const std::function<bool()>& cancel) -> Result<std::unique_ptr<KvPairChannel>> {
        std::unique_lock<std::mutex> lock(links.mu);
        while (links.held.count(p.nccl_unique_id) != 0) {
            if (cancel()) {
                cancelled++;
                return Aborted("join cancelled");
            }
            links.cv.wait_for(lock, std::chrono::milliseconds(5));
        }
        auto& link = links.by_id[p.nccl_unique_id];
        if (link == nullptr) link = std::make_unique<InMemoryKvPairLink>();
        return link->Borrow(p.nccl_rank);
    };
    Result<std::unique_ptr<KvPairHandoff>> h = KvPairHandoff::Create(
        KvNcclPairsOfRank(Plan("g1"), "prefill", 0), maker, "in-memory", 2'000, PoolOf(prefill));
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    links.Hold(Id("g2", "decode"));
    ASSERT_TRUE(
        (*h)->Replan(KvNcclPairsOfRank(Replanned("g2"), "prefill", 0), 10, nullptr, true).ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(cancelled.load(), 0);  // still joining
    // Superseded (the peer re-formed again): the g2 join ends, the g3 one is made.
    ASSERT_TRUE(
        (*h)->Replan(KvNcclPairsOfRank(Replanned("g3"), "prefill", 0), 20, nullptr, true).ok());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (cancelled.load() == 0 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(cancelled.load(), 1);
    // Closing with a join waiting: the destructor cancels it rather than waiting for a peer.
    links.Hold(Id("g4", "decode"));
    ASSERT_TRUE(
        (*h)->Replan(KvNcclPairsOfRank(Replanned("g4"), "prefill", 0), 30, nullptr, true).ok());
    const auto closing = std::chrono::steady_clock::now();
    h->reset();
    EXPECT_EQ(cancelled.load(), 2);
    EXPECT_LT(std::chrono::steady_clock::now() - closing, std::chrono::seconds(5));
}

TEST(KvPairReplan, SettingsCarryTheFirstTransfer) {
    using Settings = std::vector<std::pair<std::string, std::string>>;
    const std::string pairs = EncodeKvNcclPairs(KvNcclPairsOfRank(Plan("g1"), "decode", 0));
    const Settings base = {{"kv_nccl_pairs", pairs}, {"kv_pair_link", "socket"}};
    Result<std::optional<KvPairHandoffSettings>> none = KvPairHandoffSettingsOf(base);
    ASSERT_TRUE(none.ok() && none->has_value()) << none.status().ToString();
    EXPECT_EQ((*none)->first_transfer_id, 0u);
    Settings with = base;
    with.emplace_back("kv_pair_first_transfer", "42");
    Result<std::optional<KvPairHandoffSettings>> some = KvPairHandoffSettingsOf(with);
    ASSERT_TRUE(some.ok() && some->has_value()) << some.status().ToString();
    EXPECT_EQ((*some)->first_transfer_id, 42u);
    for (const char* bad : {"", "-1", "4x", "18446744073709551616"}) {
        Settings s = base;
        s.emplace_back("kv_pair_first_transfer", bad);
        Result<std::optional<KvPairHandoffSettings>> refused = KvPairHandoffSettingsOf(s);
        ASSERT_FALSE(refused.ok()) << bad;
        EXPECT_NE(refused.status().message().find("kv_pair_first_transfer"), std::string::npos);
    }
}

}  // namespace
}  // namespace kvshard
