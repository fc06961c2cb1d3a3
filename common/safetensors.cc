#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes little-endian");

namespace fsdp8 {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

constexpr int64_t kMaxHeader = 100'000'000;  // the reference reader's limit

// Bytes per element of every safetensors dtype; 0 for unknown names.
int DtypeSize(const std::string& d) {
  static const std::map<std::string, int> kSizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"I16", 2},
      {"U16", 2},  {"F16", 2}, {"BF16", 2}, {"I32", 4},    {"U32", 4},     {"F32", 4},
      {"I64", 8},  {"U64", 8}, {"F64", 8}};
  auto it = kSizes.find(d);
  return it == kSizes.end() ? 0 : it->second;
}

// A JSON number that is a non-negative integer below 2^53 (exact in a double).
bool AsIndex(const Value& v, int64_t* out) {
  if (v.kind_case() != Value::kNumberValue) return false;
  const double d = v.number_value();
  if (!(d >= 0) || d > 9007199254740992.0 || std::floor(d) != d) return false;
  *out = static_cast<int64_t>(d);
  return true;
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);  // subnormal (or zero)
  } else if (exp == 31) {
    v = man ? std::nanf("") : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

absl::Status IoError(int err, const std::string& what) {
  const std::string msg = absl::StrCat(what, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

struct FileCloser {
  void operator()(FILE* f) const { if (f) std::fclose(f); }
};

}  // namespace

uint16_t FloatToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

const char* SafetensorsDtypeName(SafetensorsDtype d) {
  return d == SafetensorsDtype::kBF16 ? "BF16" : "F32";
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  std::unique_ptr<FILE, FileCloser> f(std::fopen(path.c_str(), "rb"));
  if (!f) return IoError(errno, absl::StrCat("opening ", path));
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(path, ": not a valid safetensors file: ", what));
  };
  if (fseeko(f.get(), 0, SEEK_END) != 0) return IoError(errno, absl::StrCat("seeking ", path));
  const int64_t size = ftello(f.get());
  fseeko(f.get(), 0, SEEK_SET);
  uint64_t n = 0;
  if (size < 8 || std::fread(&n, 8, 1, f.get()) != 1) {
    return bad(absl::StrCat("file of ", size, " bytes has no 8-byte header length"));
  }
  if (n < 2 || n > static_cast<uint64_t>(kMaxHeader) || static_cast<int64_t>(n) > size - 8) {
    return bad(absl::StrCat("header length ", n, " out of range (file is ", size,
                            " bytes, header limit ", kMaxHeader, ")"));
  }
  std::string header(n, '\0');
  if (std::fread(header.data(), 1, n, f.get()) != n) return bad("short read of the header");
  Struct root;
  google::protobuf::util::JsonParseOptions opts;
  if (auto st = google::protobuf::util::JsonStringToMessage(header, &root, opts); !st.ok()) {
    return bad(absl::StrCat("header is not a JSON object (", std::string(st.message()), ")"));
  }
  SafetensorsFile out;
  out.path_ = path;
  out.data_start_ = 8 + static_cast<int64_t>(n);
  const int64_t data_size = size - out.data_start_;
  std::vector<const SafetensorsTensor*> by_offset;
  for (const auto& [name, v] : root.fields()) {
    if (name == "__metadata__") {
      if (v.kind_case() != Value::kStructValue) return bad("__metadata__ is not an object");
      for (const auto& [k, mv] : v.struct_value().fields()) {
        if (mv.kind_case() != Value::kStringValue) {
          return bad(absl::StrCat("__metadata__ value of \"", k, "\" is not a string"));
        }
        out.metadata_[k] = mv.string_value();
      }
      continue;
    }
    const std::string where = absl::StrCat("tensor \"", name, "\"");
    if (v.kind_case() != Value::kStructValue) return bad(absl::StrCat(where, " is not an object"));
    const auto& fields = v.struct_value().fields();
    for (const auto& [k, unused] : fields) {
      if (k != "dtype" && k != "shape" && k != "data_offsets") {
        return bad(absl::StrCat(where, ": unknown field \"", k, "\""));
      }
    }
    SafetensorsTensor t;
    t.name = name;
    auto dt = fields.find("dtype");
    if (dt == fields.end() || dt->second.kind_case() != Value::kStringValue) {
      return bad(absl::StrCat(where, ": dtype missing or not a string"));
    }
    t.dtype = dt->second.string_value();
    const int esize = DtypeSize(t.dtype);
    if (esize == 0) return bad(absl::StrCat(where, ": unknown dtype \"", t.dtype, "\""));
    auto sh = fields.find("shape");
    if (sh == fields.end() || sh->second.kind_case() != Value::kListValue) {
      return bad(absl::StrCat(where, ": shape missing or not a list"));
    }
    t.numel = 1;
    for (const Value& d : sh->second.list_value().values()) {
      int64_t dim = 0;
      if (!AsIndex(d, &dim)) return bad(absl::StrCat(where, ": shape holds a non-integer or negative dimension"));
      t.shape.push_back(dim);
      if (dim != 0 && t.numel > (int64_t{1} << 53) / dim) return bad(absl::StrCat(where, ": shape too large"));
      t.numel *= dim;
    }
    auto off = fields.find("data_offsets");
    if (off == fields.end() || off->second.kind_case() != Value::kListValue ||
        off->second.list_value().values_size() != 2 ||
        !AsIndex(off->second.list_value().values(0), &t.begin) ||
        !AsIndex(off->second.list_value().values(1), &t.end) || t.end < t.begin) {
      return bad(absl::StrCat(where, ": data_offsets must be [begin, end] with 0 <= begin <= end"));
    }
    if (t.end > data_size) {
      return bad(absl::StrCat(where, ": data_offsets [", t.begin, ", ", t.end,
                              "] out of range (the data section is ", data_size, " bytes)"));
    }
    if (t.end - t.begin != t.numel * esize) {
      return bad(absl::StrCat(where, ": data_offsets [", t.begin, ", ", t.end, "] span ",
                              t.end - t.begin, " bytes, shape [", absl::StrJoin(t.shape, ", "),
                              "] of ", t.dtype, " needs ", t.numel * esize));
    }
    auto [it, unused] = out.tensors_.emplace(name, std::move(t));
    by_offset.push_back(&it->second);
  }
  std::sort(by_offset.begin(), by_offset.end(),
            [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
              return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
            });
  int64_t expect = 0;
  for (const SafetensorsTensor* t : by_offset) {
    if (t->begin != expect) {
      return bad(absl::StrCat("tensor \"", t->name, "\": data_offsets [", t->begin, ", ", t->end,
                              "] ", t->begin < expect ? "overlap the previous tensor" : "leave a gap",
                              " (expected begin ", expect, ")"));
    }
    expect = t->end;
  }
  if (expect != data_size) {
    return bad(absl::StrCat("the tensors cover ", expect, " bytes of a ", data_size,
                            "-byte data section"));
  }
  return out;
}

