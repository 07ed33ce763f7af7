// LocalKvTransport: ranks of this process. A process-wide registry maps names to the staging of
// each live transport; Send copies the piece straight into the destination's staging (a pooled
// buffer once the receiver recycles what it received: one memcpy, no allocation).
//
// The registry holds the staging by shared_ptr, so a Send that looked a destination up just
// before that transport was destroyed still writes into valid memory: the staging is closed
// (the Send gets Unavailable) and freed with its last reference.
#include <map>
#include <mutex>
#include <string_view>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"

namespace kvshard {

namespace {

using internal::KvStaging;

constexpr std::string_view kLocalPrefix = "local:";

class LocalRegistry {
  public:
    static LocalRegistry& Get() {
        static LocalRegistry* registry = new LocalRegistry();  // never destroyed: no exit races
        return *registry;
    }

    Status Add(const std::string& name, std::shared_ptr<KvStaging> staging) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!by_name_.emplace(name, std::move(staging)).second) {
            // status.h has no AlreadyExists; the caller's name is what is wrong.
            return InvalidArgument("local KV transport name '" + name + "' is already in use");
        }
        return Status::Ok();
    }

    void Remove(const std::string& name) {
        std::lock_guard<std::mutex> lock(mu_);
        by_name_.erase(name);
    }

    std::shared_ptr<KvStaging> Find(std::string_view name) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = by_name_.find(std::string(name));
        return it == by_name_.end() ? nullptr : it->second;
    }

  private:
    std::mutex mu_;
    std::map<std::string, std::shared_ptr<KvStaging>> by_name_;  // guarded by mu_
};

class LocalKvTransport final : public KvTransport {
  public:
    LocalKvTransport(std::string name, std::shared_ptr<KvStaging> staging)
        : name_(std::move(name)),
          endpoint_(std::string(kLocalPrefix) + name_),
          staging_(std::move(staging)) {}

    ~LocalKvTransport() override {
        LocalRegistry::Get().Remove(name_);
        staging_->Close();
    }

    const std::string& endpoint() const override { return endpoint_; }

    // Never blocks beyond the staging's mutex, so the deadline is not consulted.
    Status Send(const std::string& dst_endpoint, const KvPiece& piece,
                std::chrono::steady_clock::time_point deadline) override {
        KV_RETURN_IF_ERROR(ValidateKvPiece(piece));
        if (!std::string_view(dst_endpoint).starts_with(kLocalPrefix)) {
            return InvalidArgument("local KV transport " + endpoint_ + " cannot send to '" +
                                   dst_endpoint + "' (expected local:NAME)");
        }
        std::shared_ptr<KvStaging> dst =
            LocalRegistry::Get().Find(std::string_view(dst_endpoint).substr(kLocalPrefix.size()));
        if (dst == nullptr) {
            return Status(StatusCode::kUnavailable,
                          "no local KV transport at " + dst_endpoint + " (from " + endpoint_ + ")");
        }
        return dst->StageCopy(piece);
    }

    Result<std::vector<KvPiece>> Receive(uint64_t transfer_id, int64_t expected_cells,
                                         std::chrono::steady_clock::time_point deadline) override {
        return staging_->Receive(transfer_id, expected_cells, deadline);
    }

    void Discard(uint64_t transfer_id) override { staging_->Discard(transfer_id); }

    void Recycle(std::vector<KvPiece> pieces) override { staging_->Recycle(std::move(pieces)); }

    int64_t staged_bytes() const override { return staging_->staged_bytes(); }

    int64_t arriving_bytes() const override { return staging_->arriving_bytes(); }

    Status SetReceiveGeometry(const KvReceiveGeometry& geometry) override {
        return staging_->SetGeometry(geometry);
    }

  private:
    const std::string name_;
    const std::string endpoint_;
    const std::shared_ptr<KvStaging> staging_;  // shared with the registry
};

}  // namespace

Result<std::unique_ptr<KvTransport>> MakeLocalKvTransport(const std::string& name,
                                                          const KvTransportOptions& options) {
    KV_RETURN_IF_ERROR(internal::ValidateKvTransportOptions(options));
    if (name.empty()) return InvalidArgument("local KV transport: empty name");
    auto staging = std::make_shared<KvStaging>(options, std::string(kLocalPrefix) + name);
    KV_RETURN_IF_ERROR(LocalRegistry::Get().Add(name, staging));
    return std::unique_ptr<KvTransport>(
        std::make_unique<LocalKvTransport>(name, std::move(staging)));
}

}  // namespace kvshard
