// Peer access between two devices of this machine (the device layer, common/device.h; implemented
// beside it in common/cuda/device.cc and device_stub.cc). Its own header so that asking costs
// the many includers of device.h nothing.
#pragma once

namespace kvshard {

// Whether device `device` can read and write `peer`'s memory directly (NVLink or PCIe
// peer-to-peer: cudaDeviceCanAccessPeer); true for a device and itself. False when either does
// not exist, the runtime fails, or the build has no CUDA. Never fails.
bool DevicesCanAccessPeer(int device, int peer);

}  // namespace kvshard
