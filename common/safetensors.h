// safetensors files (the Hugging Face weight format): an 8-byte little-endian header length N, N
// bytes of JSON header, then the raw tensor data. The header maps each tensor name to
//   {"dtype": "F32" | "BF16" | ..., "shape": [d0, d1, ...], "data_offsets": [begin, end]}
// (byte offsets relative to the start of the data section) and may hold "__metadata__", a
// string-to-string map. The JSON is parsed and printed with protobuf's JSON support
// (google.protobuf.Struct); the rest is here.
//
// Rules checked on open (those of the reference reader): N >= 2 and 8 + N <= file size, N <= 100 MB;
// the header is a JSON object; every tensor entry has exactly dtype (a safetensors dtype name),
// shape (non-negative integers) and data_offsets (two integers, begin <= end); end - begin equals
// numel x dtype size; sorted by begin, the tensors cover the data section exactly (no gap, no
// overlap, nothing after the last one). Any violation is DATA_LOSS naming the file and the tensor.
//
// Values are read as f32 from F32, BF16 and F16 tensors (FAILED_PRECONDITION for other dtypes).
// Writing produces F32 or BF16 (round to nearest even) tensors in the given order, the header
// padded with spaces to a multiple of 8 bytes, {"format": "pt"} in __metadata__ (transformers
// requires it); the file is written to PATH.tmp, fsynced and renamed.
//
// Thread-safety: a SafetensorsFile is immutable after Open; Read may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fsdp8 {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;            // "F32", "BF16", "F16", "I64", ...
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t begin = 0, end = 0;   // byte offsets in the data section
};

class SafetensorsFile {
 public:
  // Opens and validates `path` (see the rules above). NOT_FOUND when missing.
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Elements [first, first + n) (row-major) of tensor `name` converted to f32 into out[0..n).
  // Only those bytes' pages are memory-mapped, and unmapped before returning (read a large tensor
  // in chunks to bound the resident memory).
  // NOT_FOUND for an unknown tensor, OUT_OF_RANGE for a range outside the tensor,
  // FAILED_PRECONDITION for a dtype other than F32 / BF16 / F16, DATA_LOSS for a short file.
  absl::Status Read(const std::string& name, int64_t first, int64_t n, float* out) const;

 private:
  std::string path_;
  int64_t data_start_ = 0;  // 8 + N
  std::map<std::string, SafetensorsTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

enum class SafetensorsDtype { kF32, kBF16 };
const char* SafetensorsDtypeName(SafetensorsDtype d);  // "F32", "BF16"

struct SafetensorsWriteTensor {
  std::string name;
  std::vector<int64_t> shape;
  const float* data = nullptr;  // product(shape) f32 values
};

// Writes `tensors` (in this order) as `dtype` to `path`. `metadata` is added to __metadata__
// (with "format": "pt"). INVALID_ARGUMENT for an empty or duplicate name or "__metadata__";
// I/O errors name the file and leave no file at `path` written by this call.
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsWriteTensor>& tensors,
                              SafetensorsDtype dtype,
                              const std::map<std::string, std::string>& metadata = {});

// f32 -> bf16 bits, round to nearest even (NaN stays NaN); bf16 bits -> f32 (exact).
uint16_t FloatToBf16(float x);
float Bf16ToFloat(uint16_t b);

}  // namespace fsdp8
