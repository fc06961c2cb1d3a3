// NVLink placement domains from NVML (worker/nvlink_domain.h).
#include "worker/nvlink_domain.h"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/device_memory.h"

namespace fsdp8 {
namespace {

// The few NVML types and entry points used here, declared as nvml.h (CUDA toolkit) declares them:
// the worker neither includes nor links NVML, so that it builds and starts without the driver.
using nvmlReturn_t = int;
constexpr nvmlReturn_t kNvmlSuccess = 0;
struct nvmlDevice_st;
using nvmlDevice_t = nvmlDevice_st*;
constexpr int kNvmlFeatureEnabled = 1;        // nvmlEnableState_t NVML_FEATURE_ENABLED
constexpr int kNvmlNvLinkDeviceGpu = 0;       // nvmlIntNvLinkDeviceType_t
constexpr int kNvmlNvLinkDeviceSwitch = 2;
constexpr unsigned kNvmlNvLinkMaxLinks = 18;  // NVML_NVLINK_MAX_LINKS
struct nvmlPciInfo_t {                        // nvmlPciInfo_st (NVML 2.285 and later)
  char busIdLegacy[16];
  unsigned int domain;
  unsigned int bus;
  unsigned int device;
  unsigned int pciDeviceId;
  unsigned int pciSubSystemId;
  char busId[32];
};

struct Nvml {
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*shutdown)() = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;
  nvmlReturn_t (*handle_by_bus_id)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*link_state)(nvmlDevice_t, unsigned, int*) = nullptr;
  nvmlReturn_t (*remote_pci)(nvmlDevice_t, unsigned, nvmlPciInfo_t*) = nullptr;
  nvmlReturn_t (*remote_type)(nvmlDevice_t, unsigned, int*) = nullptr;  // may be absent

  std::string Error(nvmlReturn_t r) const {
    const char* s = error_string ? error_string(r) : nullptr;
    return s ? std::string(s) : absl::StrCat("NVML error ", r);
  }
};

template <typename F>
bool Resolve(void* lib, const char* name, F* fn) {
  *fn = reinterpret_cast<F>(dlsym(lib, name));
  return *fn != nullptr;
}

// The records of the device's links 0 .. NVML_NVLINK_MAX_LINKS - 1. A link whose state cannot be
// read (NVML_ERROR_NOT_SUPPORTED, an index past the device's links) counts as inactive. Without
// nvmlDeviceGetNvLinkRemoteDeviceType (older drivers) the far end is a GPU when NVML knows a GPU
// at its bus id, else a switch.
std::vector<NvLinkRecord> WalkLinks(const Nvml& nvml, nvmlDevice_t dev) {
  std::vector<NvLinkRecord> out;
  for (unsigned link = 0; link < kNvmlNvLinkMaxLinks; ++link) {
    int state = 0;
    if (nvml.link_state(dev, link, &state) != kNvmlSuccess) continue;
    NvLinkRecord rec;
    rec.link = static_cast<int>(link);
    rec.active = state == kNvmlFeatureEnabled;
    nvmlPciInfo_t pci{};
    if (rec.active && nvml.remote_pci(dev, link, &pci) != kNvmlSuccess) rec.active = false;
    if (!rec.active) {
      out.push_back(rec);
      continue;
    }
    char buf[64];
    std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.0", pci.domain, pci.bus, pci.device);
    rec.peer_bus_id = pci.busId[0] != '\0' ? std::string(pci.busId) : std::string(buf);
    int type = -1;
    if (nvml.remote_type != nullptr && nvml.remote_type(dev, link, &type) == kNvmlSuccess) {
      rec.peer = type == kNvmlNvLinkDeviceGpu      ? NvLinkPeerKind::kGpu
                 : type == kNvmlNvLinkDeviceSwitch ? NvLinkPeerKind::kSwitch
                                                   : NvLinkPeerKind::kOther;
    } else {
      nvmlDevice_t peer = nullptr;
      rec.peer = nvml.handle_by_bus_id(rec.peer_bus_id.c_str(), &peer) == kNvmlSuccess
                     ? NvLinkPeerKind::kGpu
                     : NvLinkPeerKind::kSwitch;
    }
    out.push_back(rec);
  }
  return out;
}

