// The NCCL KV handoff's transfer protocol (comm/kv_pair_protocol.h) on the in-memory fake pair
// (comm/kv_pair_channel.h): transfers arrive in announcement order with their own bytes, a
// discarded transfer is never issued, the receiver checks a transfer against its pool before it
// announces or posts anything, and a dead peer, a timeout, a lost or unexpected announcement
// each fail the pair with every held transfer ended (the blocks come back), never a hang.
#include "comm/kv_pair_protocol.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <future>
#include <memory>
#include <string>
#include <vector>

namespace kvshard {
namespace {

constexpr int64_t kBytesPerBlock = 16;
constexpr int64_t kLongMs = 30'000;  // never reached when the protocol works
constexpr int64_t kShortMs = 50;     // for the timeouts tested

// The bytes of a transfer's blocks, distinct per transfer.
std::vector<char> Blocks(uint64_t id, int64_t num_blocks) {
    std::vector<char> bytes(static_cast<size_t>(num_blocks * kBytesPerBlock));
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(id * 31 + i);
    return bytes;
}

KvPairTransfer Transfer(uint64_t id, int64_t num_blocks) {
    return {.transfer_id = id, .num_blocks = num_blocks, .bytes_per_block = kBytesPerBlock};
}

// What one offered transfer ended with.
struct Ending {
    std::promise<Status> promise;
    std::future<Status> future = promise.get_future();
    KvPairSender::Done done() {
        return [this](const Status& s) { promise.set_value(s); };
    }
    bool ended() { return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }
};

struct Pair {
    InMemoryKvPairLink link;
    std::unique_ptr<KvPairSender> sender;
    std::unique_ptr<KvPairReceiver> receiver;
    std::vector<uint64_t> announced;

