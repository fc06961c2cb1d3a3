// NvLinkDomainName (worker/nvlink_domain.h): the placement domain names of hand-made NVLink
// topologies, whose expected names are written out by hand from the rule in the header; and
// DetectNvLinkDomain without a usable NVML.
#include "worker/nvlink_domain.h"

#include <dlfcn.h>

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fsdp8 {
namespace {

NvLinkRecord Up(int link, NvLinkPeerKind peer, const std::string& bus_id) {
  NvLinkRecord r;
  r.link = link;
  r.active = true;
  r.peer = peer;
  r.peer_bus_id = bus_id;
  return r;
}

NvLinkRecord Down(int link, NvLinkPeerKind peer, const std::string& bus_id) {
  NvLinkRecord r = Up(link, peer, bus_id);
  r.active = false;
  return r;
}

constexpr NvLinkPeerKind kGpu = NvLinkPeerKind::kGpu;
constexpr NvLinkPeerKind kSwitch = NvLinkPeerKind::kSwitch;

TEST(NvLinkDomain, NormalizesNvmlAndCudaSpellingsOfABusId) {
  EXPECT_EQ(NormalizePciBusId("00000000:1A:00.0"), "0000:1a:00.0");  // NVML
  EXPECT_EQ(NormalizePciBusId("0000:1a:00.0"), "0000:1a:00.0");      // CUDA
  EXPECT_EQ(NormalizePciBusId("00000001:9B:1F.3"), "0001:9b:1f.3");
  EXPECT_EQ(NormalizePciBusId("Not-A-Bus-Id"), "not-a-bus-id");
}

// An HGX board: 8 GPUs, each with 18 links spread 5/4/4/5 over the same 4 NVSwitches, which NVML
// spells in its 8-digit, upper-case form; every GPU names the same domain, and the GPU's own bus
// id is not part of it.
TEST(NvLinkDomain, EightGpusOnFourSharedSwitchesAgree) {
  const std::vector<std::string> switches = {"00000000:07:00.0", "00000000:05:00.0",
                                             "00000000:0A:00.0", "00000000:06:00.0"};
  const int per_switch[4] = {5, 4, 4, 5};
  const std::vector<std::string> gpus = {"0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0",
                                         "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0",
                                         "0000:ba:00.0", "0000:db:00.0"};
  const std::string want = "nvswitch:0000:05:00.0,0000:06:00.0,0000:07:00.0,0000:0a:00.0";
  for (size_t g = 0; g < gpus.size(); ++g) {
    std::vector<NvLinkRecord> links;
    int link = 0;
    for (int s = 0; s < 4; ++s) {
      // Rotate the order the switches appear in per GPU: order must not matter.
      const std::string& sw = switches[(s + g) % 4];
      for (int k = 0; k < per_switch[s]; ++k) links.push_back(Up(link++, kSwitch, sw));
    }
    ASSERT_EQ(links.size(), 18u);
    EXPECT_EQ(NvLinkDomainName(gpus[g], links), want) << "GPU " << gpus[g];
  }
}

// Two islands of 4 GPUs each, every GPU linked directly to the 3 others of its island (2 links
// to each): each island has one name, the sorted bus ids of its 4 GPUs, and the two differ.
TEST(NvLinkDomain, TwoDirectlyLinkedIslandsOfFourGetOneNameEach) {
  const std::vector<std::vector<std::string>> islands = {
      {"0000:5d:00.0", "0000:18:00.0", "0000:3a:00.0", "0000:2a:00.0"},
      {"0000:9a:00.0", "0000:db:00.0", "0000:ab:00.0", "0000:ba:00.0"}};
  const std::vector<std::string> want = {
      "nvlink:0000:18:00.0,0000:2a:00.0,0000:3a:00.0,0000:5d:00.0",
      "nvlink:0000:9a:00.0,0000:ab:00.0,0000:ba:00.0,0000:db:00.0"};
  for (size_t i = 0; i < islands.size(); ++i) {
    for (const std::string& own : islands[i]) {
      std::vector<NvLinkRecord> links;
      int link = 0;
      for (const std::string& peer : islands[i]) {
        if (peer == own) continue;
        // NVML reports peers in its own spelling.
        const std::string nvml_peer = "0000" + peer;
        links.push_back(Up(link++, kGpu, nvml_peer));
        links.push_back(Up(link++, kGpu, nvml_peer));
      }
      EXPECT_EQ(NvLinkDomainName(own, links), want[i]) << "GPU " << own;
    }
  }
}

TEST(NvLinkDomain, NoLinksIsTheWholeHost) {
  EXPECT_EQ(NvLinkDomainName("0000:18:00.0", {}), "");
}

// Links that are down count for nothing, whatever they would reach.
TEST(NvLinkDomain, LinksDownAreTheWholeHost) {
  EXPECT_EQ(NvLinkDomainName("0000:18:00.0", {Down(0, kSwitch, "0000:05:00.0"),
                                              Down(1, kGpu, "0000:2a:00.0")}),
            "");
  // One link up among links down: only the up one names the domain.
  EXPECT_EQ(NvLinkDomainName("0000:18:00.0", {Down(0, kSwitch, "0000:05:00.0"),
                                              Up(1, kGpu, "0000:2a:00.0"),
                                              Down(2, kGpu, "0000:3a:00.0")}),
            "nvlink:0000:18:00.0,0000:2a:00.0");
}

// Links only to devices that are neither GPUs nor NVSwitches (an IBM NPU) do not make a domain.
TEST(NvLinkDomain, LinksToOtherDevicesAreTheWholeHost) {
  EXPECT_EQ(NvLinkDomainName("0000:18:00.0", {Up(0, NvLinkPeerKind::kOther, "0000:05:00.0")}), "");
}

// The same link reported twice, and the same switch or peer in both spellings, appear once.
TEST(NvLinkDomain, DuplicateRecordsAppearOnce) {
  EXPECT_EQ(NvLinkDomainName("0000:18:00.0",
                             {Up(0, kSwitch, "00000000:06:00.0"), Up(0, kSwitch, "00000000:06:00.0"),
                              Up(1, kSwitch, "0000:06:00.0"), Up(2, kSwitch, "00000000:05:00.0")}),
            "nvswitch:0000:05:00.0,0000:06:00.0");
  EXPECT_EQ(NvLinkDomainName("00000000:18:00.0",
                             {Up(0, kGpu, "0000:2a:00.0"), Up(1, kGpu, "00000000:2A:00.0"),
                              Up(2, kGpu, "0000:18:00.0")}),
            "nvlink:0000:18:00.0,0000:2a:00.0");
}

// A GPU wired to a switch and directly to a GPU is in the switch's domain.
TEST(NvLinkDomain, AnySwitchLinkNamesTheSwitchDomain) {
  EXPECT_EQ(NvLinkDomainName("0000:18:00.0",
                             {Up(0, kGpu, "0000:2a:00.0"), Up(1, kSwitch, "0000:05:00.0")}),
            "nvswitch:0000:05:00.0");
}

// A ring of 4 (A-B, B-C, C-D, D-A) is not fully connected: each GPU sees a different set, and
// so names a domain of its own (documented in the header).
TEST(NvLinkDomain, PartiallyConnectedRingGivesSeveralNames) {
  const std::string a = "0000:18:00.0", b = "0000:2a:00.0", c = "0000:3a:00.0",
                    d = "0000:5d:00.0";
  EXPECT_EQ(NvLinkDomainName(a, {Up(0, kGpu, b), Up(1, kGpu, d)}),
            "nvlink:0000:18:00.0,0000:2a:00.0,0000:5d:00.0");
  EXPECT_EQ(NvLinkDomainName(b, {Up(0, kGpu, a), Up(1, kGpu, c)}),
            "nvlink:0000:18:00.0,0000:2a:00.0,0000:3a:00.0");
}

// Without the library (as on a host without the NVIDIA driver): no domain, and a reason naming
// the library.
TEST(NvLinkDomain, DetectWithoutNvmlGivesTheWholeHostAndWhy) {
  const NvLinkDomain d = DetectNvLinkDomain("0000:18:00.0", "/nonexistent/libnvidia-ml.so.1");
  EXPECT_EQ(d.name, "");
  EXPECT_NE(d.how.find("NVML not loaded"), std::string::npos) << d.how;
  EXPECT_NE(d.how.find("/nonexistent/libnvidia-ml.so.1"), std::string::npos) << d.how;
}

// A library that loads but is not NVML: no domain, and the missing entry point is named.
TEST(NvLinkDomain, DetectWithALibraryLackingNvmlNamesTheMissingFunction) {
  const NvLinkDomain d = DetectNvLinkDomain("0000:18:00.0", "libm.so.6");
  EXPECT_EQ(d.name, "");
  EXPECT_NE(d.how.find("lacks nvmlInit_v2"), std::string::npos) << d.how;
}

// The default library, on any host: with the driver, a bus id no GPU has; without it, no NVML.
// Either way no domain, a reason, and no crash.
TEST(NvLinkDomain, DetectOfAnAbsentDeviceGivesTheWholeHostAndWhy) {
  const NvLinkDomain d = DetectNvLinkDomain("0000:ff:1f.7");
  EXPECT_EQ(d.name, "");
  EXPECT_FALSE(d.how.empty());
}

// The NVML walk through a stand-in library (tests/worker/fake_nvml.cc, whose topology the expected
// names are written from): down links and links past the device's are skipped, peers' bus ids
// come from the remote PCI info, the device is found by its CUDA-spelled bus id, and every
// nvmlInit_v2 is matched by an nvmlShutdown.
TEST(NvLinkDomain, DetectWalksTheLinksOfAStandInNvml) {
  void* keep = dlopen(FSDP8_FAKE_NVML, RTLD_NOW | RTLD_LOCAL);  // keeps its counter alive
  ASSERT_NE(keep, nullptr) << dlerror();
  auto open_count = reinterpret_cast<int (*)()>(dlsym(keep, "fake_nvml_open_count"));
  ASSERT_NE(open_count, nullptr);

  const NvLinkDomain sw = DetectNvLinkDomain("0000:18:00.0", FSDP8_FAKE_NVML);
  EXPECT_EQ(sw.name, "nvswitch:0000:05:00.0,0000:06:00.0");
  EXPECT_EQ(sw.how, "NVML: 3 active NVLink(s) to 2 NVSwitch(es) and 1 GPU(s)");

  const NvLinkDomain gpu = DetectNvLinkDomain("0000:2a:00.0", FSDP8_FAKE_NVML);
  EXPECT_EQ(gpu.name, "nvlink:0000:18:00.0,0000:2a:00.0,0000:3a:00.0");

  const NvLinkDomain absent = DetectNvLinkDomain("0000:99:00.0", FSDP8_FAKE_NVML);
  EXPECT_EQ(absent.name, "");
  EXPECT_NE(absent.how.find("0000:99:00.0"), std::string::npos) << absent.how;
  EXPECT_NE(absent.how.find("Not Found"), std::string::npos) << absent.how;

  EXPECT_EQ(open_count(), 0);
  dlclose(keep);
}

}  // namespace
}  // namespace fsdp8