// "NVML: N active NVLink(s) to ...", for the log line.
std::string Describe(const std::vector<NvLinkRecord>& links) {
  int active = 0;
  std::set<std::string> gpus, switches;
  for (const NvLinkRecord& r : links) {
    if (!r.active) continue;
    ++active;
    if (r.peer == NvLinkPeerKind::kGpu) gpus.insert(NormalizePciBusId(r.peer_bus_id));
    if (r.peer == NvLinkPeerKind::kSwitch) switches.insert(NormalizePciBusId(r.peer_bus_id));
  }
  if (links.empty()) return "NVML: the device reports no NVLinks";
  if (active == 0) return absl::StrCat("NVML: no active NVLink (", links.size(), " link(s) down)");
  return absl::StrCat("NVML: ", active, " active NVLink(s) to ", switches.size(),
                      " NVSwitch(es) and ", gpus.size(), " GPU(s)");
}

}  // namespace

std::string NormalizePciBusId(const std::string& bus_id) {
  unsigned domain = 0, bus = 0, device = 0, function = 0;
  char tail = 0;
  std::string lower = bus_id;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (std::sscanf(lower.c_str(), "%x:%x:%x.%x%c", &domain, &bus, &device, &function, &tail) != 4) {
    return lower;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.%x", domain, bus, device, function);
  return buf;
}

std::string NvLinkDomainName(const std::string& own_bus_id, const std::vector<NvLinkRecord>& links) {
  std::set<std::string> switches, gpus;
  for (const NvLinkRecord& r : links) {
    if (!r.active) continue;
    if (r.peer == NvLinkPeerKind::kSwitch) switches.insert(NormalizePciBusId(r.peer_bus_id));
    if (r.peer == NvLinkPeerKind::kGpu) gpus.insert(NormalizePciBusId(r.peer_bus_id));
  }
  if (!switches.empty()) return absl::StrCat("nvswitch:", absl::StrJoin(switches, ","));
  if (gpus.empty()) return "";
  gpus.insert(NormalizePciBusId(own_bus_id));
  return absl::StrCat("nvlink:", absl::StrJoin(gpus, ","));
}

NvLinkDomain DetectNvLinkDomain(const std::string& bus_id, const std::string& library) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    return {"", absl::StrCat("NVML not loaded (", err ? err : library, ")")};
  }
  Nvml nvml;
  Resolve(lib, "nvmlErrorString", &nvml.error_string);
  Resolve(lib, "nvmlDeviceGetNvLinkRemoteDeviceType", &nvml.remote_type);
  const char* missing = !Resolve(lib, "nvmlInit_v2", &nvml.init)              ? "nvmlInit_v2"
                        : !Resolve(lib, "nvmlShutdown", &nvml.shutdown)       ? "nvmlShutdown"
                        : !Resolve(lib, "nvmlDeviceGetHandleByPciBusId_v2", &nvml.handle_by_bus_id)
                            ? "nvmlDeviceGetHandleByPciBusId_v2"
                        : !Resolve(lib, "nvmlDeviceGetNvLinkState", &nvml.link_state)
                            ? "nvmlDeviceGetNvLinkState"
                        : !Resolve(lib, "nvmlDeviceGetNvLinkRemotePciInfo_v2", &nvml.remote_pci)
                            ? "nvmlDeviceGetNvLinkRemotePciInfo_v2"
                            : nullptr;
  NvLinkDomain out;
  if (missing != nullptr) {
    out.how = absl::StrCat(library, " lacks ", missing);
  } else if (nvmlReturn_t r = nvml.init(); r != kNvmlSuccess) {
    out.how = absl::StrCat("nvmlInit_v2: ", nvml.Error(r));
  } else {
    nvmlDevice_t dev = nullptr;
    r = nvml.handle_by_bus_id(bus_id.c_str(), &dev);
    if (r != kNvmlSuccess) {
      out.how = absl::StrCat("nvmlDeviceGetHandleByPciBusId_v2(", bus_id, "): ", nvml.Error(r));
    } else {
      const std::vector<NvLinkRecord> links = WalkLinks(nvml, dev);
      out.name = NvLinkDomainName(bus_id, links);
      out.how = Describe(links);
    }
    nvml.shutdown();
  }
  dlclose(lib);
  return out;
}

NvLinkDomain DetectCudaNvLinkDomain(int cuda_device, const std::string& library) {
#ifdef FSDP8_WITH_CUDA
  std::string err;
  const std::string bus_id = CudaDevicePciBusId(cuda_device, &err);
  if (bus_id.empty()) return {"", err};
  NvLinkDomain d = DetectNvLinkDomain(bus_id, library);
  d.how = absl::StrCat("GPU ", cuda_device, " at ", NormalizePciBusId(bus_id), ": ", d.how);
  return d;
#else
  (void)library;
  return {"", absl::StrCat("GPU ", cuda_device, ": the cuda backend is not built")};
#endif
}

}  // namespace fsdp8