    explicit Pair(int64_t sender_ms = kLongMs, int64_t receiver_ms = kLongMs,
                  int64_t max_blocks = 4) {
        sender = std::make_unique<KvPairSender>(link.endpoint(0), sender_ms, /*max_offers=*/8);
        // The control path, as a direct call to the prefill side.
        receiver = std::make_unique<KvPairReceiver>(
            link.endpoint(1), KvPairReceiveLimits{max_blocks, kBytesPerBlock},
            [this](uint64_t id) {
                announced.push_back(id);
                return sender->Ready(id);
            },
            receiver_ms);
    }
};

TEST(KvPairProtocol, TransfersArriveInOrderWithTheirBytes) {
    Pair pair;
    std::vector<std::vector<char>> src;
    Ending ending[3];
    for (uint64_t id = 1; id <= 3; ++id) {
        src.push_back(Blocks(id, static_cast<int64_t>(id)));
        ASSERT_TRUE(
            pair.sender->Offer(Transfer(id, id), src.back().data(), ending[id - 1].done()).ok());
    }
    for (uint64_t id = 1; id <= 3; ++id) {
        std::vector<char> dst(src[id - 1].size());
        const Status got = pair.receiver->Receive(Transfer(id, id), dst.data(), dst.size());
        ASSERT_TRUE(got.ok()) << got.ToString();
        EXPECT_EQ(dst, src[id - 1]) << "transfer " << id;
        EXPECT_TRUE(ending[id - 1].future.get().ok());
    }
    EXPECT_EQ(pair.link.completed(), 3);
    EXPECT_EQ(pair.sender->held(), 0);
    EXPECT_TRUE(pair.sender->failure().ok());
}

TEST(KvPairProtocol, DiscardedTransferIsNeverIssued) {
    Pair pair;
    const std::vector<char> first = Blocks(1, 2), second = Blocks(2, 2);
    Ending e1, e2;
    ASSERT_TRUE(pair.sender->Offer(Transfer(1, 2), first.data(), e1.done()).ok());
    ASSERT_TRUE(pair.sender->Offer(Transfer(2, 2), second.data(), e2.done()).ok());
    ASSERT_TRUE(pair.sender->Discard(1).ok());
    EXPECT_EQ(e1.future.get().code(), StatusCode::kAborted);  // its blocks come back at once
    std::vector<char> dst(second.size());
    ASSERT_TRUE(pair.receiver->Receive(Transfer(2, 2), dst.data(), dst.size()).ok());
    EXPECT_EQ(dst, second);  // not the discarded transfer's bytes
    EXPECT_TRUE(e2.future.get().ok());
    EXPECT_EQ(pair.link.completed(), 1);
    EXPECT_FALSE(pair.sender->Discard(1).ok());  // not held any more
}

TEST(KvPairProtocol, ReceiverChecksTransferAgainstItsPoolBeforeAnnouncing) {
    struct Case {
        const char* name;
        KvPairTransfer transfer;
        size_t dst_bytes;
        bool null_dst;
    };
    const Case cases[] = {
        {"more blocks than the pool takes", Transfer(5, 5), 1024, false},
        {"zero blocks", Transfer(5, 0), 1024, false},
        {"negative blocks", Transfer(5, -1), 1024, false},
        {"another block size", {5, 2, kBytesPerBlock * 2}, 1024, false},
        {"a block size that overflows", {5, 4, INT64_MAX}, 1024, false},
        {"destination too small", Transfer(5, 2), 2 * kBytesPerBlock - 1, false},
        {"null destination", Transfer(5, 1), 1024, true},
    };
    Pair pair;
    std::vector<char> dst(1024);
    for (const Case& c : cases) {
        const Status got =
            pair.receiver->Receive(c.transfer, c.null_dst ? nullptr : dst.data(), c.dst_bytes);
        EXPECT_EQ(got.code(), StatusCode::kInvalidArgument) << c.name << ": " << got.ToString();
    }
    EXPECT_TRUE(pair.announced.empty());  // nothing announced, nothing posted
    EXPECT_TRUE(pair.receiver->failure().ok());
    // The pair still works.
    const std::vector<char> src = Blocks(7, 4);
    Ending ending;
    ASSERT_TRUE(pair.sender->Offer(Transfer(7, 4), src.data(), ending.done()).ok());
    ASSERT_TRUE(pair.receiver->Receive(Transfer(7, 4), dst.data(), dst.size()).ok());
    EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin()));
    EXPECT_TRUE(ending.future.get().ok());
    // Ids announced by one receiver increase: 7 again, or 6, is refused before announcing.
    EXPECT_EQ(pair.receiver->Receive(Transfer(7, 1), dst.data(), dst.size()).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(pair.receiver->Receive(Transfer(6, 1), dst.data(), dst.size()).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(pair.announced, std::vector<uint64_t>{7});
}

TEST(KvPairProtocol, PeerDyingMidTransferFailsThePairAndEndsEveryHeldTransfer) {
    InMemoryKvPairLink link;
    KvPairSender sender(link.endpoint(0), kLongMs, 8);
    const std::vector<char> a = Blocks(1, 2), b = Blocks(2, 2);
    Ending e1, e2;
    ASSERT_TRUE(sender.Offer(Transfer(1, 2), a.data(), e1.done()).ok());
    ASSERT_TRUE(sender.Offer(Transfer(2, 2), b.data(), e2.done()).ok());
    // The prefill rank dies after the decode side announced transfer 1.
    KvPairReceiver receiver(
        link.endpoint(1), {4, kBytesPerBlock},
        [&](uint64_t id) {
            const Status ready = sender.Ready(id);
            link.Kill(0);
            return ready;
        },
        kLongMs);
    std::vector<char> dst(a.size());
    const Status got = receiver.Receive(Transfer(1, 2), dst.data(), dst.size());
    EXPECT_EQ(got.code(), StatusCode::kUnavailable) << got.ToString();
    EXPECT_FALSE(receiver.failure().ok());
    EXPECT_EQ(e1.future.get().code(), StatusCode::kUnavailable);
    EXPECT_EQ(e2.future.get().code(), StatusCode::kUnavailable);  // held, ended: no block leak
    EXPECT_EQ(sender.held(), 0);
    EXPECT_FALSE(sender.failure().ok());
    Ending e3;
    EXPECT_FALSE(sender.Offer(Transfer(3, 1), a.data(), e3.done()).ok());  // the pair is done
    EXPECT_FALSE(receiver.Receive(Transfer(3, 1), dst.data(), dst.size()).ok());
    EXPECT_EQ(link.completed(), 0);
}

TEST(KvPairProtocol, ReceiverTimesOutWhenItsAnnouncementIsLost) {
    InMemoryKvPairLink link;
    KvPairSender sender(link.endpoint(0), kLongMs, 8);
    const std::vector<char> a = Blocks(1, 1);
    Ending e1;
    ASSERT_TRUE(sender.Offer(Transfer(1, 1), a.data(), e1.done()).ok());
    // The control path reports success but the message never reaches the sender.
    KvPairReceiver receiver(
        link.endpoint(1), {4, kBytesPerBlock}, [](uint64_t) { return Status::Ok(); }, kShortMs);
    std::vector<char> dst(a.size());
    EXPECT_EQ(receiver.Receive(Transfer(1, 1), dst.data(), dst.size()).code(),
              StatusCode::kDeadlineExceeded);
    EXPECT_FALSE(receiver.failure().ok());
    // The decode side reports the failure; the prefill side discards and gets its blocks back.
    EXPECT_FALSE(e1.ended());
    ASSERT_TRUE(sender.Discard(1).ok());
    EXPECT_EQ(e1.future.get().code(), StatusCode::kAborted);
}

TEST(KvPairProtocol, SenderTimesOutWhenTheReceiveIsNeverPosted) {
    InMemoryKvPairLink link;
    KvPairSender sender(link.endpoint(0), kShortMs, 8);
    const std::vector<char> a = Blocks(1, 1), b = Blocks(2, 1);
    Ending e1, e2;
    ASSERT_TRUE(sender.Offer(Transfer(1, 1), a.data(), e1.done()).ok());
    ASSERT_TRUE(sender.Offer(Transfer(2, 1), b.data(), e2.done()).ok());
    ASSERT_TRUE(sender.Ready(1).ok());  // and the decode side dies before posting it
    EXPECT_EQ(e1.future.get().code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(e2.future.get().code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(sender.held(), 0);
    EXPECT_EQ(sender.failure().code(), StatusCode::kDeadlineExceeded);
}

TEST(KvPairProtocol, ReadyForATransferNotHeldFailsThePair) {
    Pair pair(kLongMs, kShortMs);
    const std::vector<char> a = Blocks(1, 1);
    Ending e1;
    ASSERT_TRUE(pair.sender->Offer(Transfer(1, 1), a.data(), e1.done()).ok());
    std::vector<char> dst(64);
    // Transfer 9 was never offered: the receive it announces would match nothing.
    EXPECT_FALSE(pair.receiver->Receive(Transfer(9, 1), dst.data(), dst.size()).ok());
    EXPECT_EQ(e1.future.get().code(), StatusCode::kAborted);
    EXPECT_EQ(pair.sender->failure().code(), StatusCode::kAborted);
    EXPECT_FALSE(pair.receiver->failure().ok());
    // Ready twice for one transfer fails a pair too.
    Pair twice;
    Ending e2;
    ASSERT_TRUE(twice.sender->Offer(Transfer(1, 1), a.data(), e2.done()).ok());
    ASSERT_TRUE(twice.sender->Ready(1).ok());
    EXPECT_FALSE(twice.sender->Ready(1).ok());
    EXPECT_FALSE(e2.future.get().ok());
}

TEST(KvPairProtocol, FailedAnnouncementFailsThePairWithoutPosting) {
    InMemoryKvPairLink link;
    KvPairReceiver receiver(
        link.endpoint(1), {4, kBytesPerBlock},
        [](uint64_t) { return Unavailable("control connection reset"); }, kLongMs);
    std::vector<char> dst(64);
    const Status got = receiver.Receive(Transfer(1, 1), dst.data(), dst.size());
    EXPECT_EQ(got.code(), StatusCode::kAborted) << got.ToString();
    EXPECT_NE(got.message().find("control connection reset"), std::string::npos);
    // Not posted: a send on the other side finds no receive to match and ends at its deadline.
    EXPECT_EQ(link.endpoint(0)
                  ->Send(dst.data(), 16,
                         KvPairChannel::Clock::now() + std::chrono::milliseconds(kShortMs))
                  .code(),
              StatusCode::kDeadlineExceeded);
    EXPECT_EQ(link.completed(), 0);
}

TEST(KvPairProtocol, OfferBoundsAndClosingEndsHeldTransfers) {
    InMemoryKvPairLink link;
    auto sender = std::make_unique<KvPairSender>(link.endpoint(0), kLongMs, /*max_offers=*/2);
    const std::vector<char> a = Blocks(1, 1);
    Ending e1, e2, e3, e4;
    ASSERT_TRUE(sender->Offer(Transfer(1, 1), a.data(), e1.done()).ok());
    EXPECT_EQ(sender->Offer(Transfer(1, 1), a.data(), e3.done()).code(),
              StatusCode::kInvalidArgument);  // offered twice
    EXPECT_EQ(sender->Offer(Transfer(3, 1), nullptr, e3.done()).code(),
              StatusCode::kInvalidArgument);
    EXPECT_EQ(sender->Offer(Transfer(3, 0), a.data(), e3.done()).code(),
              StatusCode::kInvalidArgument);
    ASSERT_TRUE(sender->Offer(Transfer(2, 1), a.data(), e2.done()).ok());
    EXPECT_EQ(sender->Offer(Transfer(4, 1), a.data(), e4.done()).code(),
              StatusCode::kResourceExhausted);
    EXPECT_FALSE(e3.ended());
    EXPECT_FALSE(e4.ended());
    sender.reset();
    EXPECT_EQ(e1.future.get().code(), StatusCode::kAborted);
    EXPECT_EQ(e2.future.get().code(), StatusCode::kAborted);
}

}  // namespace
}  // namespace kvshard
