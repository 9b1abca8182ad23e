#include <cmath>
#include <limits>
#include <vector>

#include "deepnex/ps/optimizer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "ps/update.h"
#include "test_matchers.h"

namespace deepnex::ps {
namespace {

using ::deepnex::test::IsOk;
using ::deepnex::test::StatusIs;
using ::testing::HasSubstr;

struct Result {
  std::vector<double> w, m, v;
};

// Applies `steps` updates of gradient g to w through the rule.
Result Apply(const OptimizerConfig& c, std::vector<double> w,
          const std::vector<double>& g, int steps, double scale = 1.0) {
  Result r{std::move(w), std::vector<double>(g.size()), std::vector<double>(g.size())};
  if (c.kind == OptimizerKind::kAdagrad) r.v.assign(g.size(), c.initial_accumulator);
  for (int t = 1; t <= steps; ++t) {
    ApplyUpdate<double>(c, t, scale, r.w.data(), r.w.data(), g.data(), r.m.data(),
                        r.v.data(), g.size());
  }
  return r;
}

TEST(OptimizerTest, SgdWithWeightDecay) {
  OptimizerConfig c;
  c.lr = 0.5;
  c.weight_decay = 0.25;
  // w - lr*(g + wd*w) = 4 - 0.5*(2 + 1) = 2.5
  EXPECT_EQ(Apply(c, {4.0}, {2.0}, 1).w[0], 2.5);
}

TEST(OptimizerTest, SgdMomentumAndNesterovFollowTorch) {
  OptimizerConfig c;
  c.lr = 0.5;
  c.momentum = 0.5;
  // buf1 = 2, w1 = 10 - 1 = 9; buf2 = 0.5*2 + 2 = 3, w2 = 9 - 1.5 = 7.5
  EXPECT_EQ(Apply(c, {10.0}, {2.0}, 2).w[0], 7.5);
  c.nesterov = true;
  // step1: d = 2 + 0.5*2 = 3, w = 8.5; step2: buf = 3, d = 2 + 1.5 = 3.5, w = 6.75
  EXPECT_EQ(Apply(c, {10.0}, {2.0}, 2).w[0], 6.75);
}

TEST(OptimizerTest, AdamFirstStepMovesByLr) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdam;
  c.lr = 0.1;
  c.eps = 1e-12;
  // Bias-corrected m/sqrt(v) is sign(g) on the first step.
  Result r = Apply(c, {1.0, 1.0}, {3.0, -0.5}, 1);
  EXPECT_NEAR(r.w[0], 0.9, 1e-12);
  EXPECT_NEAR(r.w[1], 1.1, 1e-12);
}

TEST(OptimizerTest, AdamWDecaysTheWeightsDecoupled) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdamW;
  c.lr = 0.1;
  c.weight_decay = 0.5;
  c.eps = 1e-12;
  // w*(1 - lr*wd) - lr*sign(g) = 2*0.95 - 0.1
  EXPECT_NEAR(Apply(c, {2.0}, {1.0}, 1).w[0], 1.8, 1e-12);
}

TEST(OptimizerTest, AdagradAccumulatesSquares) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kAdagrad;
  c.lr = 1.0;
  c.eps = 1e-10;
  // step1: v=4, w -= 2/2 -> 9; step2: v=8, w -= 2/sqrt(8)
  Result r = Apply(c, {10.0}, {2.0}, 2);
  EXPECT_NEAR(r.w[0], 9.0 - 2.0 / std::sqrt(8.0), 1e-9);
  EXPECT_EQ(r.v[0], 8.0);
}

TEST(OptimizerTest, SumAndAssignUseTheScaledGradient) {
  OptimizerConfig c;
  c.kind = OptimizerKind::kSum;
  EXPECT_EQ(Apply(c, {1.0}, {6.0}, 1, 0.5).w[0], 4.0);
  c.kind = OptimizerKind::kAssign;
  EXPECT_EQ(Apply(c, {1.0}, {6.0}, 1, 0.5).w[0], 3.0);
}

// A partition whose values a pull reply still holds updates them into
// another buffer: every rule gives there exactly what it gives in place.
TEST(OptimizerTest, EveryRuleGivesTheSameOutOfPlaceAsInPlace) {
  std::vector<OptimizerConfig> configs(8);
  configs[1].momentum = 0.5;
  configs[2].momentum = 0.5;
  configs[2].nesterov = true;
  configs[3].kind = OptimizerKind::kAdam;
  configs[3].weight_decay = 0.1;
  configs[4].kind = OptimizerKind::kAdamW;
  configs[4].weight_decay = 0.1;
  configs[5].kind = OptimizerKind::kAdagrad;
  configs[5].weight_decay = 0.1;
  configs[6].kind = OptimizerKind::kSum;
  configs[7].kind = OptimizerKind::kAssign;
  const std::vector<double> g = {3.0, -0.5, 0.25, 8.0};
  for (const OptimizerConfig& c : configs) {
    SCOPED_TRACE(c.ToString());
    Result in_place = Apply(c, {1.0, -2.0, 0.5, 4.0}, g, 3, 0.5);
    Result moved{{1.0, -2.0, 0.5, 4.0}, std::vector<double>(4), std::vector<double>(4)};
    if (c.kind == OptimizerKind::kAdagrad) moved.v.assign(4, c.initial_accumulator);
    for (int t = 1; t <= 3; ++t) {
      const std::vector<double> before = moved.w;
      std::vector<double> out(4, -99.0);
      ApplyUpdate<double>(c, t, 0.5, before.data(), out.data(), g.data(), moved.m.data(),
                          moved.v.data(), g.size());
      moved.w = out;
    }
    EXPECT_EQ(moved.w, in_place.w);
    EXPECT_EQ(moved.m, in_place.m);
    EXPECT_EQ(moved.v, in_place.v);
  }
}

TEST(OptimizerTest, ValidateNamesTheField) {
  OptimizerConfig c;
  c.lr = -1;
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr=-1")));
  // --lr 1e400 said "lr=inf: must be >= 0".
  c.lr = std::numeric_limits<double>::infinity();
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument,
                                     "optimizer lr=inf: must be finite and >= 0"));
  c = {};
  c.beta2 = 1.0;
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("beta2=1")));
  c = {};
  c.nesterov = true;
  EXPECT_THAT(c.Validate(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("nesterov")));
  EXPECT_THAT(OptimizerConfig{}.Validate(), IsOk());
  EXPECT_THAT(ParseOptimizerKind("adamw").status(), IsOk());
  EXPECT_THAT(ParseOptimizerKind("lbfgs").status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("\"lbfgs\"")));
}

}  // namespace
}  // namespace deepnex::ps
