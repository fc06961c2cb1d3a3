#include "common/env_settings.h"

#include <cstdlib>

namespace fsdp8::env {

std::optional<std::string> Get(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

std::string GetOrEmpty(const char* name) { return Get(name).value_or(""); }

bool IsOn(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

}  // namespace fsdp8::env
