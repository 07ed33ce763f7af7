#!/usr/bin/env python3
"""Writes the seed corpus of kvshard_kv_wire_fuzz (comm/fuzz/kv_wire_fuzz.cc) in wire version 4.

    comm/fuzz/make_kv_wire_corpus.py [OUT_DIR]     # default: comm/fuzz/corpus/kv_wire

Each seed is the byte stream a receiving connection sees (a hello, then transfer, piece, offer and
chunk frames), or an acknowledgement frame alone, laid out as comm/tcp_kv_wire.h says. Payload
hashes are XXH3-64, computed with the system's libxxhash (the library the transport links), so
the seeds that should pass the hash check do. Run it again whenever the wire version or a frame
changes; the fuzzer stops at the version check of any seed of another version.
"""
import ctypes
import ctypes.util
import os
import struct
import sys

VERSION = 4
IN_REGION = 1
UNCREDITED = 2
F32, INT8, FP8 = 0, 1, 2

# The fuzzer's receive geometry (Geometry() in kv_wire_fuzz.cc): 4 layers, KV heads [1, 3),
# block_size 4, head_dim 8, f32, 8 blocks.
LAYERS, HEAD_BEGIN, HEAD_END, BLOCK_SIZE, HEAD_DIM, BLOCKS = 4, 1, 3, 4, 8, 8

# Status codes on the wire (WireCode in tcp_kv_wire.cc).
OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ABORTED = 0, 1, 6, 9


def _xxh3_library():
    for name in ("libxxhash.so.0", ctypes.util.find_library("xxhash")):
        if name:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            lib.XXH3_64bits.restype = ctypes.c_uint64
            lib.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
            return lib
    sys.exit("make_kv_wire_corpus: libxxhash not found (Debian: libxxhash0)")


XXH3 = _xxh3_library()


def xxh3(data: bytes) -> int:
    return XXH3.XXH3_64bits(data, len(data))


def element_bytes(dtype):
    return 4 if dtype == F32 else 1


def piece_bytes(layers, heads, blocks, dtype=F32, block_size=BLOCK_SIZE, head_dim=HEAD_DIM):
    per_layer = 2 * heads * block_size * head_dim * element_bytes(dtype)
    if dtype != F32:
        per_layer += 2 * heads * block_size * 4
    return blocks * layers * per_layer


def hello(token=b""):
    return b"KVSH" + struct.pack("<HH", VERSION, len(token)) + token


def transfer(transfer_id):
    return b"KVST" + struct.pack("<HHQ", VERSION, 0, transfer_id)


def piece_header(transfer_id, layer_begin, layer_end, head_begin, head_end, blocks,
                 payload_bytes, payload_hash, dtype=F32, flags=0, block_size=BLOCK_SIZE,
                 head_dim=HEAD_DIM):
    return b"KVSP" + struct.pack("<HBBQiiiiiiiQQ", VERSION, dtype, flags, transfer_id, layer_begin,
                                 layer_end, head_begin, head_end, blocks, block_size, head_dim,
                                 payload_bytes, payload_hash)


def payload(n, seed):
    return bytes((seed + 7 * i) & 0xFF for i in range(n))


def piece(transfer_id, layer_begin=0, layer_end=1, blocks=1, seed=0, **kw):
    """A piece that fits the fuzzer's pool, with its payload and correct hash."""
    n = piece_bytes(layer_end - layer_begin, HEAD_END - HEAD_BEGIN, blocks)
    data = payload(n, seed)
    return piece_header(transfer_id, layer_begin, layer_end, HEAD_BEGIN, HEAD_END, blocks, n,
                        xxh3(data), **kw) + data


def offer(name, region_bytes):
    return b"KVSM" + struct.pack("<HHQ", VERSION, len(name), region_bytes) + name


def chunk(region_offset, n, chunk_hash):
    return b"KVSC" + struct.pack("<HHQQQ", VERSION, 0, region_offset, n, chunk_hash)


def credit(region_offset):
    return b"KVSF" + struct.pack("<HHQI", VERSION, 0, region_offset, 0)


