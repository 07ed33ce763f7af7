#include "worker/worker_service.h"

#include <charconv>
#include <chrono>
#include <memory>
#include <thread>
#include <variant>

#include "comm/collective_store.h"
#include "comm/kv_transport.h"
#include "common/build_config.h"
#include "common/logging.h"
#include "kernels/cpu_ops.h"
#include "model/model_file.h"
#include "worker/kv_handoff.h"
#include "worker/kv_handoff_pairs.h"
#include "worker/rank_collective.h"
#include "worker/step_runner.h"
#include "worker/weights.h"

namespace kvshard {
namespace {

using SteadyClock = std::chrono::steady_clock;

constexpr std::string_view kKeyMaxContext = "max_context";
constexpr std::string_view kKeyBlockSize = "block_size";
constexpr std::string_view kKeyNumKvBlocks = "num_kv_blocks";
constexpr std::string_view kKeyKvDtype = "kv_dtype";
constexpr std::string_view kKeyTokenizer = "tokenizer";
constexpr std::string_view kKeyThreads = "threads";
constexpr std::string_view kKeyWeightFormat = "weight_format";
constexpr std::string_view kKeyMaxStepTokens = "max_step_tokens";
constexpr std::string_view kKeyBackend = "backend";
constexpr std::string_view kKeyDevices = "devices";
constexpr std::string_view kKeyCollective = "collective";
constexpr std::string_view kKeyCudaGraphs = "cuda_graphs";
// Set by the coordinator (coordinator/remote_executor.h), not by EncodeWorkerSettings.
constexpr std::string_view kKeyNcclUniqueId = "nccl_unique_id";

std::string JoinInts(const std::vector<int>& values) {
    std::string s;
    for (int v : values) s += (s.empty() ? "" : ",") + std::to_string(v);
    return s;
}

Result<std::vector<int>> IntListSetting(std::string_view key, const std::string& text) {
    std::vector<int> out;
    size_t start = 0;
    while (start < text.size()) {
        size_t end = text.find(',', start);
        if (end == std::string::npos) end = text.size();
        int v = 0;
        auto [ptr, ec] = std::from_chars(text.data() + start, text.data() + end, v);
        if (start == end || ec != std::errc() || ptr != text.data() + end || v < 0) {
            return InvalidArgument("worker setting " + std::string(key) + ": '" + text +
                                   "' is not a list of GPU ordinals");
        }
        out.push_back(v);
        start = end + 1;
    }
    return out;
}

Result<int64_t> IntSetting(std::string_view key, const std::string& text) {
    int64_t v = 0;
    const char* end = text.data() + text.size();
    auto [ptr, ec] = std::from_chars(text.data(), end, v);
    if (text.empty() || ec != std::errc() || ptr != end) {
        return InvalidArgument("worker setting " + std::string(key) + ": '" + text +
                               "' is not an integer");
    }
    return v;
}

// The prefix of every log line and error of this rank ("?" for what the coordinator assigns).
std::string Who(const WorkerServiceOptions& o) {
    return "instance " + o.instance_id + " rank " +
           (o.rank == kAnyRank ? std::string("?") : std::to_string(o.rank)) + "/" +
           (o.tp == kAnyTp ? std::string("?") : std::to_string(o.tp));
}

// The Gloo group of this rank's instance, meeting in the coordinator's store over `channel`.
Result<std::unique_ptr<Collective>> FormGlooGroup(const WorkerServiceOptions& o,
                                                  FrameChannel& channel) {
    CollectiveConfig cc;
    cc.kind = CollectiveConfig::Kind::kGloo;
    cc.rank = o.rank;
    cc.size = o.tp;
    cc.timeout_ms = o.collective_timeout_ms;
    cc.gloo_host = o.collective_host;
    cc.gloo_iface = o.collective_iface;
    cc.gloo_store = std::make_shared<ChannelCollectiveStore>(channel);
    return MakeCollective(cc);
}

// Connection refused while the coordinator is not listening yet: try again until the deadline.
Result<std::unique_ptr<FrameChannel>> ConnectWithRetry(const WorkerServiceOptions& o) {
    const auto deadline = SteadyClock::now() + std::chrono::milliseconds(o.connect_timeout_ms);
    Status last;
    for (;;) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(deadline - SteadyClock::now());
        if (left.count() <= 0) break;
        Result<std::unique_ptr<FrameChannel>> channel =
            ConnectFrameChannel(o.coordinator_host, o.coordinator_port,
                                std::min(left, std::chrono::milliseconds(5'000)), o.channel);
        if (channel.ok()) return channel;
        last = channel.status();
        // A retry interval, not synchronization: nothing tells us when the coordinator listens.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    return Status(StatusCode::kUnavailable,
                  "cannot reach the coordinator at " + o.coordinator_host + ":" +
                      std::to_string(o.coordinator_port) + " within " +
                      std::to_string(o.connect_timeout_ms) + " ms: " + last.message());
}

// One rank's model, pool and step runner, built from the coordinator's RegisterAck.
struct LoadedRank {
    std::unique_ptr<ModelFile> file;
    std::unique_ptr<ModelRunner> runner;
    std::unique_ptr<KvPairHandoff> pairs;  // the KV pair path's channels; outlives steps
    std::unique_ptr<StepRunner> steps;
};

Result<LoadedRank> LoadRank(const WorkerServiceOptions& o, const RegisterAckMessage& ack,
                            const WorkerRunSettings& settings, KvTransport* transport,
                            RankCollective* collective, const BackendCollectiveOptions& path) {
    WorkerRunSettings s = settings;
    const int threads = o.threads > 0 ? o.threads : s.threads;
    if (threads > 0) cpu::SetNumThreads(threads);
    if (!s.devices.empty()) s.runner.backend.device = s.devices[static_cast<size_t>(o.rank)];
    s.runner.collective_path = path.path;
    LoadedRank r;
    OpenModelOptions open;
    open.tokenizer_path = s.tokenizer_path;
    KV_ASSIGN_OR_RETURN(r.file, OpenModel(ack.model_path, open));
    KV_ASSIGN_OR_RETURN(r.runner, MakeModelRunner(*r.file, {.rank = o.rank, .tp = o.tp}, s.runner,
                                                  o.tp > 1 ? collective : nullptr));
    if (o.tp > 1) {
        spdlog::info("{}: {} collective on {}", Who(o), CollectivePathName(path.path),
                     r.runner->backend().Describe());
        KV_RETURN_IF_ERROR(AttachBackendCollective(path, r.runner->backend(), *collective));
    }
    // Pieces that cannot fit this rank's pool are refused before anything is allocated.
    KV_RETURN_IF_ERROR(
        transport->SetReceiveGeometry(ReceiveGeometryOf(*r.runner->pool(), r.runner->layout())));
    // The KV pair path (kv_transfer.path: nccl): the channels are made now, before Ready; a socket
    // channel never waits for its peer, an NCCL one joins it in plan order (worker/
    // kv_handoff_nccl_channels.h).
    KV_ASSIGN_OR_RETURN(std::optional<KvPairHandoffSettings> pairs,
                        KvPairHandoffSettingsOf(ack.settings));
    if (pairs.has_value()) {
        if (r.runner->pool() == nullptr)
            return InvalidArgument("worker setting kv_nccl_pairs: this rank has no KV pool");
        const size_t n = pairs->pairs.size();
        const std::string link(KvPairLinkName(pairs->link));
        KvPairPool pool{.backend = &r.runner->backend(),
                        .pool = r.runner->pool(),
                        .layout = r.runner->layout(),
                        .group_of_layer = r.runner->kv_groups().group_of_layer};
        KV_ASSIGN_OR_RETURN(
            KvPairHandoff::MakePairChannel make,
            KvPairHandoff::MakerOf(pairs->link, {.kind = r.runner->backend().kind(),
                                                 .device = s.runner.backend.device}));
        KV_ASSIGN_OR_RETURN(
            r.pairs,
            KvPairHandoff::Create(std::move(pairs->pairs), std::move(make), link, pairs->timeout_ms,
                                  std::move(pool), kKvPairMaxOfferBytes, pairs->first_transfer_id));
        spdlog::info("{}: KV handoff over {} pair(s) on the {} link", Who(o), n, link);
    }
    r.steps = std::make_unique<StepRunner>(*r.runner, transport, nullptr, r.pairs.get());
    return r;
}

// The coordinator re-planned this rank's pairs (another instance re-formed): the pair path
// re-plans its channels with the instances whose pairs changed. A rank without the pair path, or
// settings that do not decode, keep what they have: the error is logged, naming the setting.
void ApplyRankSettings(const std::string& who, LoadedRank& rank, const RankSettingsMessage& m) {
    Result<std::optional<KvPairHandoffSettings>> pairs = KvPairHandoffSettingsOf(m.settings);
    if (!pairs.ok()) {
        spdlog::error("{}: new rank settings refused: {}", who, pairs.status().ToString());
        return;
    }
    if (!pairs->has_value()) return;  // nothing this rank's pair path reads
    if (rank.pairs == nullptr) {
        spdlog::error(
            "{}: new KV pairs (kv_transfer.path: nccl) for a rank that started without "
            "them: ignored",
            who);
        return;
    }
    // NCCL channels join their peer, which is re-forming (loading its weights): off this thread.
    const Status replanned =
        rank.pairs->Replan(std::move((*pairs)->pairs), (*pairs)->first_transfer_id, nullptr,
                           (*pairs)->link == KvPairLink::kNccl);
    if (!replanned.ok()) spdlog::error("{}: {}", who, replanned.ToString());
}

StepResult RunStep(StepRunner& steps, const StepPlan& plan) {
    Result<StepResult> result = steps.Execute(plan);
    if (result.ok()) return std::move(*result);
    StepResult failed;
    failed.step_id = plan.step_id;
    SetStepError(&failed, result.status());
    return failed;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> EncodeWorkerSettings(const WorkerRunSettings& s) {
    std::vector<std::pair<std::string, std::string>> out = {
        {std::string(kKeyMaxContext), std::to_string(s.runner.max_context)},
        {std::string(kKeyBlockSize), std::to_string(s.runner.block_size)},
        {std::string(kKeyNumKvBlocks), std::to_string(s.runner.num_kv_blocks)},
        {std::string(kKeyKvDtype), std::string(KvDtypeName(s.runner.kv_storage))},
        {std::string(kKeyTokenizer), s.tokenizer_path},
        {std::string(kKeyThreads), std::to_string(s.threads)},
        {std::string(kKeyWeightFormat), std::string(WeightFormatName(s.runner.weight_format))},
        {std::string(kKeyMaxStepTokens), std::to_string(s.runner.max_step_tokens)},
        {std::string(kKeyBackend), std::string(BackendKindName(s.runner.backend.kind))},
        {std::string(kKeyDevices),
         s.devices.empty() ? std::to_string(s.runner.backend.device) : JoinInts(s.devices)},
        {std::string(kKeyCollective), s.force_staged_collective ? "staged" : "auto"},
    };
    // Only when set: a worker told nothing keeps the runner's default (graphs off).
    if (s.runner.cuda_graphs.has_value()) {
        out.emplace_back(std::string(kKeyCudaGraphs), *s.runner.cuda_graphs ? "true" : "false");
    }
    return out;
}

Result<WorkerRunSettings> DecodeWorkerSettings(
    const std::vector<std::pair<std::string, std::string>>& settings) {
    WorkerRunSettings s;
    bool seen_blocks = false;
    for (const auto& [key, value] : settings) {
        if (key == kKeyMaxContext) {
            KV_ASSIGN_OR_RETURN(s.runner.max_context, IntSetting(key, value));
        } else if (key == kKeyBlockSize) {
            KV_ASSIGN_OR_RETURN(s.runner.block_size, IntSetting(key, value));
        } else if (key == kKeyNumKvBlocks) {
            KV_ASSIGN_OR_RETURN(s.runner.num_kv_blocks, IntSetting(key, value));
            seen_blocks = true;
        } else if (key == kKeyKvDtype) {
            Result<KvDtype> dtype = ParseKvDtype(value);
            if (!dtype.ok())
                return InvalidArgument("worker setting " + key + ": " + dtype.status().message());
            s.runner.kv_storage = *dtype;
        } else if (key == kKeyTokenizer) {
            s.tokenizer_path = value;
        } else if (key == kKeyWeightFormat) {
            Result<WeightFormat> format = ParseWeightFormat(value);
            if (!format.ok())
                return InvalidArgument("worker setting " + key + ": " + format.status().message());
            s.runner.weight_format = *format;
        } else if (key == kKeyMaxStepTokens) {
            KV_ASSIGN_OR_RETURN(s.runner.max_step_tokens, IntSetting(key, value));
        } else if (key == kKeyBackend) {
            if (value == BackendKindName(BackendKind::kCpu)) {
                s.runner.backend.kind = BackendKind::kCpu;
            } else if (value == BackendKindName(BackendKind::kCuda)) {
                s.runner.backend.kind = BackendKind::kCuda;
            } else {
                return InvalidArgument("worker setting " + key + ": '" + value +
                                       "' is not one of cpu, cuda");
            }
        } else if (key == kKeyDevices) {
            KV_ASSIGN_OR_RETURN(s.devices, IntListSetting(key, value));
            if (s.devices.size() == 1) {
                s.runner.backend.device = s.devices[0];
                s.devices.clear();
            }
        } else if (key == kKeyCollective) {
            if (value != "auto" && value != "staged") {
                return InvalidArgument("worker setting " + key + ": '" + value +
                                       "' is not one of auto, staged");
            }
            s.force_staged_collective = value == "staged";
        } else if (key == kKeyCudaGraphs) {
            if (value != "true" && value != "false") {
                return InvalidArgument("worker setting " + key + ": '" + value +
                                       "' is not one of true, false");
            }
            s.runner.cuda_graphs = value == "true";
        } else if (key == kKeyThreads) {
            KV_ASSIGN_OR_RETURN(const int64_t threads, IntSetting(key, value));
            s.threads = static_cast<int>(threads);
        }
    }
    if (!seen_blocks) return InvalidArgument("worker setting num_kv_blocks: missing");
    if (s.runner.block_size <= 0) {
        return InvalidArgument("worker setting block_size: " + std::to_string(s.runner.block_size) +
                               " must be > 0");
    }
    return s;
}

Status RunWorkerService(const WorkerServiceOptions& options) {
    WorkerServiceOptions o = options;  // rank and tp as the coordinator confirms them
    std::string who = Who(o);
    KV_RETURN_IF_ERROR(ValidateFrameChannelOptions(o.channel));

    // This rank's KV transport: the coordinator hands its endpoint to the ranks that send KV here.
    // Every worker of the deployment shares the registration token: KV senders present it too.
    KvTransportOptions kv_options;
    kv_options.token = o.token;
    Result<std::unique_ptr<KvTransport>> transport = MakeTcpKvTransport(o.kv_host, 0, kv_options);
    if (!transport.ok()) return transport.status().WithContext(who + ": KV transport");
    const std::string kv_endpoint = (*transport)->endpoint();

    KV_ASSIGN_OR_RETURN(std::unique_ptr<FrameChannel> channel, ConnectWithRetry(o));
    spdlog::info("{}: connected to the coordinator at {}", who, channel->peer());
    RegisterMessage reg;
    reg.worker_rank = o.rank;
    reg.tp = o.tp;
    reg.instance_id = o.instance_id;
    reg.kv_endpoint = kv_endpoint;
    reg.token = o.token;
    reg.model = o.model;
    KV_RETURN_IF_ERROR(channel->Send(reg).WithContext(who + ": Register"));
    Result<Message> answer =
        channel->Receive(SteadyClock::now() + std::chrono::milliseconds(o.register_timeout_ms));
    if (!answer.ok()) return answer.status().WithContext(who + ": waiting for RegisterAck");
    const auto* ack = std::get_if<RegisterAckMessage>(&*answer);
    if (ack == nullptr) {
        return Internal(who + ": expected RegisterAck, got " +
                        std::string(MessageTypeName(TypeOf(*answer))));
    }
    if (!ack->accepted) {
        return InvalidArgument(who + ": the coordinator refused the registration: " + ack->error);
    }
    if ((o.tp != kAnyTp && ack->tp != o.tp) || (o.rank != kAnyRank && ack->rank != o.rank) ||
        ack->tp < 1 || ack->rank < 0 || ack->rank >= ack->tp) {
        return Internal(who + ": RegisterAck says rank " + std::to_string(ack->rank) + " of tp " +
                        std::to_string(ack->tp));
    }
    o.rank = ack->rank;
    o.tp = ack->tp;
    who = Who(o);

    // How the ranks reach each other: decided alike on every rank from what the coordinator told
    // them all (worker/rank_collective.h). The host collective forms before the shard: the
    // runner all-reduces through it (staged, on a device).
    Result<WorkerRunSettings> settings = DecodeWorkerSettings(ack->settings);
    std::string nccl_id;
    for (const auto& [key, value] : ack->settings) {
        if (key == kKeyNcclUniqueId) nccl_id = value;
    }
    BackendCollectiveOptions path{.rank = o.rank,
                                  .size = o.tp,
                                  .nccl_unique_id = nccl_id,
                                  .timeout_ms = o.collective_timeout_ms};
    std::unique_ptr<Collective> gloo;
    Status grouped = settings.status();
    if (settings.ok()) {
        std::vector<int> devices = settings->devices;
        if (devices.empty())
            devices.assign(static_cast<size_t>(o.tp), settings->runner.backend.device);
        if (devices.size() != static_cast<size_t>(o.tp)) {
            grouped =
                InvalidArgument("worker setting devices names " + std::to_string(devices.size()) +
                                " GPUs for tp " + std::to_string(o.tp));
        }
        path.path =
            ChooseCollectivePath({.backend = settings->runner.backend.kind,
                                  .tp = o.tp,
                                  .devices = devices,
                                  .nccl_available = KVSHARD_WITH_CUDA != 0 && !nccl_id.empty(),
                                  .force_staged = settings->force_staged_collective});
    }
    if (grouped.ok() && o.collective != nullptr && o.collective->size() != o.tp) {
        grouped = InvalidArgument(who + ": the given collective has " +
                                  std::to_string(o.collective->size()) + " ranks, the instance " +
                                  std::to_string(o.tp));
    } else if (grouped.ok() && o.collective == nullptr && o.tp > 1 &&
               path.path != CollectivePath::kNccl) {
        spdlog::info("{}: meeting the other {} ranks (Gloo, through the coordinator)", who,
                     o.tp - 1);
        Result<std::unique_ptr<Collective>> made = FormGlooGroup(o, *channel);
        if (made.ok()) {
            gloo = std::move(*made);
            o.collective = gloo.get();
        } else {
            grouped = made.status();
        }
    }
    if (!grouped.ok()) {
        ReadyMessage failed;
        failed.error = grouped.ToString();
        (void)channel->Send(failed);  // best effort: the error is returned either way
        return grouped.WithContext(who);
    }
    path.host = o.collective;

    spdlog::info("{}: loading {}", who, ack->model_path);
    RankCollective rank_collective(o.rank, o.tp);
    Result<LoadedRank> loaded =
        LoadRank(o, *ack, *settings, transport->get(), &rank_collective, path);
    ReadyMessage ready;
    ready.ok = loaded.ok();
    if (loaded.ok()) {
        const KvPool* pool = loaded->runner->pool();
        ready.num_kv_blocks = pool != nullptr ? pool->config().num_blocks : 0;
    } else {
        ready.error = loaded.status().ToString();
    }
    const Status sent = channel->Send(ready);
    if (!loaded.ok()) return loaded.status().WithContext(who);
    KV_RETURN_IF_ERROR(sent.WithContext(who + ": Ready"));
    spdlog::info("{}: ready ({} KV blocks)", who, ready.num_kv_blocks);

    for (;;) {
        // No deadline of our own: heartbeats tell a dead coordinator from an idle one.
        Result<Message> message = channel->Receive(SteadyClock::now() + std::chrono::hours(1));
        if (!message.ok()) {
            if (message.status().code() == StatusCode::kDeadlineExceeded) continue;
            return Status(StatusCode::kUnavailable, who + ": connection to the coordinator (" +
                                                        channel->peer() +
                                                        "): " + message.status().message());
        }
        if (const auto* plan = std::get_if<StepPlan>(&*message)) {
            KV_RETURN_IF_ERROR(
                channel->Send(RunStep(*loaded->steps, *plan)).WithContext(who + ": StepResult"));
        } else if (const auto* update = std::get_if<RankSettingsMessage>(&*message)) {
            ApplyRankSettings(who, *loaded, *update);
        } else if (const auto* shutdown = std::get_if<ShutdownMessage>(&*message)) {
            spdlog::info("{}: shutdown: {}", who, shutdown->reason);
            return Status::Ok();
        } else {
            return Internal(who + ": unexpected " + std::string(MessageTypeName(TypeOf(*message))) +
                            " from the coordinator");
        }
    }
}

}  // namespace kvshard
