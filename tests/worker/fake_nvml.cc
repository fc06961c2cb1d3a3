// A stand-in for libnvidia-ml.so.1 with a fixed topology, loaded by NvLinkDomain tests through
// DetectNvLinkDomain's dlopen: the entry points the worker resolves, with nvml.h's C signatures
// (a layout-compatible nvmlPciInfo_t), over two GPUs:
//   0000:18:00.0: link 0 -> NVSwitch 0000:06:00.0, link 1 -> NVSwitch 0000:05:00.0, link 2 down,
//                 link 3 -> GPU 0000:2a:00.0
//   0000:2a:00.0: link 0 -> GPU 0000:18:00.0, link 1 -> GPU 0000:3a:00.0 (not known to NVML),
//                 link 2 -> an IBM NPU at 0000:77:00.0
// Links past 3 are NVML_ERROR_NOT_SUPPORTED. fake_nvml_open_count() says how many nvmlInit_v2
// calls have no nvmlShutdown yet.
#include <cstdio>
#include <cstring>

namespace {

struct Device {
  const char* bus_id;
  struct Link {
    int active;
    int type;  // 0 GPU, 1 IBM NPU, 2 switch
    unsigned domain, bus, device;
  } links[4];
};

Device g_devices[2] = {
    {"00000000:18:00.0", {{1, 2, 0, 0x06, 0}, {1, 2, 0, 0x05, 0}, {0, 2, 0, 0x07, 0}, {1, 0, 0, 0x2a, 0}}},
    {"00000000:2A:00.0", {{1, 0, 0, 0x18, 0}, {1, 0, 0, 0x3a, 0}, {1, 1, 0, 0x77, 0}, {0, 0, 0, 0, 0}}},
};
int g_open = 0;

constexpr int kSuccess = 0, kInvalidArgument = 2, kNotSupported = 3, kUninitialized = 1,
              kNotFound = 6;

struct PciInfo {
  char busIdLegacy[16];
  unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
  char busId[32];
};

Device* Check(void* dev, unsigned link, int* rc) {
  *rc = g_open == 0 ? kUninitialized : dev == nullptr ? kInvalidArgument
                                      : link >= 4      ? kNotSupported
                                                       : kSuccess;
  return *rc == kSuccess ? static_cast<Device*>(dev) : nullptr;
}

}  // namespace

extern "C" {

int fake_nvml_open_count() { return g_open; }
int nvmlInit_v2() {
  ++g_open;
  return kSuccess;
}
int nvmlShutdown() {
  if (g_open == 0) return kUninitialized;
  --g_open;
  return kSuccess;
}
const char* nvmlErrorString(int r) { return r == kNotFound ? "Not Found" : "fake NVML error"; }

int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** dev) {
  if (g_open == 0) return kUninitialized;
  unsigned d = 0, b = 0, s = 0, f = 0;
  if (std::sscanf(bus_id, "%x:%x:%x.%x", &d, &b, &s, &f) != 4) return kInvalidArgument;
  for (Device& dv : g_devices) {
    unsigned d2 = 0, b2 = 0, s2 = 0, f2 = 0;
    std::sscanf(dv.bus_id, "%x:%x:%x.%x", &d2, &b2, &s2, &f2);
    if (d == d2 && b == b2 && s == s2 && f == f2) {
      *dev = &dv;
      return kSuccess;
    }
  }
  return kNotFound;
}

int nvmlDeviceGetNvLinkState(void* dev, unsigned link, int* active) {
  int rc = 0;
  Device* d = Check(dev, link, &rc);
  if (d != nullptr) *active = d->links[link].active;
  return rc;
}

int nvmlDeviceGetNvLinkRemotePciInfo_v2(void* dev, unsigned link, PciInfo* pci) {
  int rc = 0;
  Device* d = Check(dev, link, &rc);
  if (d == nullptr) return rc;
  const Device::Link& l = d->links[link];
  std::memset(pci, 0, sizeof *pci);
  pci->domain = l.domain;
  pci->bus = l.bus;
  pci->device = l.device;
  std::snprintf(pci->busId, sizeof pci->busId, "%08X:%02X:%02X.0", l.domain, l.bus, l.device);
  return kSuccess;
}

int nvmlDeviceGetNvLinkRemoteDeviceType(void* dev, unsigned link, int* type) {
  int rc = 0;
  Device* d = Check(dev, link, &rc);
  if (d != nullptr) *type = d->links[link].type;
  return rc;
}

}  // extern "C"
