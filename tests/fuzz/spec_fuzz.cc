// libFuzzer target for the job spec parser (common/spec.h): arbitrary bytes as YAML/JSON spec text.
// Whatever the input, ParseSpec must return a spec or INVALID_ARGUMENT (never crash, hang, leak or
// hit undefined behaviour under ASan/UBSan), and a parsed spec must go through WithDefaults and
// ValidateSpec (rules only, no files) the same way.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<fsdp8::v1::JobSpec> spec = fsdp8::ParseSpec(text);
  if (!spec.ok()) {
    if (spec.status().code() != absl::StatusCode::kInvalidArgument) abort();
    return 0;
  }
  for (int world_size : {0, 1, 3}) {
    const absl::Status s = fsdp8::ValidateSpec(*spec, world_size, {}, /*check_files=*/false);
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) abort();
  }
  return 0;
}
