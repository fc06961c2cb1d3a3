// FP8 scaling math: C01 (degenerate amax) and delayed scaling, against hand-computed values.
#include "common/scaling.h"

#include <cfloat>
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

namespace fsdp8 {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

void ExpectUsable(float s) {
  EXPECT_TRUE(std::isfinite(s)) << s;
  EXPECT_GT(s, 0.0f);
  const float inv = 1.0f / s;
  EXPECT_TRUE(std::isfinite(inv)) << inv;
  EXPECT_GT(inv, 0.0f);
}

TEST(Scaling, Fp8MaxValues) {
  EXPECT_EQ(Fp8MaxValue(false), 448.0f);
  EXPECT_EQ(Fp8MaxValue(true), 57344.0f);
}

TEST(Scaling, ComputeScaleHandValues) {
  EXPECT_EQ(ComputeScale(2.0f, 448.0f, 0, 1.0f), 224.0f);     // 448 / 2
  EXPECT_EQ(ComputeScale(448.0f, 448.0f, 1, 1.0f), 0.5f);     // 448 / 448 / 2
  EXPECT_EQ(ComputeScale(4.0f, 448.0f, 2, 1.0f), 28.0f);      // 448 / 4 / 4
  EXPECT_EQ(ComputeScale(4.0f, 57344.0f, 0, 1.0f), 14336.0f); // 57344 / 4
  EXPECT_EQ(ComputeScale(0.5f, 448.0f, 3, 1.0f), 112.0f);     // 448 / 0.5 / 8
}

TEST(Scaling, C01_ZeroAmaxKeepsPrevious) {
  EXPECT_EQ(ComputeScale(0.0f, 448.0f, 0, 3.5f), 3.5f);
  EXPECT_EQ(ComputeScale(-0.0f, 448.0f, 0, 3.5f), 3.5f);
}

TEST(Scaling, C01_InfAndNaNAmaxKeepPrevious) {
  EXPECT_EQ(ComputeScale(kInf, 448.0f, 0, 3.5f), 3.5f);
  EXPECT_EQ(ComputeScale(-kInf, 448.0f, 0, 3.5f), 3.5f);
  EXPECT_EQ(ComputeScale(kNaN, 448.0f, 0, 3.5f), 3.5f);
  EXPECT_EQ(ComputeScale(-kNaN, 57344.0f, 2, 0.25f), 0.25f);
}

TEST(Scaling, C01_DenormalAmaxClampsToFltMax) {
  // 448 / 1e-40 = 4.48e42 > FLT_MAX (3.40e38): clamped, not inf.
  const float s = ComputeScale(1e-40f, 448.0f, 0, 3.5f);
  EXPECT_EQ(s, FLT_MAX);
  ExpectUsable(s);
  // Smallest denormal too.
  EXPECT_EQ(ComputeScale(std::numeric_limits<float>::denorm_min(), 57344.0f, 0, 1.0f), FLT_MAX);
}

TEST(Scaling, C01_TinyNormalAmaxWhoseQuotientOverflowsFp32) {
  // 448 / 3e-37 = 1.49e39 > FLT_MAX although 3e-37 is a normal float: a plain FP32 division gives inf.
  const float s = ComputeScale(3e-37f, 448.0f, 0, 1.0f);
  EXPECT_EQ(s, FLT_MAX);
  ExpectUsable(s);
  // With margin 2: 1.49e39 / 4 = 3.7e38 still above FLT_MAX; margin 3: 1.87e38 exact-ish.
  EXPECT_EQ(ComputeScale(3e-37f, 448.0f, 2, 1.0f), FLT_MAX);
  const float m3 = ComputeScale(3e-37f, 448.0f, 3, 1.0f);
  EXPECT_NEAR(m3 / 1.8666667e38f, 1.0f, 1e-6f);
}

TEST(Scaling, C01_HugeAmaxClampsToSmallestNormal) {
  // 448 / FLT_MAX / 2^10 = 1.29e-39 < 2^-126: clamped to FLT_MIN so scale_inv stays finite.
  const float s = ComputeScale(FLT_MAX, 448.0f, 10, 1.0f);
  EXPECT_EQ(s, FLT_MIN);
  ExpectUsable(s);
}

TEST(Scaling, C01_BadPreviousNeverLeaks) {
  EXPECT_EQ(ComputeScale(0.0f, 448.0f, 0, kInf), 1.0f);
  EXPECT_EQ(ComputeScale(kNaN, 448.0f, 0, kNaN), 1.0f);
  EXPECT_EQ(ComputeScale(kInf, 448.0f, 0, 0.0f), 1.0f);
  EXPECT_EQ(ComputeScale(kInf, 448.0f, 0, -2.0f), 1.0f);
}

TEST(Scaling, C01_UpdateDelayedWithDegenerateAmaxes) {
  ScalingState s;
  // Before anything usable arrives the state stays uninitialised with scale 1.
  UpdateDelayed(&s, 0.0f, 4, v1::AMAX_ALGORITHM_MAX, 0);
  EXPECT_FALSE(s.initialised);
  EXPECT_EQ(s.scale, 1.0f);
  UpdateDelayed(&s, kNaN, 4, v1::AMAX_ALGORITHM_MAX, 0);
  EXPECT_FALSE(s.initialised);
  UpdateDelayed(&s, 2.0f, 4, v1::AMAX_ALGORITHM_MAX, 0);
  EXPECT_TRUE(s.initialised);
  EXPECT_EQ(s.scale, 224.0f);
  EXPECT_EQ(s.scale_inv, 1.0f / 224.0f);
  // inf and NaN are not recorded: scale kept, history unchanged.
  const size_t n = s.history.size();
  UpdateDelayed(&s, kInf, 4, v1::AMAX_ALGORITHM_MAX, 0);
  UpdateDelayed(&s, kNaN, 4, v1::AMAX_ALGORITHM_MAX, 0);
  EXPECT_EQ(s.history.size(), n);
  EXPECT_EQ(s.scale, 224.0f);
  // An inf must not poison the window: the next finite amax (1) gives max(history)=2 -> 224, and
  // with most-recent 448 / 1 = 448.
  // MAX on a copy: history (newest first) is [1, 2, 0] with the inf and NaN dropped, so the max is
  // 2 and the scale 448 / 2 = 224 (an inf in the window would have given a non-finite amax).
  ScalingState m = s;
  UpdateDelayed(&m, 1.0f, 4, v1::AMAX_ALGORITHM_MAX, 0);
  EXPECT_EQ(std::vector<float>(m.history.begin(), m.history.end()),
            (std::vector<float>{1.0f, 2.0f, 0.0f}));
  EXPECT_EQ(m.scale, 224.0f);
  EXPECT_EQ(m.scale_inv, 1.0f / 224.0f);
  UpdateDelayed(&s, 1.0f, 4, v1::AMAX_ALGORITHM_MOST_RECENT, 0);
  EXPECT_EQ(s.scale, 448.0f);
  // Most recent 0 keeps the previous scale.
  UpdateDelayed(&s, -0.0f, 4, v1::AMAX_ALGORITHM_MOST_RECENT, 0);
  EXPECT_EQ(s.scale, 448.0f);
  ExpectUsable(s.scale);
  // Denormal: FLT_MAX, scale_inv finite and > 0.
  UpdateDelayed(&s, 1e-40f, 1, v1::AMAX_ALGORITHM_MOST_RECENT, 0);
  EXPECT_EQ(s.scale, FLT_MAX);
  EXPECT_TRUE(std::isfinite(s.scale_inv));
  EXPECT_GT(s.scale_inv, 0.0f);
}

TEST(Scaling, DelayedMaxOverHistory) {
  ScalingState s;  // E4M3, history 3
  const float amax[] = {4, 8, 2, 1, 1, 1};
  // histories (newest first): [4] [8,4] [2,8,4] [1,2,8] [1,1,2] [1,1,1]
  const float want[] = {112, 56, 56, 56, 224, 448};
  for (int i = 0; i < 6; ++i) {
    UpdateDelayed(&s, amax[i], 3, v1::AMAX_ALGORITHM_MAX, 0);
    EXPECT_EQ(s.scale, want[i]) << "step " << i;
    EXPECT_EQ(s.scale_inv, 1.0f / want[i]);
    EXPECT_LE(s.history.size(), 3u);
  }
  EXPECT_EQ(s.history.front(), 1.0f);
}

TEST(Scaling, DelayedMostRecent) {
  ScalingState s;
  const float amax[] = {4, 8, 2};
  const float want[] = {112, 56, 224};
  for (int i = 0; i < 3; ++i) {
    UpdateDelayed(&s, amax[i], 16, v1::AMAX_ALGORITHM_MOST_RECENT, 0);
    EXPECT_EQ(s.scale, want[i]);
  }
}

TEST(Scaling, DelayedHistoryLengthOneEqualsMostRecent) {
  ScalingState s;
  UpdateDelayed(&s, 8, 1, v1::AMAX_ALGORITHM_MAX, 0);
  UpdateDelayed(&s, 2, 1, v1::AMAX_ALGORITHM_MAX, 0);
  EXPECT_EQ(s.scale, 224.0f);
  EXPECT_EQ(s.history.size(), 1u);
}

TEST(Scaling, DelayedMarginHalvesPerUnit) {
  for (int margin = 0; margin < 4; ++margin) {
    ScalingState s;
    s.e5m2 = true;
    UpdateDelayed(&s, 7.0f, 4, v1::AMAX_ALGORITHM_MAX, margin);
    // 57344 / 7 = 8192 exactly; each margin unit halves it.
    EXPECT_EQ(s.scale, 8192.0f / static_cast<float>(1 << margin)) << margin;
  }
}

}  // namespace
}  // namespace fsdp8
