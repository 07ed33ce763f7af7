// The KV pair path's fields of a StepPlan cross the wire (control protocol 11): kv_ready,
// kv_discards (which worker processes never received before), KvSendOp.dst_instance and
// KvRecvOp.src_instance; and a plan cut anywhere in them is refused.
#include <gtest/gtest.h>

#include "comm/plan_codec.h"

namespace kvshard {
namespace {

StepPlan PlanWithPairFields() {
    StepPlan plan;
    plan.step_id = 3;
    KvSendOp send;
    send.transfer_id = 11;
    send.block_table = {1, 2};
    send.num_tokens = 20;
    send.dst_tp = 1;
    send.dst_endpoints = {"127.0.0.1:5000"};
    send.dst_instance = "decode-1";
    plan.kv_sends.push_back(send);
    KvRecvOp recv;
    recv.transfer_id = 12;
    recv.block_table = {-1, 4};
    recv.num_tokens = 20;
    recv.src_instance = "prefill";
    plan.kv_recvs.push_back(recv);
    plan.kv_discards = {7, 9};
    plan.kv_ready = {12, 5};
    return plan;
}

TEST(PlanCodecPairFields, RoundTrip) {
    const StepPlan plan = PlanWithPairFields();
    Result<Message> decoded = DecodeFrame(EncodeFrame(plan));
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    const StepPlan* back = std::get_if<StepPlan>(&*decoded);
    ASSERT_NE(back, nullptr);
    EXPECT_EQ(back->kv_ready, plan.kv_ready);
    EXPECT_EQ(back->kv_discards, plan.kv_discards);
    EXPECT_EQ(back->kv_sends.at(0).dst_instance, "decode-1");
    EXPECT_EQ(back->kv_recvs.at(0).src_instance, "prefill");
    EXPECT_EQ(*back, plan);
}

TEST(PlanCodecPairFields, TruncatedPlansAreRefused) {
    const std::string frame = EncodeFrame(PlanWithPairFields());
    Result<FrameHeader> header =
        DecodeFrameHeader(std::string_view(frame).substr(0, kFrameHeaderBytes));
    ASSERT_TRUE(header.ok());
    const std::string_view payload = std::string_view(frame).substr(kFrameHeaderBytes);
    // The last 40 bytes hold the new fields; a payload cut there (its header patched to match,
    // so that only the decoder can refuse it) must not decode.
    for (size_t cut = 1; cut <= 40 && cut < payload.size(); ++cut) {
        FrameHeader h = *header;
        const std::string_view shorter = payload.substr(0, payload.size() - cut);
        h.payload_bytes = static_cast<uint32_t>(shorter.size());
        h.payload_crc32 = Crc32(shorter);
        EXPECT_FALSE(DecodePayload(h, shorter).ok()) << "cut " << cut;
    }
}

}  // namespace
}  // namespace kvshard
