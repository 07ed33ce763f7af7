// A quantized weight matrix for the CPU matmul tests: random blocks (fp16 scales of a model's
// magnitude, random quants) in the stored layout, and its interleaved copy (InterleaveRows), with
// `stored.interleaved` pointing at the copy when the matrix has a whole group of rows.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu_matmul.h"

namespace kvshard::cpu {

struct InterleavedTestMatrix {
    InterleavedTestMatrix(DType dtype, int64_t rows, int64_t cols, uint32_t seed)
        : bytes(RowBytes(dtype, cols) * static_cast<size_t>(rows)) {
        std::mt19937 gen(seed);
        std::uniform_real_distribution<float> scale(0.002f, 0.05f);
        std::uniform_real_distribution<float> min(-0.2f, 0.2f);
        std::uniform_int_distribution<int> byte(0, 255);
        const size_t block = BlockBytes(dtype);
        const size_t halves = dtype == DType::kQ4_1 ? 2 : 1;
        for (size_t at = 0; at < bytes.size(); at += block) {
            const uint16_t d = FloatToHalf(scale(gen));
            std::memcpy(&bytes[at], &d, 2);
            if (halves == 2) {
                const uint16_t m = FloatToHalf(min(gen));
                std::memcpy(&bytes[at + 2], &m, 2);
            }
            for (size_t i = 2 * halves; i < block; ++i) bytes[at + i] = uint8_t(byte(gen));
        }
        stored = {.dtype = dtype, .data = bytes.data(), .rows = rows, .cols = cols};
        copy.resize(InterleavedBytes(stored));
        if (!copy.empty()) {
            InterleaveRows(stored, copy.data());
            stored.interleaved = copy.data();
        }
    }
    std::vector<uint8_t> bytes;
    std::vector<uint8_t> copy;
    StoredMatrix stored;
};

}  // namespace kvshard::cpu