def ack(transfer_id, code, message=b""):
    return b"KVSA" + struct.pack("<HHQI", VERSION, code, transfer_id, len(message)) + message


def seeds():
    one = piece_bytes(1, 2, 1)
    yield "ack_ok", ack(7, OK)
    yield "ack_refused", ack(9, INVALID_ARGUMENT,
                             b"KV piece of transfer 9: num_blocks=4026531, this pool has 8")
    yield "ack_full", ack(3, RESOURCE_EXHAUSTED, b"KV staging of 127.0.0.1:1 is full")
    yield "ack_boot_id", ack(0, OK, b"0b5c3d1e-7f00-4a2b-9c3d-1e2f3a4b5c6d")
    # A layer-wise handoff: one piece per layer, all of them fitting the pool.
    yield "handoff", (hello() + transfer(7) +
                      b"".join(piece(7, layer, layer + 1, blocks=2, seed=layer)
                               for layer in range(LAYERS)))
    yield "token", hello(b"tok") + transfer(8) + piece(8, 0, 4, blocks=1, seed=3)
    # A header claiming a payload far larger than the pool: refused before anything is allocated.
    yield "huge_claim", (hello() + transfer(9) +
                         piece_header(9, 0, 1, HEAD_BEGIN, HEAD_END, 0xF5C2A3, one * 0xF5C2A3, 0))
    # Not one of the piece's header: DataLoss.
    yield "length_mismatch", (hello() + transfer(12) +
                              piece_header(12, 0, 1, HEAD_BEGIN, HEAD_END, 1, one + 1, 0) +
                              payload(one + 1, 12))
    yield "wrong_dtype", (hello() + transfer(11) +
                          piece_header(11, 0, 1, HEAD_BEGIN, HEAD_END, 1,
                                       piece_bytes(1, 2, 1, INT8), 0, dtype=INT8) +
                          payload(piece_bytes(1, 2, 1, INT8), 11))
    yield "unnamed", hello() + piece(10, seed=10)
    # The same piece twice (a resend), then a second transfer on the same connection.
    yield "resend_two_transfers", (hello() + transfer(13) + piece(13, seed=1) + piece(13, seed=1) +
                                   transfer(14) + piece(14, 1, 2, seed=2))
    # More than the pool holds: the later pieces are refused (ResourceExhausted) and drained.
    yield "staging_full", (hello() + transfer(15) +
                           b"".join(piece(15, 0, LAYERS, blocks=BLOCKS, seed=s) for s in range(3)))
    yield "bad_hash", hello() + transfer(16) + piece(16, seed=16)[:-1] + b"\x00"
    yield "unknown_flags", (hello() + transfer(17) +
                            piece_header(17, 0, 1, HEAD_BEGIN, HEAD_END, 1, one, 0, flags=4))
    yield "uncredited_alone", (hello() + transfer(18) +
                               piece_header(18, 0, 1, HEAD_BEGIN, HEAD_END, 1, one, 0,
                                            flags=UNCREDITED))
    # The shared-memory frames: an offer (the fuzzer maps no region, so the stream ends there),
    # a region piece on a connection without one, and a chunk outside any piece.
    yield "offer", hello() + offer(b"/kvshard-kv-1f-3-0123456789abcdef", 16 << 20)
    yield "region_piece", (hello() + transfer(19) +
                           piece_header(19, 0, 1, HEAD_BEGIN, HEAD_END, 1, one, 0,
                                        flags=IN_REGION | UNCREDITED) +
                           chunk(0, one, xxh3(payload(one, 19))))
    yield "chunk_outside_piece", hello() + chunk(4096, 512, 0)
    yield "credit", credit(1 << 20)
    # The previous version's hello: Unimplemented.
    yield "old_version", b"KVSH" + struct.pack("<HH", 3, 0) + transfer(1)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "corpus", "kv_wire")
    os.makedirs(out, exist_ok=True)
    for name, data in seeds():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
    print(f"make_kv_wire_corpus: wrote {sum(1 for _ in seeds())} seeds to {out}")


if __name__ == "__main__":
    main()
