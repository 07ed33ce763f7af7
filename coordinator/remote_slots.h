// WorkerRegistry::Slots: one instance's ranks, shared by the WorkerRegistry that fills them
// (coordinator/worker_registry.cc) and the RemoteStepExecutor that uses them
// (coordinator/remote_executor.cc). Internal to coordinator/: the public contract is
// coordinator/remote_executor.h.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/collective_store.h"
#include "comm/frame_channel.h"
#include "common/status.h"
#include "coordinator/remote_executor.h"

namespace kvshard {

// One instance's ranks. The registry fills a rank's slot (channel, peer, kv_endpoint) while the
// instance takes registrations (before its first formation, and while re-forming); the executor
// reads them and owns the channels' use from then on.
struct WorkerRegistry::Slots {
    explicit Slots(const RemoteInstanceOptions& o) : options(o), rank_settings(o.rank_settings) {
        Reset();
    }

    // REQUIRES: mu held. Empties every rank's slot (the caller keeps the old channels).
    void Reset() {
        const auto n = static_cast<size_t>(options.tp);
        channels.clear();
        channels.resize(n);
        peers.assign(n, "");
        kv_endpoints.assign(n, "");
        ready.assign(n, false);
        rank_settings_version.assign(n, 0);
        num_kv_blocks.assign(n, 0);
        num_registered = 0;
        store = std::make_shared<MemoryCollectiveStore>();
        nccl_unique_id.clear();
    }

    // REQUIRES: mu held. Whether a Register for this instance may take a free rank now.
    bool TakesRegistrations() const {
        return !closed && !shut_down && (reforming || (failed.ok() && !formed));
    }

    const RemoteInstanceOptions options;
    mutable std::mutex mu;
    std::condition_variable cv;  // a rank registered, or the instance failed
    // Guarded by mu. A channel, once set, is only taken out by BeginReform and the destructor.
    std::vector<std::unique_ptr<FrameChannel>> channels;
    std::vector<std::string> peers;
    std::vector<std::string> kv_endpoints;
    std::vector<bool> ready;
    std::vector<int64_t> num_kv_blocks;
    int num_registered = 0;
    // Each rank's own settings, handed out in RegisterAck: options.rank_settings until
    // RemoteStepExecutor::UpdateRankSettings replaces them; settings_version counts the
    // replacements and rank_settings_version[r] is the version rank r was given (at registration,
    // or in a RankSettingsMessage once Ready).
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_settings;
    uint64_t settings_version = 0;
    std::vector<uint64_t> rank_settings_version;
    // The formation's rendezvous store (comm/collective_store.h): the ranks of a Gloo group
    // exchange their addresses in it, through StoreRequest messages between RegisterAck and
    // Ready. A fresh one per formation, so a re-formed group never reads the old one's keys.
    std::shared_ptr<MemoryCollectiveStore> store;
    // CUDA builds, tp > 1, options.nccl_bootstrap: the formation's NCCL unique id, made at its
    // first registration and handed to every rank in RegisterAck.settings ("nccl_unique_id").
    std::string nccl_unique_id;
    // The state of the current formation, guarded by mu:
    //   forming (initial) ─WaitReady OK→ formed ─failure→ failed ─BeginReform→ reforming
    //   reforming ─Reform OK→ formed;  reforming ─failure→ failed;  any ─Shutdown→ shut down
    Status failed;           // why the current formation cannot run steps; OK otherwise
    bool formed = false;     // every rank Ready and nothing failed since
    bool reforming = false;  // BeginReform ran and its Reform has not ended yet
    bool shut_down = false;
    bool closed = false;      // the executor is gone: no more registrations
    uint64_t epoch = 0;       // formations so far
    uint64_t generation = 0;  // BeginReforms so far: tells a stale failure from a current one
};

}  // namespace kvshard
