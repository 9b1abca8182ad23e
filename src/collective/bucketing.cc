#include "deepnex/collective/bucketing.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace deepnex::collective {

struct GradientBucketer::Impl {
  struct Bucket {
    DType dtype;
    std::vector<size_t> members;  // tensor indexes
    std::vector<char> flat;       // empty: a single tensor reduced in place
    size_t pending = 0;           // members not yet marked this round
    std::shared_ptr<Work> work;
  };
  Communicator* comm;
  std::vector<TensorView> tensors;
  BucketOptions options;
  std::vector<Bucket> buckets;
  std::vector<size_t> bucket_of;
  std::vector<bool> marked;
  // Buckets start strictly in order, whatever order tensors are marked in,
  // so every rank issues the same collectives in the same order.
  size_t next_launch = 0;

  void Launch(Bucket& b) {
    if (b.flat.empty()) {
      b.work = comm->AllReduceAsync(tensors[b.members[0]], options.op);
      return;
    }
    size_t off = 0;
    for (size_t i : b.members) {
      std::memcpy(b.flat.data() + off, tensors[i].data, tensors[i].NumBytes());
      off += tensors[i].NumBytes();
    }
    int64_t count = static_cast<int64_t>(b.flat.size() / DTypeSize(b.dtype));
    b.work = comm->AllReduceAsync(TensorView(b.flat.data(), b.dtype, {count}), options.op);
  }
};

GradientBucketer::GradientBucketer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

GradientBucketer::~GradientBucketer() {
  // Collectives in flight read the buffers: let them finish.
  for (auto& b : impl_->buckets) {
    if (b.work) b.work->Wait().IgnoreError();
  }
}

absl::StatusOr<std::unique_ptr<GradientBucketer>> GradientBucketer::Create(
    Communicator* comm, std::vector<TensorView> tensors, const BucketOptions& options) {
  if (comm == nullptr) return absl::InvalidArgumentError("comm is null");
  if (options.bucket_bytes == 0) return absl::InvalidArgumentError("bucket_bytes is 0");
  auto impl = std::make_unique<Impl>();
  impl->comm = comm;
  impl->options = options;
  impl->bucket_of.assign(tensors.size(), 0);
  impl->marked.assign(tensors.size(), false);
  // Reverse order; a bucket closes when the next tensor would overflow it or
  // has another dtype.
  std::vector<Impl::Bucket> open_by_dtype;
  for (size_t k = tensors.size(); k-- > 0;) {
    const TensorView& t = tensors[k];
    DEEPNEX_RETURN_IF_ERROR(t.CheckShape(absl::StrCat("tensor ", k)));
    if (t.data == nullptr && t.NumElements() > 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", k, ": null data"));
    }
    Impl::Bucket* cur = nullptr;
    for (auto& b : open_by_dtype) {
      if (b.dtype == t.dtype) cur = &b;
    }
    uint64_t cur_bytes = 0;
    if (cur != nullptr) {
      for (size_t i : cur->members) cur_bytes += tensors[i].NumBytes();
    }
    if (cur != nullptr && cur_bytes + t.NumBytes() > options.bucket_bytes) {
      impl->buckets.push_back(std::move(*cur));
      open_by_dtype.erase(open_by_dtype.begin() + (cur - open_by_dtype.data()));
      cur = nullptr;
    }
    if (cur == nullptr) {
      open_by_dtype.push_back(Impl::Bucket{t.dtype, {}, {}, 0, nullptr});
      cur = &open_by_dtype.back();
    }
    cur->members.push_back(k);
  }
  for (auto& b : open_by_dtype) impl->buckets.push_back(std::move(b));
  for (size_t bi = 0; bi < impl->buckets.size(); ++bi) {
    auto& b = impl->buckets[bi];
    uint64_t bytes = 0;
    for (size_t i : b.members) {
      impl->bucket_of[i] = bi;
      bytes += tensors[i].NumBytes();
    }
    if (b.members.size() > 1) b.flat.resize(bytes);
    b.pending = b.members.size();
  }
  impl->tensors = std::move(tensors);
  return std::unique_ptr<GradientBucketer>(new GradientBucketer(std::move(impl)));
}

absl::Status GradientBucketer::MarkReady(size_t index) {
  Impl& m = *impl_;
  if (index >= m.tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("mark_ready(", index, "): there are ", m.tensors.size(), " tensors"));
  }
  if (m.marked[index]) {
    return absl::InvalidArgumentError(
        absl::StrCat("mark_ready(", index, "): already marked this round"));
  }
  m.marked[index] = true;
  auto& b = m.buckets[m.bucket_of[index]];
  --b.pending;
  while (m.next_launch < m.buckets.size() && m.buckets[m.next_launch].pending == 0) {
    m.Launch(m.buckets[m.next_launch++]);
  }
  return absl::OkStatus();
}

absl::Status GradientBucketer::MarkAllReady() {
  for (size_t i = 0; i < impl_->tensors.size(); ++i) {
    if (!impl_->marked[i]) DEEPNEX_RETURN_IF_ERROR(MarkReady(i));
  }
  return absl::OkStatus();
}

absl::Status GradientBucketer::Wait() {
  Impl& m = *impl_;
  absl::Status first;
  bool incomplete = false;
  for (auto& b : m.buckets) {
    if (!b.work) {
      incomplete = true;
      continue;
    }
    absl::Status s = b.work->Wait();
    if (s.ok() && !b.flat.empty()) {
      size_t off = 0;
      for (size_t i : b.members) {
        std::memcpy(m.tensors[i].data, b.flat.data() + off, m.tensors[i].NumBytes());
        off += m.tensors[i].NumBytes();
      }
    }
    if (!s.ok() && first.ok()) first = s;
    b.work.reset();
  }
  if (incomplete && first.ok()) {
    // Buckets whose tensors were never marked cannot be skipped on one rank
    // only; the round is refused before anything else goes out of step.
    first = absl::FailedPreconditionError(
        "wait: some tensors were not marked ready this round (call mark_all_ready)");
  }
  for (auto& b : m.buckets) b.pending = b.members.size();
  m.next_launch = 0;
  m.marked.assign(m.tensors.size(), false);
  return first;
}

size_t GradientBucketer::num_buckets() const { return impl_->buckets.size(); }

std::vector<size_t> GradientBucketer::BucketOf() const { return impl_->bucket_of; }

}  // namespace deepnex::collective
