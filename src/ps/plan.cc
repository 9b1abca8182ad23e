#include "ps/plan.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "deepnex/tensor.h"

namespace deepnex::ps {

absl::StatusOr<uint64_t> CheckTensorMeta(const std::string& what, const proto::TensorMeta& meta) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  if (meta.key().empty()) return bad("empty key");
  if (!IsValidDType(meta.dtype())) return bad(absl::StrCat("unknown dtype ", meta.dtype()));
  if (!IsFloatingPoint(static_cast<DType>(meta.dtype()))) {
    return bad(absl::StrCat("dtype ", DTypeName(static_cast<DType>(meta.dtype())),
                            "; parameters must be float32, float64, float16 or bfloat16"));
  }
  uint64_t elements = 1, bytes;
  for (int64_t d : meta.shape()) {
    if (d < 0) return bad(absl::StrCat("negative dimension ", d));
    if (__builtin_mul_overflow(elements, static_cast<uint64_t>(d), &elements)) {
      return bad("the shape has more than 2^64 elements");
    }
  }
  if (__builtin_mul_overflow(elements, DTypeSize(static_cast<DType>(meta.dtype())), &bytes)) {
    return bad(absl::StrCat(elements, " elements are more than 2^64 bytes"));
  }
  const uint64_t most = std::min<uint64_t>(std::max<uint64_t>(1, elements), kMaxParts);
  if (meta.num_parts() < 1 || meta.num_parts() > most) {
    return bad(absl::StrCat("num_parts ", meta.num_parts(), " for ", elements,
                            " elements; must be 1..", most));
  }
  return elements;
}

absl::StatusOr<uint64_t> CheckPart(const std::string& what, const std::string& key, uint32_t part,
                                   uint64_t offset, uint64_t count, int dtype,
                                   const proto::TensorMeta& meta) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
  };
  if (key.empty()) return bad("empty key");
  if (meta.key() != key) return bad(absl::StrCat("its meta is of \"", meta.key(), "\""));
  if (meta.dtype() != dtype) {
    return bad(absl::StrCat("dtype ", dtype, ", its meta says ", meta.dtype()));
  }
  DEEPNEX_ASSIGN_OR_RETURN(uint64_t elements, CheckTensorMeta(what, meta));
  if (part >= meta.num_parts()) {
    return bad(absl::StrCat("outside the tensor's ", meta.num_parts(), " parts"));
  }
  PartRange range = PartOf(elements, meta.num_parts(), part);
  if (offset != range.offset || count != range.count) {
    return bad(absl::StrFormat("got %d elements at offset %d; %d parts of %s make it %d at offset %d",
                               count, offset, meta.num_parts(), ShapeString(meta), range.count,
                               range.offset));
  }
  // No wrap: count <= elements, and elements * size fit a checked shape.
  return count * DTypeSize(static_cast<DType>(dtype));
}

std::string ShapeString(const proto::TensorMeta& meta) {
  std::vector<int64_t> shape(meta.shape().begin(), meta.shape().end());
  return DescribeShape(shape, static_cast<DType>(meta.dtype()));
}

}  // namespace deepnex::ps
