#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/text.h"
#include "deepnex/ps/optimizer.h"
#include "ps/update.h"

namespace deepnex::ps {

const char* OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdagrad: return "adagrad";
    case OptimizerKind::kSum: return "sum";
    case OptimizerKind::kAssign: return "assign";
  }
  return "?";
}

absl::StatusOr<OptimizerKind> ParseOptimizerKind(const std::string& name) {
  for (OptimizerKind k :
       {OptimizerKind::kSgd, OptimizerKind::kAdam, OptimizerKind::kAdamW,
        OptimizerKind::kAdagrad, OptimizerKind::kSum, OptimizerKind::kAssign}) {
    if (name == OptimizerKindName(k)) return k;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "optimizer: unknown \"", name,
      "\" (one of sgd, adam, adamw, adagrad, sum, assign)"));
}

double DefaultLr(OptimizerKind kind) {
  return kind == OptimizerKind::kAdam || kind == OptimizerKind::kAdamW ? 0.001 : 0.01;
}

absl::Status OptimizerConfig::Validate() const {
  auto bad = [](const char* field, double value, const char* rule) {
    return absl::InvalidArgumentError(
        absl::StrFormat("optimizer %s=%g: %s", field, value, rule));
  };
  // "inf" and "nan" are said as such: "lr=inf: must be >= 0" read as a wrong rule.
  if (!(lr >= 0) || !std::isfinite(lr)) return bad("lr", lr, "must be finite and >= 0");
  if (!(momentum >= 0) || !std::isfinite(momentum))
    return bad("momentum", momentum, "must be finite and >= 0");
  if (!(weight_decay >= 0) || !std::isfinite(weight_decay))
    return bad("weight_decay", weight_decay, "must be finite and >= 0");
  if (!(beta1 >= 0 && beta1 < 1)) return bad("beta1", beta1, "must be in [0, 1)");
  if (!(beta2 >= 0 && beta2 < 1)) return bad("beta2", beta2, "must be in [0, 1)");
  if (!(eps > 0) || !std::isfinite(eps)) return bad("eps", eps, "must be finite and > 0");
  if (!(initial_accumulator >= 0) || !std::isfinite(initial_accumulator))
    return bad("initial_accumulator", initial_accumulator, "must be finite and >= 0");
  if (nesterov && !(momentum > 0)) {
    return absl::InvalidArgumentError(
        "optimizer nesterov=true needs momentum > 0");
  }
  return absl::OkStatus();
}

std::string OptimizerConfig::ToString() const {
  const auto n = ShortestDouble;
  switch (kind) {
    case OptimizerKind::kSgd:
      return absl::StrCat("sgd(lr=", n(lr), ", momentum=", n(momentum),
                          ", nesterov=", nesterov ? "true" : "false",
                          ", weight_decay=", n(weight_decay), ")");
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW:
      return absl::StrCat(OptimizerKindName(kind), "(lr=", n(lr), ", betas=(", n(beta1), ", ",
                          n(beta2), "), eps=", n(eps), ", weight_decay=", n(weight_decay), ")");
    case OptimizerKind::kAdagrad:
      return absl::StrCat("adagrad(lr=", n(lr), ", eps=", n(eps), ", weight_decay=",
                          n(weight_decay), ", initial_accumulator=", n(initial_accumulator), ")");
    case OptimizerKind::kSum:
    case OptimizerKind::kAssign:
      return OptimizerKindName(kind);
  }
  return "?";
}

bool UsesFirstMoment(const OptimizerConfig& c) {
  return (c.kind == OptimizerKind::kSgd && c.momentum > 0) ||
         c.kind == OptimizerKind::kAdam || c.kind == OptimizerKind::kAdamW;
}

bool UsesSecondMoment(const OptimizerConfig& c) {
  return c.kind == OptimizerKind::kAdam || c.kind == OptimizerKind::kAdamW ||
         c.kind == OptimizerKind::kAdagrad;
}

// The rules follow torch.optim's (default arguments otherwise), so that a
// script moving from a local optimizer to the server sees the same numbers.
template <typename T>
void ApplyUpdate(const OptimizerConfig& c, uint64_t step, T scale, const T* in, T* out,
                 const T* g, T* m, T* v, size_t n) {
  const T lr = static_cast<T>(c.lr);
  const T wd = static_cast<T>(c.weight_decay);
  switch (c.kind) {
    case OptimizerKind::kSum:
      for (size_t i = 0; i < n; ++i) out[i] = in[i] + scale * g[i];
      return;
    case OptimizerKind::kAssign:
      for (size_t i = 0; i < n; ++i) out[i] = scale * g[i];
      return;
    case OptimizerKind::kSgd: {
      const T mu = static_cast<T>(c.momentum);
      if (!(c.momentum > 0)) {
        for (size_t i = 0; i < n; ++i) out[i] = in[i] - lr * (scale * g[i] + wd * in[i]);
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        T d = scale * g[i] + wd * in[i];
        m[i] = mu * m[i] + d;
        out[i] = in[i] - lr * (c.nesterov ? d + mu * m[i] : m[i]);
      }
      return;
    }
    case OptimizerKind::kAdam:
    case OptimizerKind::kAdamW: {
      const bool decoupled = c.kind == OptimizerKind::kAdamW;
      const T b1 = static_cast<T>(c.beta1), b2 = static_cast<T>(c.beta2);
      const double t = static_cast<double>(step);
      const T bc1 = static_cast<T>(1.0 - std::pow(c.beta1, t));
      const T bc2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(c.beta2, t)));
      const T step_size = lr / bc1;
      const T eps = static_cast<T>(c.eps);
      const T decay = static_cast<T>(1.0 - c.lr * c.weight_decay);
      for (size_t i = 0; i < n; ++i) {
        T w = in[i];
        T d = scale * g[i];
        if (decoupled) {
          w *= decay;
        } else {
          d += wd * w;
        }
        m[i] = b1 * m[i] + (1 - b1) * d;
        v[i] = b2 * v[i] + (1 - b2) * d * d;
        out[i] = w - step_size * m[i] / (std::sqrt(v[i]) / bc2_sqrt + eps);
      }
      return;
    }
    case OptimizerKind::kAdagrad: {
      const T eps = static_cast<T>(c.eps);
      for (size_t i = 0; i < n; ++i) {
        T d = scale * g[i] + wd * in[i];
        v[i] += d * d;
        out[i] = in[i] - lr * d / (std::sqrt(v[i]) + eps);
      }
      return;
    }
  }
}

template void ApplyUpdate<float>(const OptimizerConfig&, uint64_t, float, const float*, float*,
                                 const float*, float*, float*, size_t);
template void ApplyUpdate<double>(const OptimizerConfig&, uint64_t, double, const double*,
                                  double*, const double*, double*, double*, size_t);

}  // namespace deepnex::ps
