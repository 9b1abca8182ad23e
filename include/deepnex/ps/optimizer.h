// Server-side optimizers of the parameter server. The configuration is a
// plain value; the update rules live in src/ps/optimizer.cc.
#ifndef DEEPNEX_PS_OPTIMIZER_H_
#define DEEPNEX_PS_OPTIMIZER_H_

#include <string>

#include "deepnex/status.h"

namespace deepnex::ps {

enum class OptimizerKind {
  kSgd,      // w -= lr * (g + wd*w), with optional (Nesterov) momentum
  kAdam,     // Adam; weight_decay adds wd*w to the gradient (L2)
  kAdamW,    // Adam with decoupled weight decay: w -= lr * wd * w
  kAdagrad,  // Adagrad
  kSum,      // w += g (pure aggregation)
  kAssign,   // w = g (last writer wins; in sync mode the round's aggregate)
};

struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kSgd;
  // Learning rate. Default: 0.01, SGD's DefaultLr (set DefaultLr(kind)
  // with another kind: deepnex-ps and deepnex run do)
  double lr = 0.01;
  // SGD momentum; 0 disables the momentum buffer. Default: 0
  double momentum = 0.0;
  // SGD: Nesterov momentum (requires momentum > 0). Default: false
  bool nesterov = false;
  // L2 (SGD, Adam, Adagrad) or decoupled (AdamW) weight decay. Default: 0
  double weight_decay = 0.0;
  // Adam / AdamW moment decay rates. Default: 0.9, 0.999
  double beta1 = 0.9;
  double beta2 = 0.999;
  // Adam / AdamW / Adagrad denominator term. Default: 1e-8 (deepnex-ps and
  // Python's Adagrad default to 1e-10, as torch does)
  double eps = 1e-8;
  // Adagrad's starting accumulator. Default: 0
  double initial_accumulator = 0.0;

  // InvalidArgument naming the field for negative lr, betas outside [0, 1),
  // Nesterov without momentum, and so on.
  absl::Status Validate() const;
  // "sgd(lr=0.1, momentum=0.9)"
  std::string ToString() const;
};

// The learning rate an optimizer takes when none is given, as torch.optim
// and deepnex.ps (Python) have it: 0.001 for Adam and AdamW, 0.01 for the
// others.
double DefaultLr(OptimizerKind kind);

// "sgd", "adam", "adamw", "adagrad", "sum", "assign".
const char* OptimizerKindName(OptimizerKind kind);
absl::StatusOr<OptimizerKind> ParseOptimizerKind(const std::string& name);

}  // namespace deepnex::ps

#endif  // DEEPNEX_PS_OPTIMIZER_H_
