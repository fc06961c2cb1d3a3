// AllocationAccount: a backend's live bytes per memory label (common/memory_label.h) and the
// bytes per label at its peak. Each backend calls Allocated / Freed for every Alloc / Free, so
// that Total() == Backend::AllocatedBytes() less what the backend holds outside Alloc (the CUDA
// backend's own workspaces), and Peak() == PeakAllocatedBytes() on the CPU backends. An
// allocation takes the label current when it is made (label(), set by MemoryLabelScope;
// kUnlabelled outside every scope); Relabel moves a live allocation to another label (a block's
// output kept as the next block's saved input).
//
// Contract: at every moment sum(Live()) == Total(); sum(AtPeak()) == Peak(), AtPeak() being Live()
// at the first moment Total() reached Peak() since the last ResetPeak (which sets Peak() to
// Total() and AtPeak() to Live()).
//
// Thread-safety: as the backend that owns it (one thread).
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>

#include "common/memory_label.h"

namespace fsdp8 {

class AllocationAccount {
 public:
  MemoryLabel label() const { return label_; }
  void set_label(MemoryLabel l) { label_ = l; }

  // `bytes` at p allocated under label().
  void Allocated(const void* p, int64_t bytes) {
    entries_[p] = {bytes, label_};
    Add(label_, bytes);
  }
  // p freed (nullptr or an address not recorded: nothing).
  void Freed(const void* p) {
    auto it = entries_.find(p);
    if (it == entries_.end()) return;
    Add(it->second.second, -it->second.first);
    entries_.erase(it);
  }
  // p's bytes move to label l (nullptr or an address not recorded: nothing).
  void Relabel(const void* p, MemoryLabel l) {
    auto it = entries_.find(p);
    if (it == entries_.end() || it->second.second == l) return;
    live_[Index(it->second.second)] -= it->second.first;
    live_[Index(l)] += it->second.first;
    it->second.second = l;
  }

  int64_t Total() const { return total_; }
  int64_t Peak() const { return peak_; }
  const LabelBytes& Live() const { return live_; }
  const LabelBytes& AtPeak() const { return at_peak_; }
  void ResetPeak() {
    peak_ = total_;
    at_peak_ = live_;
  }

 private:
  static int Index(MemoryLabel l) { return static_cast<int>(l); }
  void Add(MemoryLabel l, int64_t bytes) {
    live_[Index(l)] += bytes;
    total_ += bytes;
    if (total_ > peak_) {
      peak_ = total_;
      at_peak_ = live_;
    }
  }

  MemoryLabel label_ = MemoryLabel::kUnlabelled;
  std::unordered_map<const void*, std::pair<int64_t, MemoryLabel>> entries_;
  LabelBytes live_{}, at_peak_{};
  int64_t total_ = 0, peak_ = 0;
};

// Sets an account's current label while it lives and restores the one before (scopes nest).
class MemoryLabelScope {
 public:
  MemoryLabelScope(AllocationAccount* account, MemoryLabel l)
      : account_(account), before_(account->label()) {
    account_->set_label(l);
  }
  ~MemoryLabelScope() { account_->set_label(before_); }
  MemoryLabelScope(const MemoryLabelScope&) = delete;
  MemoryLabelScope& operator=(const MemoryLabelScope&) = delete;

 private:
  AllocationAccount* account_;
  MemoryLabel before_;
};

}  // namespace fsdp8
