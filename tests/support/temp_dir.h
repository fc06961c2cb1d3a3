// A fresh temporary directory for one test or one test suite, removed at destruction.
#pragma once

#include <stdlib.h>

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp8::testing {

class TempDir {
 public:
  enum class Cleanup {
    kAlways,
    // Kept for a person to read (logs, checkpoints) when the current test, or at suite scope the
    // suite's SetUpTestSuite/TearDownTestSuite, has failed (::testing::Test::HasFailure()).
    kUnlessFailed,
  };

  // Creates <system temp dir>/<prefix>-XXXXXX (mkdtemp); path() is "" when that failed.
  explicit TempDir(const std::string& prefix = "fsdp8-test", Cleanup cleanup = Cleanup::kAlways)
      : cleanup_(cleanup) {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    if (mkdtemp(buf.data()) != nullptr) path_ = buf.data();
  }
  ~TempDir() {
    if (path_.empty()) return;
    if (cleanup_ == Cleanup::kUnlessFailed && ::testing::Test::HasFailure()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::string& path() const { return path_; }
  // path()/name.
  std::string File(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
  Cleanup cleanup_;
};

}  // namespace fsdp8::testing
