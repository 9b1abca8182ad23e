#include "common.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "deepnex/units.h"

namespace deepnex::python {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "buffer format checks assume a little-endian host");

[[noreturn]] void Invalid(const std::string& what, const std::string& why) {
  ThrowStatus(absl::InvalidArgumentError(absl::StrCat(what, ": ", why)));
}

constexpr char kSupported[] =
    "use float32, float64, float16, int32, int64 or uint8 (bfloat16 as "
    "uint16 bits with an explicit bfloat16 dtype)";

// The dtype of a buffer format (struct module syntax) and item size; 0 when
// it is not one deepnex takes. A uint16/int16 buffer maps to bfloat16, which
// ViewOf accepts only when asked for.
DType FormatToDType(const std::string& what, const std::string& format,
                    py::ssize_t itemsize, const char* supported) {
  std::string f = format;
  if (!f.empty() && std::strchr("@=<>!", f[0]) != nullptr) {
    if (f[0] == '>' || f[0] == '!') {
      Invalid(what, absl::StrCat("the buffer is big-endian (format \"", format,
                                 "\"); deepnex takes native byte order"));
    }
    f.erase(0, 1);
  }
  DType dtype = static_cast<DType>(0);
  if (f.size() == 1) {
    switch (f[0]) {
      case 'f':
        dtype = DType::kFloat32;
        break;
      case 'd':
        dtype = DType::kFloat64;
        break;
      case 'e':
        dtype = DType::kFloat16;
        break;
      case 'i':
        dtype = DType::kInt32;
        break;
      case 'l':
      case 'q':
        dtype = itemsize == 4 ? DType::kInt32 : DType::kInt64;
        break;
      case 'B':
        dtype = DType::kUInt8;
        break;
      case 'H':
      case 'h':
        dtype = DType::kBFloat16;
        break;
    }
  }
  if (!IsValidDType(static_cast<int>(dtype)) ||
      static_cast<py::ssize_t>(DTypeSize(dtype)) != itemsize) {
    Invalid(what, absl::StrCat("buffer format \"", format, "\" (", itemsize,
                               "-byte items) is not supported; ", supported));
  }
  return dtype;
}

}  // namespace

StatusError::StatusError(absl::Status status)
    : status_(std::move(status)), what_(status_.ToString()) {}

void ThrowStatus(const absl::Status& status) { throw StatusError(status); }

BufferView ViewOf(const py::buffer& buffer, bool writable,
                  const std::string& what, std::optional<DType> as, const char* supported) {
  if (supported == nullptr) supported = kSupported;
  // Ask for a read-only buffer and check writability ourselves, so that a
  // read-only output gets our error rather than a BufferError.
  BufferView result{buffer.request(/*writable=*/false), TensorView()};
  const py::buffer_info& info = result.info;

  DType dtype = FormatToDType(what, info.format, info.itemsize, supported);
  if (dtype == DType::kBFloat16 && as != DType::kBFloat16) {
    Invalid(what,
            absl::StrCat("a 16-bit integer buffer (format \"", info.format,
                         "\") is taken only as bfloat16 bits, with an "
                         "explicit bfloat16 dtype; ",
                         supported));
  }
  if (as.has_value() && *as != dtype) {
    Invalid(what, absl::StrCat("got ", DTypeName(dtype), " values, expected ",
                               DTypeName(*as)));
  }

  std::vector<int64_t> shape(info.shape.begin(), info.shape.end());
  bool empty = false;
  for (int64_t d : shape) empty = empty || d == 0;
  if (!empty) {
    py::ssize_t expected = info.itemsize;
    for (size_t i = info.shape.size(); i-- > 0;) {
      if (info.shape[i] != 1 && info.strides[i] != expected) {
        Invalid(what,
                absl::StrCat("the array is not C-contiguous (shape [",
                             absl::StrJoin(info.shape, ", "), "], strides [",
                             absl::StrJoin(info.strides, ", "),
                             "] bytes); deepnex never copies: pass "
                             "numpy.ascontiguousarray(x) or x.contiguous()"));
      }
      expected *= info.shape[i];
    }
  }
  if (writable && info.readonly) {
    Invalid(what,
            "the array is read-only, but deepnex writes into it; pass a "
            "writable array");
  }
  result.view = TensorView(info.ptr, dtype, std::move(shape));
  return result;
}

std::chrono::milliseconds Millis(double seconds, const char* field) {
  return Unwrap(SecondsToMillis(seconds, field));
}

std::chrono::milliseconds MillisOrZero(double seconds, const char* field) {
  return Unwrap(SecondsToMillis(seconds, field, /*zero_ok=*/true));
}

}  // namespace deepnex::python
