// Trains a linear model y = X w + b with data-parallel workers through a
// deepnex parameter server: each worker thread computes the gradient of the
// squared error on its shard and exchanges it with PushPull every step.
//
//   cpp_trainer [--workers N] [--steps S] [--mode sync|async] [--server HOST:PORT]
//
// Without --server it starts a server in-process on 127.0.0.1. Prints the
// loss as it falls; exits 0 when the final loss is below 1e-3, and 2, saying
// why, for a bad flag or value.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "deepnex/deepnex.h"

namespace {

constexpr int kFeatures = 8;
constexpr int kSamplesPerWorker = 256;

struct Shard {
  std::vector<float> x;  // kSamplesPerWorker x kFeatures, row-major
  std::vector<float> y;
};

// Data from a fixed true model, the same on every run.
Shard MakeShard(int worker) {
  std::mt19937 rng(1234 + worker);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Shard s;
  s.x.resize(kSamplesPerWorker * kFeatures);
  s.y.resize(kSamplesPerWorker);
  for (int i = 0; i < kSamplesPerWorker; ++i) {
    float y = 0.5f;  // true bias
    for (int j = 0; j < kFeatures; ++j) {
      float v = normal(rng);
      s.x[i * kFeatures + j] = v;
      y += v * static_cast<float>(j + 1) * 0.25f;  // true weights
    }
    s.y[i] = y;
  }
  return s;
}

// Mean squared error and its gradient on one shard.
float LossAndGradient(const Shard& s, const std::vector<float>& w, float b,
                      std::vector<float>* gw, float* gb) {
  gw->assign(kFeatures, 0.0f);
  *gb = 0.0f;
  float loss = 0.0f;
  for (int i = 0; i < kSamplesPerWorker; ++i) {
    float pred = b;
    for (int j = 0; j < kFeatures; ++j) pred += s.x[i * kFeatures + j] * w[j];
    float err = pred - s.y[i];
    loss += err * err;
    for (int j = 0; j < kFeatures; ++j) (*gw)[j] += 2 * err * s.x[i * kFeatures + j];
    *gb += 2 * err;
  }
  for (float& g : *gw) g /= kSamplesPerWorker;
  *gb /= kSamplesPerWorker;
  return loss / kSamplesPerWorker;
}

deepnex::TensorView View(std::vector<float>& v) {
  return deepnex::TensorView(v.data(), deepnex::DType::kFloat32,
                             {static_cast<int64_t>(v.size())});
}

// `text` as an int in [1, max], or 0 saying why on stderr.
int Count(const char* flag, const char* text, int max) {
  char* end = nullptr;
  errno = 0;
  long n = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || n < 1 || n > max) {
    std::fprintf(stderr, "cpp_trainer: %s \"%s\": must be a number in 1..%d\n", flag, text, max);
    return 0;
  }
  return static_cast<int>(n);
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage =
      "usage: cpp_trainer [--workers N] [--steps S] [--mode sync|async] [--server HOST:PORT]\n";
  int workers = 2, steps = 200;
  std::string mode = "sync", server_address;
  for (int i = 1; i < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--help") {
      std::fputs(usage, stdout);
      return 0;
    }
    if (i + 1 == argc) {
      std::fprintf(stderr, "cpp_trainer: %s needs a value\n%s", argv[i], usage);
      return 2;
    }
    const char* value = argv[i + 1];
    if (flag == "--workers") {
      workers = Count("--workers", value, deepnex::ps::ServerOptions::kMaxWorkers);
    } else if (flag == "--steps") {
      steps = Count("--steps", value, 1 << 30);
    } else if (flag == "--mode") {
      mode = value;
    } else if (flag == "--server") {
      server_address = value;
    } else {
      std::fprintf(stderr, "cpp_trainer: unknown flag %s\n%s", argv[i], usage);
      return 2;
    }
    if (workers == 0 || steps == 0) return 2;
  }

  std::unique_ptr<deepnex::ps::Server> server;
  if (server_address.empty()) {
    deepnex::ps::ServerOptions options;
    auto parsed = deepnex::ps::ParseMode(mode);
    if (!parsed.ok()) {
      std::fprintf(stderr, "cpp_trainer: %s\n", std::string(parsed.status().message()).c_str());
      return 2;
    }
    options.mode = *parsed;
    options.num_workers = workers;
    options.optimizer.lr = 0.05;
    auto created = deepnex::ps::Server::Create(options);
    if (!created.ok()) {
      std::fprintf(stderr, "cpp_trainer: %s\n", std::string(created.status().message()).c_str());
      return 1;
    }
    server = std::move(*created);
    server_address = server->address();
  }
  std::printf("cpp_trainer: %d workers, %s mode, server %s\n", workers, mode.c_str(),
              server_address.c_str());

  std::vector<float> final_loss(workers, 0.0f);
  std::vector<std::string> errors(workers);
  std::vector<std::thread> threads;
  for (int k = 0; k < workers; ++k) {
    threads.emplace_back([&, k] {
      deepnex::ps::ClientOptions options;
      options.servers = {server_address};
      options.worker_id = k;
      auto client = deepnex::ps::Client::Create(options);
      if (!client.ok()) {
        errors[k] = std::string(client.status().message());
        return;
      }
      Shard shard = MakeShard(k);
      std::vector<float> w(kFeatures, 0.0f), b(1, 0.0f), gw, gb(1);
      absl::Status s = (*client)->Init({{"w", View(w)}, {"b", View(b)}});
      if (s.ok()) s = (*client)->Pull({{"w", View(w)}, {"b", View(b)}});
      for (int step = 1; step <= steps && s.ok(); ++step) {
        float loss = LossAndGradient(shard, w, b[0], &gw, &gb[0]);
        final_loss[k] = loss;
        if (k == 0 && (step == 1 || step % 20 == 0)) {
          std::printf("step %4d  loss %.6f\n", step, loss);
          std::fflush(stdout);
        }
        s = (*client)->PushPull({{"w", View(gw)}, {"b", View(gb)}},
                                {{"w", View(w)}, {"b", View(b)}});
      }
      if (!s.ok()) errors[k] = std::string(s.message());
    });
  }
  for (auto& t : threads) t.join();
  for (int k = 0; k < workers; ++k) {
    if (!errors[k].empty()) {
      std::fprintf(stderr, "cpp_trainer: worker %d: %s\n", k, errors[k].c_str());
      return 1;
    }
  }
  std::printf("final loss %.6f\n", final_loss[0]);
  return final_loss[0] < 1e-3f ? 0 : 1;
}
