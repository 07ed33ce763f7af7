#include "model/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

namespace kvshard {
namespace {

using nlohmann::json;

// The reference implementation refuses headers above 100 MB; so do we, before parsing.
constexpr uint64_t kMaxHeaderBytes = 100u << 20;

size_t ElementBytes(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

std::optional<DType> ParseDType(const std::string& s) {
    if (s == "F32") return DType::kF32;
    if (s == "F16") return DType::kF16;
    if (s == "BF16") return DType::kBF16;
    return std::nullopt;
}

// Reads a non-negative JSON integer into `out`.
bool GetUnsigned(const json& j, uint64_t* out) {
    if (j.is_number_unsigned()) {
        *out = j.get<uint64_t>();
        return true;
    }
    if (j.is_number_integer() && j.get<int64_t>() >= 0) {
        *out = static_cast<uint64_t>(j.get<int64_t>());
        return true;
    }
    return false;
}

}  // namespace

std::string_view SafetensorsDTypeName(DType dtype) {
    KV_CHECK(dtype == DType::kF32 || dtype == DType::kF16 || dtype == DType::kBF16)
        << DTypeName(dtype);
    return DTypeName(dtype);
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
    KV_ASSIGN_OR_RETURN(MappedFile mapped, MappedFile::Open(path));
    std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
    file->file_ = std::move(mapped);
    KV_RETURN_IF_ERROR(file->Parse());
    return file;
}

Status SafetensorsFile::Parse() {
    const std::string& p = file_.path();
    const uint64_t size = file_.size();
    if (size < 8) return DataLoss(p + ": file truncated: " + std::to_string(size) + " bytes");
    uint64_t header_len = 0;
    std::memcpy(&header_len, file_.data(), 8);
    if (header_len > kMaxHeaderBytes || header_len > size - 8) {
        return DataLoss(p + ": header length " + std::to_string(header_len) +
                        " does not fit in the file of " + std::to_string(size) + " bytes");
    }
    const char* header = reinterpret_cast<const char*>(file_.data() + 8);
    if (header_len < 2 || header[0] != '{') {
        return DataLoss(p + ": header is not a JSON object");
    }
    json root;
    try {
        root = json::parse(header, header + header_len);
    } catch (const json::exception& e) {
        return DataLoss(p + ": header is not valid JSON: " + e.what());
    }
    if (!root.is_object()) return DataLoss(p + ": header is not a JSON object");

    const uint64_t data_begin = 8 + header_len;
    const uint64_t data_size = size - data_begin;
    for (const auto& [name, entry] : root.items()) {
        if (name == "__metadata__") {
            if (entry.is_object()) {
                for (const auto& [k, v] : entry.items()) {
                    if (v.is_string()) metadata_[k] = v.get<std::string>();
                }
            }
            continue;
        }
        const std::string what = p + ": tensor '" + name + "'";
        if (!entry.is_object()) return DataLoss(what + ": entry is not an object");
        auto dtype_it = entry.find("dtype");
        auto shape_it = entry.find("shape");
        auto offsets_it = entry.find("data_offsets");
        if (dtype_it == entry.end() || !dtype_it->is_string()) {
            return DataLoss(what + ": missing or non-string 'dtype'");
        }
        if (shape_it == entry.end() || !shape_it->is_array() || shape_it->size() > 8) {
            return DataLoss(what + ": missing or invalid 'shape'");
        }
        if (offsets_it == entry.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
            return DataLoss(what + ": missing or invalid 'data_offsets'");
        }
        const std::string dtype_name = dtype_it->get<std::string>();
        std::optional<DType> dtype = ParseDType(dtype_name);
        if (!dtype) {
            return Unimplemented(what + " has dtype " + dtype_name +
                                 ", which kvshard does not read (F32, F16, BF16 are supported)");
        }
        TensorInfo t;
        t.name = name;
        t.dtype = *dtype;
        uint64_t num_elements = 1;
        for (const json& d : *shape_it) {
            uint64_t dim = 0;
            if (!GetUnsigned(d, &dim) ||
                dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
                __builtin_mul_overflow(num_elements, dim, &num_elements) ||
                num_elements > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
                return DataLoss(what + ": invalid shape " + shape_it->dump());
            }
            t.shape.push_back(static_cast<int64_t>(dim));
        }
        uint64_t begin = 0;
        uint64_t end = 0;
        if (!GetUnsigned((*offsets_it)[0], &begin) || !GetUnsigned((*offsets_it)[1], &end) ||
            begin > end || end > data_size) {
            return DataLoss(what + ": data_offsets " + offsets_it->dump() +
                            " lie outside the data section of " + std::to_string(data_size) +
                            " bytes");
        }
        uint64_t expected = 0;
        if (__builtin_mul_overflow(num_elements, ElementBytes(t.dtype), &expected) ||
            expected != end - begin) {
            return DataLoss(what + ": data_offsets span " + std::to_string(end - begin) +
                            " bytes, its shape and dtype need " +
                            std::to_string(num_elements * ElementBytes(t.dtype)));
        }
        t.data = file_.data() + data_begin + begin;
        t.num_bytes = end - begin;
        tensors_.push_back(std::move(t));
    }
    std::sort(tensors_.begin(), tensors_.end(),
              [](const TensorInfo& a, const TensorInfo& b) { return a.data < b.data; });
    for (size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
    return Status::Ok();
}

const TensorInfo* SafetensorsFile::FindTensor(std::string_view name) const {
    auto it = index_.find(std::string(name));
    return it == index_.end() ? nullptr : &tensors_[it->second];
}

Result<std::unique_ptr<SafetensorsModel>> SafetensorsModel::Open(const std::string& path) {
    namespace fs = std::filesystem;
    std::unique_ptr<SafetensorsModel> model(new SafetensorsModel());
    model->path_ = path;
    const bool is_index = path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0;
    if (!is_index) {
        KV_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
        model->shards_.push_back(std::move(file));
    } else {
        KV_ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
        json root;
        try {
            root = json::parse(text);
        } catch (const json::exception& e) {
            return DataLoss(path + ": not valid JSON: " + e.what());
        }
        auto map_it = root.is_object() ? root.find("weight_map") : root.end();
        if (map_it == root.end() || !map_it->is_object()) {
            return DataLoss(path + ": no 'weight_map' object");
        }
        // Shards in sorted order, so tensors and errors come out the same on every run.
        std::map<std::string, std::vector<std::string>> names_by_shard;
        for (const auto& [name, shard] : map_it->items()) {
            if (!shard.is_string()) {
                return DataLoss(path + ": weight_map entry '" + name + "' is not a file name");
            }
            const std::string shard_name = shard.get<std::string>();
            const fs::path shard_path(shard_name);
            const bool escapes = std::any_of(shard_path.begin(), shard_path.end(),
                                             [](const fs::path& c) { return c == ".."; });
            if (shard_name.empty() || shard_path.is_absolute() || escapes) {
                return DataLoss(path + ": weight_map entry '" + name + "' names shard '" +
                                shard_name + "' outside the model folder");
            }
            names_by_shard[shard_name].push_back(name);
        }
        const fs::path dir = fs::path(path).parent_path();
        for (const auto& [shard_name, names] : names_by_shard) {
            KV_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open((dir / shard_name).string()));
            for (const std::string& name : names) {
                if (file->FindTensor(name) == nullptr) {
                    return DataLoss(path + ": tensor '" + name + "' is mapped to " + file->path() +
                                    ", which does not contain it");
                }
            }
            model->shards_.push_back(std::move(file));
        }
    }
    for (size_t s = 0; s < model->shards_.size(); ++s) {
        for (const TensorInfo& t : model->shards_[s]->tensors()) {
            if (!model->index_.emplace(t.name, std::make_pair(s, &t)).second) {
                return DataLoss(path + ": tensor '" + t.name + "' is stored in two shards");
            }
        }
    }
    return model;
}

const TensorInfo* SafetensorsModel::FindTensor(std::string_view name) const {
    auto it = index_.find(std::string(name));
    return it == index_.end() ? nullptr : it->second.second;
}

std::vector<std::string> SafetensorsModel::TensorNames() const {
    std::vector<std::string> names;
    names.reserve(index_.size());
    for (const auto& [name, where] : index_) names.push_back(name);
    std::sort(names.begin(), names.end());
    return names;
}

std::string SafetensorsModel::FileOf(std::string_view name) const {
    auto it = index_.find(std::string(name));
    return it == index_.end() ? "" : shards_[it->second.first]->path();
}

uint64_t SafetensorsDataBytes(const SafetensorsWriteEntry& entry) {
    uint64_t n = ElementBytes(entry.dtype);
    for (int64_t d : entry.shape) n *= static_cast<uint64_t>(d);
    return n;
}

Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsWriteEntry>& entries,
                        const std::vector<std::pair<std::string, std::string>>& metadata) {
    json header = json::object();
    if (!metadata.empty()) {
        json meta = json::object();
        for (const auto& [k, v] : metadata) meta[k] = v;
        header["__metadata__"] = meta;
    }
    uint64_t offset = 0;
    for (const SafetensorsWriteEntry& e : entries) {
        const uint64_t bytes = SafetensorsDataBytes(e);
        header[e.name] = {{"dtype", std::string(SafetensorsDTypeName(e.dtype))},
                          {"shape", e.shape},
                          {"data_offsets", {offset, offset + bytes}}};
        offset += bytes;
    }
    std::string text = header.dump();
    text.resize((text.size() + 7) / 8 * 8, ' ');  // keeps the data 8-byte aligned

    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    if (!out) return NotFound(path + ": cannot create");
    const uint64_t header_len = text.size();
    out.write(reinterpret_cast<const char*>(&header_len), 8);
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    std::vector<uint8_t> buffer;
    for (const SafetensorsWriteEntry& e : entries) {
        buffer.assign(SafetensorsDataBytes(e), 0);
        e.fill(buffer.data());
        out.write(reinterpret_cast<const char*>(buffer.data()),
                  static_cast<std::streamsize>(buffer.size()));
        if (!out) break;
    }
    out.close();
    if (!out) return Internal(path + ": write failed");
    return Status::Ok();
}

}  // namespace kvshard
