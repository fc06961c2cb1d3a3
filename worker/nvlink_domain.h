// The NVLink placement domain of a CUDA worker's device, found through NVML at run time, for the
// placement of hybrid-sharded jobs' shard groups (coordinator/placement.h): the worker registers
// it as RegisterRequest.placement_domain when --placement_domain is not given.
//
// NVML (libnvidia-ml.so.1, part of the NVIDIA driver) is loaded with dlopen and never linked: a
// worker starts on hosts without the driver, and detection then gives "" (the whole host).
//
// Thread-safety: NvLinkDomainName and NormalizePciBusId are pure; DetectNvLinkDomain initialises
// and shuts NVML down on each call (NVML counts nested nvmlInit calls) and may be called from any
// thread, though the worker calls it once at start.
#pragma once

#include <string>
#include <vector>

namespace fsdp8 {

// What the far end of one NVLink is (NVML's nvmlIntNvLinkDeviceType_t).
enum class NvLinkPeerKind { kGpu, kSwitch, kOther };

// One NVLink of a device as NVML reports it.
struct NvLinkRecord {
  int link = 0;              // link index, 0 .. NVML_NVLINK_MAX_LINKS - 1
  bool active = false;       // nvmlDeviceGetNvLinkState: NVML_FEATURE_ENABLED
  NvLinkPeerKind peer = NvLinkPeerKind::kOther;
  std::string peer_bus_id;   // PCI bus id of the far end, in any of NVML's or CUDA's spellings
};

// A PCI bus id "domain:bus:device.function" (hex; NVML spells the domain with 8 digits, CUDA with
// 4, either case) in one spelling: lower-case, the domain with at least 4 digits, e.g.
// "0000:18:00.0". Text that is not such an id is returned lower-cased and otherwise unchanged.
std::string NormalizePciBusId(const std::string& bus_id);

// The placement domain name of the device at `own_bus_id` with NVLinks `links` (only active ones
// count; duplicates and order do not matter):
//   - any active link ends at an NVSwitch: "nvswitch:" + the sorted, distinct normalised bus ids
//     of the switches its active links reach, joined by ","; every GPU wired to the same switches
//     (all GPUs of an HGX board) gets the same name;
//   - else any active link ends at a GPU: "nvlink:" + the sorted, distinct normalised bus ids of
//     the device itself and of the GPUs its active links reach, joined by ","; the GPUs of a fully
//     connected island agree; in a partially connected topology (a ring, say) devices may get
//     different names, and each name is then a domain of its own;
//   - else (no active link, or links only to other kinds of device): "" (the whole host).
std::string NvLinkDomainName(const std::string& own_bus_id, const std::vector<NvLinkRecord>& links);

// A detected domain and how it was found, or why there is none (for the worker's log line).
struct NvLinkDomain {
  std::string name;  // "" : the whole host
  std::string how;   // e.g. "NVML: 18 active NVLink(s) to 4 NVSwitch(es)", "NVML not loaded: ..."
};

// Walks the NVLinks of the device at PCI bus id `bus_id` through NVML, loaded from `library`
// (dlopen), and names its domain with NvLinkDomainName. Never fails: a missing library or
// function, an NVML error or an unknown device give name "" and `how` says why.
NvLinkDomain DetectNvLinkDomain(const std::string& bus_id,
                                const std::string& library = "libnvidia-ml.so.1");

// DetectNvLinkDomain for CUDA device ordinal `cuda_device` (as CUDA_VISIBLE_DEVICES numbers them),
// its bus id taken from the CUDA runtime. In a build without the CUDA backend, or when the device
// does not exist, name "" and `how` says why.
NvLinkDomain DetectCudaNvLinkDomain(int cuda_device,
                                    const std::string& library = "libnvidia-ml.so.1");

}  // namespace fsdp8