absl::Status SafetensorsFile::Read(const std::string& name, int64_t first, int64_t n,
                                   float* out) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor \"", name, "\""));
  }
  const SafetensorsTensor& t = it->second;
  if (first < 0 || n < 0 || first + n > t.numel) {
    return absl::OutOfRangeError(absl::StrCat(path_, ": tensor \"", name, "\" elements [", first,
                                              ", ", first + n, ") outside [0, ", t.numel, ")"));
  }
  const int esize = DtypeSize(t.dtype);
  if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16") {
    return absl::FailedPreconditionError(absl::StrCat(
        path_, ": tensor \"", name, "\" has dtype ", t.dtype, " (readable: F32, BF16, F16)"));
  }
  if (n == 0) return absl::OkStatus();
  // Only the pages of [first, first + n) are mapped, and unmapped again before returning: a
  // caller reading a large tensor in chunks never holds more than one chunk's pages.
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, absl::StrCat("opening ", path_));
  const int64_t byte0 = data_start_ + t.begin + first * esize, nbytes = n * esize;
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size < byte0 + nbytes) {
    ::close(fd);  // a file truncated since Open: a mapping past its end would fault
    return absl::DataLossError(absl::StrCat(path_, ": short read of tensor \"", name, "\""));
  }
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  const int64_t map0 = byte0 / page * page, len = byte0 + nbytes - map0;
  void* m = ::mmap(nullptr, static_cast<size_t>(len), PROT_READ, MAP_PRIVATE, fd, map0);
  const int map_errno = errno;
  ::close(fd);
  if (m == MAP_FAILED) return IoError(map_errno, absl::StrCat("mapping ", path_));
  ::madvise(m, static_cast<size_t>(len), MADV_SEQUENTIAL);
  const char* src = static_cast<const char*>(m) + (byte0 - map0);
  if (esize == 4) {
    std::memcpy(out, src, static_cast<size_t>(nbytes));
  } else {
    const bool bf16 = t.dtype == "BF16";
    for (int64_t i = 0; i < n; ++i) {
      uint16_t h;
      std::memcpy(&h, src + 2 * i, 2);
      out[i] = bf16 ? Bf16ToFloat(h) : HalfToFloat(h);
    }
  }
  ::munmap(m, static_cast<size_t>(len));
  return absl::OkStatus();
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsWriteTensor>& tensors,
                              SafetensorsDtype dtype,
                              const std::map<std::string, std::string>& metadata) {
  const int esize = dtype == SafetensorsDtype::kBF16 ? 2 : 4;
  Struct root;
  auto& meta = *(*root.mutable_fields())["__metadata__"].mutable_struct_value()->mutable_fields();
  for (const auto& [k, v] : metadata) meta[k].set_string_value(v);
  meta["format"].set_string_value("pt");
  std::set<std::string> names;
  int64_t offset = 0;
  for (const SafetensorsWriteTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": empty, reserved or duplicate tensor name \"", t.name, "\""));
    }
    int64_t numel = 1;
    Value& e = (*root.mutable_fields())[t.name];
    auto& ef = *e.mutable_struct_value()->mutable_fields();
    ef["dtype"].set_string_value(SafetensorsDtypeName(dtype));
    auto* shape = ef["shape"].mutable_list_value();
    for (int64_t d : t.shape) {
      shape->add_values()->set_number_value(static_cast<double>(d));
      numel *= d;
    }
    auto* offs = ef["data_offsets"].mutable_list_value();
    offs->add_values()->set_number_value(static_cast<double>(offset));
    offset += numel * esize;
    offs->add_values()->set_number_value(static_cast<double>(offset));
  }
  std::string header;
  if (auto st = google::protobuf::util::MessageToJsonString(root, &header); !st.ok()) {
    return absl::InternalError(absl::StrCat(path, ": header JSON: ", std::string(st.message())));
  }
  while (header.size() % 8 != 0) header.push_back(' ');

  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(errno, absl::StrCat("creating ", tmp));
  absl::Status status;
  auto write_all = [&](const void* p, size_t len) {
    const char* c = static_cast<const char*>(p);
    while (len > 0 && status.ok()) {
      const ssize_t w = ::write(fd, c, len);
      if (w < 0) {
        if (errno == EINTR) continue;
        status = IoError(errno, absl::StrCat("writing ", tmp));
        return;
      }
      c += w;
      len -= static_cast<size_t>(w);
    }
  };
  const uint64_t n = header.size();
  write_all(&n, 8);
  write_all(header.data(), header.size());
  std::vector<uint16_t> bf;
  for (const SafetensorsWriteTensor& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    constexpr int64_t kChunk = 1 << 18;
    for (int64_t i = 0; i < numel && status.ok(); i += kChunk) {
      const int64_t k = std::min(kChunk, numel - i);
      if (esize == 4) {
        write_all(t.data + i, static_cast<size_t>(k) * 4);
      } else {
        bf.resize(k);
        for (int64_t j = 0; j < k; ++j) bf[j] = FloatToBf16(t.data[i + j]);
        write_all(bf.data(), static_cast<size_t>(k) * 2);
      }
    }
  }
  if (status.ok() && ::fsync(fd) != 0) status = IoError(errno, absl::StrCat("fsync of ", tmp));
  if (::close(fd) != 0 && status.ok()) status = IoError(errno, absl::StrCat("closing ", tmp));
  if (status.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
    status = IoError(errno, absl::StrCat("renaming ", tmp, " to ", path));
  }
  if (!status.ok()) ::unlink(tmp.c_str());
  return status;
}

}  // namespace fsdp8
