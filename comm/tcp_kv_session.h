// The receiving side of one TCP KV connection: the hello, then transfer and piece frames, each
// piece checked, staged and acknowledged (docs/comm.md, "Hostile peers"). Internal to comm/: the
// TCP KV transport (tcp_kv_transport.cc) starts one per accepted connection on its I/O thread.
//
// Thread-safety: everything here runs on the transport's I/O thread (and its destructor, once
// that thread has stopped).
#pragma once

// clang-format off
#include <utility>  // Boost 1.74's asio needs it first
#include <boost/asio.hpp>
// clang-format on

#include <memory>
#include <set>

#include "comm/kv_staging.h"
#include "comm/kv_transport.h"
#include "common/clock.h"

namespace kvshard::internal {

class TcpKvSession;
// The sessions a transport has open. Ownership: a session is held by this set and by its pending
// operations; it leaves the set when its connection ends.
using TcpKvSessions = std::set<std::shared_ptr<TcpKvSession>>;

// Serves `socket` until the peer closes it, breaks the protocol or stalls: the session adds itself
// to `*live` and removes itself when it ends, giving back whatever it reserved in `*staging`.
// REQUIRES: `staging`, `options` and `live` outlive every session (the transport joins its I/O
// thread, which runs the sessions' last handlers, before destroying them).
void StartTcpKvSession(boost::asio::ip::tcp::socket socket, KvStaging* staging,
                       const KvTransportOptions* options, TcpKvSessions* live);

// Closes every session's connection; each then ends (its pending operations complete with
// operation_aborted on the I/O thread).
void CloseTcpKvSessions(const TcpKvSessions& live);

// On a virtual KvTransportOptions::clock, which moved to `now`: ends every session whose
// deadline (read_timeout_ms or idle_timeout_ms from when it was armed) is `now` or earlier, as
// its timer would on the real clock. I/O thread.
void ExpireTcpKvSessions(const TcpKvSessions& live, Clock::time_point now);

}  // namespace kvshard::internal
