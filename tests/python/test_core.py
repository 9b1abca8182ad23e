"""Tests of deepnex's core bindings: byte sizes, errors, the job context,
zero-copy buffer views, the conversion module, the bound option structs and
what the CLI commands share."""

import logging
import math
import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

import deepnex
from deepnex import _C, errors

GiB = 1 << 30


# --- byte sizes -------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GiB", 8 * GiB),
        ("512M", 512 << 20),
        ("1.5G", 3 * GiB // 2),
        ("4096", 4096),
        ("10 KiB", 10 << 10),
        ("1KB", 1000),
        ("10gb", 10_000_000_000),  # decimal units, any case: --gpu-memory 10gb
        ("24 GB", 24_000_000_000),  # a nodes file's "24 GB" as the CLI's "24GB"
        ("0", 0),
        ("18446744073709551615", 2**64 - 1),
        ("9007199254740993", 9007199254740993),  # not a double
    ],
)
def test_parse_byte_size(text, expected):
    assert deepnex.parse_byte_size(text) == expected
    assert type(deepnex.parse_byte_size(text)) is int


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "empty"),
        ("-1G", "negative"),
        ("12XB", 'unknown unit "XB"; use B, KiB, MiB, GiB'),
        ("10 XB", 'unknown unit "XB"'),
        ("1.5.2G", "a number has at most one '.'"),
        ("99999999999999TiB", "too large"),
        ("abc", "no number"),
        ("nan", "no number"),
        ("inf", "no number"),
        ("1.5", "a fraction of a byte"),
        ("20000PiB", "too large"),
        ("18446744073709551616", "too large"),
    ],
)
def test_parse_byte_size_refuses(text, why):
    with pytest.raises(deepnex.InvalidArgumentError) as info:
        deepnex.parse_byte_size(text, "memory")
    message = str(info.value)
    assert message.startswith(f'memory: "{text}" is not a byte size (')
    assert why in message
    assert info.value.code == "INVALID_ARGUMENT"
    assert isinstance(info.value, ValueError)


def test_parse_byte_size_default_field_and_keywords():
    with pytest.raises(ValueError, match=r'^size: "x" is not a byte size'):
        deepnex.parse_byte_size("x")
    assert deepnex.parse_byte_size(text="2K", field="f") == 2048


def test_format_byte_size():
    assert deepnex.format_byte_size(8 * GiB) == "8GiB"
    assert deepnex.format_byte_size(16 * GiB) == "16GiB"
    assert deepnex.format_byte_size(1000) == "1000B"
    assert deepnex.format_byte_size(0) == "0B"
    # Inexact sizes: one decimal in the largest binary unit that fits.
    assert deepnex.format_byte_size(deepnex.parse_byte_size("10gb")) == "9.3GiB"
    assert deepnex.format_byte_size(24_000_000_000) == "22.4GiB"
    assert deepnex.format_byte_size(1536) == "1.5KiB"
    assert deepnex.format_byte_size(GiB + 1) == "1.0GiB"
    assert deepnex.format_byte_size(2**64 - 1) == "16.0EiB"
    for n in (0, 1, 1000, 1536, 8 * GiB, 3 * GiB // 2):
        assert deepnex.parse_byte_size(deepnex.format_byte_size(n)) == n


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_format_byte_size_refuses_out_of_range(bad):
    with pytest.raises(deepnex.InvalidArgumentError, match=f"bytes={bad} is not"):
        deepnex.format_byte_size(bad)


def test_format_byte_size_refuses_non_int():
    with pytest.raises(TypeError):
        deepnex.format_byte_size(1.5)


# --- the daemons and their entry points -------------------------------------

TOOLS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src", "tools")


def _program(tool):
    """The built daemon: the package's deepnex/bin/ or the build tree's bin/."""
    for d in (os.path.join(os.path.dirname(os.path.abspath(deepnex.__file__)), "bin"),
              os.path.join(os.environ.get("DEEPNEX_BUILD_DIR", ""), "bin")):
        if os.access(os.path.join(d, tool), os.X_OK):
            return os.path.join(d, tool)
    pytest.skip(f"{tool} is not built")


@pytest.mark.parametrize("tool", ["deepnex-central", "deepnex-ps", "deepnex-store"])
def test_every_daemon_flag_is_in_its_help(tool):
    source = open(os.path.join(TOOLS_SOURCE, tool[len("deepnex-"):] + "_main.cc")).read()
    accepted = set(re.findall(r'flags\.Is\("(--[a-z0-9-]+)"\)', source))
    assert "--listen" in accepted
    out = subprocess.run([_program(tool), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    # Each flag starts a line of the flag list ("  --flag ...") or follows
    # another on it ("--tls-cert F --tls-key F").
    listed = set(re.findall(r"(?m)(?:^  |  | [A-Z]+ )(--[a-z0-9-]+)", out.stdout))
    assert accepted - listed == set(), out.stdout


def test_central_backend_flag_and_its_alias():
    central = _program("deepnex-central")
    for flag in ("--backend", "--launch-backend"):
        out = subprocess.run([central, "--listen", "127.0.0.1:0", flag, "nosuch"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and '"nosuch"' in out.stderr, (flag, out.stderr)


def test_the_entry_point_names_a_missing_program(tmp_path):
    """A package whose deepnex/bin/ lost a program: the entry point says which."""
    fake = tmp_path / "deepnex"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    main = os.path.join(os.path.dirname(os.path.abspath(deepnex.__file__)), "__main__.py")
    (fake / "__main__.py").write_text(open(main).read())
    out = subprocess.run(
        [sys.executable, "-c", "from deepnex.__main__ import store; store()"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path)), cwd=tmp_path, capture_output=True,
        text=True, timeout=60)
    missing = fake / "bin" / "deepnex-store"
    assert (out.returncode, out.stderr) == (
        1, f"deepnex-store: {missing} is missing; reinstall the deepnex package\n")


# --- dtypes -----------------------------------------------------------------


def test_dtypes():
    assert _C.DTYPE_NAMES == (
        "float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8",
    )
    assert deepnex.DType.bfloat16.name == "bfloat16"
    assert int(deepnex.DType.float32) == 1 and int(deepnex.DType.uint8) == 7
    assert _C.parse_dtype("int64") == deepnex.DType.int64
    assert [_C.dtype_size(_C.parse_dtype(n)) for n in _C.DTYPE_NAMES] == [
        4, 8, 2, 2, 4, 8, 1,
    ]
    with pytest.raises(deepnex.InvalidArgumentError, match='dtype "f4" is unknown'):
        _C.parse_dtype("f4")


# --- errors -----------------------------------------------------------------

# (class, code name, code number, builtin base or None)
ERRORS = [
    (errors.CancelledError, "CANCELLED", 1, None),
    (errors.UnknownError, "UNKNOWN", 2, None),
    (errors.InvalidArgumentError, "INVALID_ARGUMENT", 3, ValueError),
    (errors.DeadlineExceededError, "DEADLINE_EXCEEDED", 4, TimeoutError),
    (errors.NotFoundError, "NOT_FOUND", 5, KeyError),
    (errors.AlreadyExistsError, "ALREADY_EXISTS", 6, None),
    (errors.PermissionDeniedError, "PERMISSION_DENIED", 7, PermissionError),
    (errors.ResourceExhaustedError, "RESOURCE_EXHAUSTED", 8, None),
    (errors.FailedPreconditionError, "FAILED_PRECONDITION", 9, None),
    (errors.AbortedError, "ABORTED", 10, None),
    (errors.OutOfRangeError, "OUT_OF_RANGE", 11, IndexError),
    (errors.UnimplementedError, "UNIMPLEMENTED", 12, NotImplementedError),
    (errors.InternalError, "INTERNAL", 13, None),
    (errors.UnavailableError, "UNAVAILABLE", 14, ConnectionError),
    (errors.DataLossError, "DATA_LOSS", 15, None),
    (errors.UnauthenticatedError, "UNAUTHENTICATED", 16, PermissionError),
]


@pytest.mark.parametrize("cls, name, value, builtin", ERRORS)
def test_error_classes(cls, name, value, builtin):
    assert issubclass(cls, deepnex.DeepnexError)
    assert issubclass(cls, Exception)
    if builtin is not None:
        assert issubclass(cls, builtin)
    assert cls.code == name and cls.code_value == value
    assert errors.error_for_code(name) is cls
    assert errors.error_for_code(value) is cls
    assert getattr(deepnex, cls.__name__) is cls
    e = cls("what went wrong")
    assert str(e) == "what went wrong"
    assert e.code == name


@pytest.mark.parametrize("cls, name, value, builtin", ERRORS)
def test_status_from_cpp_raises_the_matching_class(cls, name, value, builtin):
    with pytest.raises(cls) as info:
        _C._raise_status(value, f'thing "x" failed ({name})')
    assert type(info.value) is cls
    assert info.value.code == name
    assert str(info.value) == f'thing "x" failed ({name})'
    if builtin is not None:
        assert isinstance(info.value, builtin)


def test_a_message_that_is_not_utf8_is_still_its_codes_error():
    """A C++ error naming a path of bytes that are not UTF-8: the strict
    decode failed, and the caller got a UnicodeDecodeError, not the error."""
    with pytest.raises(deepnex.NotFoundError) as info:
        _C._raise_status(5, b'checkpoint "/tmp/caf\xe9.ckpt" cannot be read')
    assert str(info.value) == 'checkpoint "/tmp/caf\\xe9.ckpt" cannot be read'


def test_only_builtins_that_fit():
    assert not issubclass(errors.AlreadyExistsError, (ValueError, KeyError))
    assert not issubclass(errors.InternalError, RuntimeError)
    assert not issubclass(deepnex.InvalidArgumentError, KeyError)


def test_not_found_str_is_not_repr_quoted():
    e = errors.NotFoundError('key "fc1" is not there')
    assert str(e) == 'key "fc1" is not there'
    assert e.args == ('key "fc1" is not there',)


def test_error_for_unknown_code():
    assert errors.error_for_code("NO_SUCH") is errors.UnknownError
    assert errors.error_for_code("invalid_argument") is errors.InvalidArgumentError
    assert errors.error_for_code(0) is errors.UnknownError
    assert errors.error_for_code(99) is errors.UnknownError
    assert _C._raise_status(0, "ok") is None


def test_errors_are_catchable_as_deepnex_error():
    with pytest.raises(deepnex.DeepnexError):
        deepnex.parse_byte_size("bad")


# --- the job context --------------------------------------------------------


def test_init_minimal(job_env):
    ctx = deepnex.init()
    assert isinstance(ctx, deepnex.Context)
    assert ctx.job_id == "mnist-42"
    assert ctx.role == "worker"
    assert (ctx.rank, ctx.world_size, ctx.local_rank) == (1, 4, 0)
    assert ctx.ps_addrs == []
    assert ctx.store_addr == ""
    assert ctx.token == ""
    assert ctx.cuda_visible_devices == ""
    assert ctx.nvidia_visible_devices == ""
    assert ctx.gpu_memory_limit is None


def test_init_full(job_env):
    job_env.setenv("DEEPNEX_ROLE", "ps")
    job_env.setenv("DEEPNEX_LOCAL_RANK", "1")
    job_env.setenv("DEEPNEX_PS_ADDRS", "ps-0:7000,[::1]:7001")
    job_env.setenv("DEEPNEX_STORE_ADDR", "10.0.0.1:29500")
    job_env.setenv("DEEPNEX_TOKEN", "s3cret")
    job_env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    job_env.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-a,GPU-b")
    job_env.setenv("DEEPNEX_GPU_MEMORY_LIMIT", "1.5GiB")
    ctx = deepnex.init()
    assert ctx.role == "ps"
    assert ctx.local_rank == 1
    assert ctx.ps_addrs == ["ps-0:7000", "[::1]:7001"]
    assert ctx.token == "s3cret"
    assert ctx.cuda_visible_devices == "0,1"
    assert ctx.nvidia_visible_devices == "GPU-a,GPU-b"
    assert ctx.gpu_memory_limit == 3 * GiB // 2
    assert "s3cret" not in repr(ctx)
    assert "job_id='mnist-42'" in repr(ctx)
    env = ctx.to_env()
    assert env == {
        "DEEPNEX_JOB_ID": "mnist-42",
        "DEEPNEX_ROLE": "ps",
        "DEEPNEX_RANK": "1",
        "DEEPNEX_WORLD_SIZE": "4",
        "DEEPNEX_LOCAL_RANK": "1",
        "DEEPNEX_PS_ADDRS": "ps-0:7000,[::1]:7001",
        "DEEPNEX_STORE_ADDR": "10.0.0.1:29500",
        "DEEPNEX_TOKEN": "s3cret",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "NVIDIA_VISIBLE_DEVICES": "GPU-a,GPU-b",
        "DEEPNEX_GPU_MEMORY_LIMIT": "1610612736",
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    assert deepnex.init(env).to_env() == env


# --- init() hands the shared-GPU memory limit to the frameworks -------------


def fake_torch(calls, available=True, totals=(80 * GiB, 40 * GiB)):
    """A stand-in for torch at its boundary: the CUDA calls init() makes."""
    cuda = types.SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: len(totals),
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=totals[i]),
        set_per_process_memory_fraction=lambda fraction, device: calls.append(
            ("fraction", fraction, device)))
    return types.SimpleNamespace(cuda=cuda)


def fake_tensorflow(calls, gpus=("GPU:0", "GPU:1"), refuse=False):
    """A stand-in for tensorflow's tf.config calls that init() makes."""
    def growth(device, enable):
        if refuse:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        calls.append(("growth", device, enable))

    config = types.SimpleNamespace(
        list_physical_devices=lambda kind: list(gpus) if kind == "GPU" else [],
        experimental=types.SimpleNamespace(set_memory_growth=growth),
        set_logical_device_configuration=lambda device, logical: calls.append(
            ("logical", device, [c.memory_limit for c in logical])),
        LogicalDeviceConfiguration=lambda memory_limit: types.SimpleNamespace(
            memory_limit=memory_limit))
    return types.SimpleNamespace(config=config)


def test_init_applies_the_gpu_memory_limit_to_torch_and_tensorflow(job_env, caplog):
    calls = []
    job_env.setitem(sys.modules, "torch", fake_torch(calls))
    job_env.setitem(sys.modules, "tensorflow", fake_tensorflow(calls))
    job_env.setenv("DEEPNEX_GPU_MEMORY_LIMIT", "20GiB")
    with caplog.at_level(logging.INFO, logger="deepnex"):
        ctx = deepnex.init()
    assert ctx.gpu_memory_limit == 20 * GiB
    assert calls == [("fraction", 0.25, 0), ("fraction", 0.5, 1),
                     ("growth", "GPU:0", True), ("growth", "GPU:1", True),
                     ("logical", "GPU:0", [20480]), ("logical", "GPU:1", [20480])]
    assert [r.getMessage() for r in caplog.records] == [
        "deepnex: DEEPNEX_GPU_MEMORY_LIMIT=20GiB per GPU applied to PyTorch (memory fraction "
        "0.25, 0.5 on 2 GPU(s)) and TensorFlow (memory growth and a 20480MiB logical device "
        "on 2 GPU(s)) (the frameworks' allocators enforce it; hard enforcement needs a CUDA "
        "driver hook)"]


def test_init_says_when_the_limit_could_not_be_applied(job_env, caplog):
    calls = []
    job_env.delitem(sys.modules, "torch", raising=False)
    job_env.delitem(sys.modules, "tensorflow", raising=False)
    job_env.setenv("DEEPNEX_GPU_MEMORY_LIMIT", "1GiB")
    with caplog.at_level(logging.INFO, logger="deepnex"):
        deepnex.init()
    assert "torch" not in sys.modules and "tensorflow" not in sys.modules  # never imported
    assert caplog.records[-1].getMessage().startswith(
        "deepnex: DEEPNEX_GPU_MEMORY_LIMIT=1GiB per GPU not applied: neither torch nor "
        "tensorflow is imported yet (")
    # A GPU-less torch and a TensorFlow that initialized its GPUs already.
    job_env.setitem(sys.modules, "torch", fake_torch(calls, available=False))
    job_env.setitem(sys.modules, "tensorflow", fake_tensorflow(calls, refuse=True))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepnex"):
        deepnex.init()
    assert calls == []
    assert caplog.records[-1].getMessage().startswith(
        "deepnex: DEEPNEX_GPU_MEMORY_LIMIT=1GiB per GPU not applied: PyTorch sees no CUDA "
        "device; TensorFlow refused it (Physical devices cannot be modified after being "
        "initialized) (")
    # No limit (exclusive GPUs): the frameworks are left alone.
    job_env.delenv("DEEPNEX_GPU_MEMORY_LIMIT")
    job_env.setitem(sys.modules, "torch", fake_torch(calls))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepnex"):
        deepnex.init()
    assert calls == [] and caplog.records == []


def test_context_is_read_only(job_env):
    ctx = deepnex.init()
    with pytest.raises(AttributeError):
        ctx.rank = 3
    with pytest.raises(TypeError):
        deepnex.Context()


def test_from_env_with_a_mapping(clean_job_env):
    ctx = deepnex.Context.from_env(
        {"DEEPNEX_JOB_ID": "j", "DEEPNEX_ROLE": "chief", "DEEPNEX_RANK": "0",
         "DEEPNEX_WORLD_SIZE": "1"}
    )
    assert (ctx.job_id, ctx.role, ctx.rank, ctx.world_size) == ("j", "chief", 0, 1)


@pytest.mark.parametrize(
    "name", ["DEEPNEX_JOB_ID", "DEEPNEX_ROLE", "DEEPNEX_RANK", "DEEPNEX_WORLD_SIZE"]
)
def test_init_missing_variable(job_env, name):
    job_env.delenv(name)
    with pytest.raises(deepnex.InvalidArgumentError) as info:
        deepnex.init()
    assert str(info.value) == (
        f"{name} is not set (the job environment is given by a deepnex launcher)"
    )
    assert info.value.code == "INVALID_ARGUMENT"


def test_init_with_no_environment_at_all(clean_job_env):
    with pytest.raises(ValueError, match="^DEEPNEX_JOB_ID is not set"):
        deepnex.init()


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("DEEPNEX_RANK", "x", 'DEEPNEX_RANK="x" is not an integer'),
        ("DEEPNEX_RANK", "4", 'DEEPNEX_RANK="4" is out of range: must be '
                              "0 <= rank < DEEPNEX_WORLD_SIZE (4)"),
        ("DEEPNEX_WORLD_SIZE", "0", 'DEEPNEX_WORLD_SIZE="0" must be at least 1'),
        ("DEEPNEX_ROLE", "boss",
         'DEEPNEX_ROLE="boss" is not a role (use worker, ps or chief)'),
        ("DEEPNEX_LOCAL_RANK", "-1", 'DEEPNEX_LOCAL_RANK="-1" must not be negative'),
        ("DEEPNEX_PS_ADDRS", "ps-0:0",
         'DEEPNEX_PS_ADDRS="ps-0:0" has entry "ps-0:0", which has port "0" '
         "(must be 1..65535)"),
        ("DEEPNEX_PS_ADDRS", ":7000",
         'DEEPNEX_PS_ADDRS=":7000" has entry ":7000", which has an empty host '
         "(expected host:port)"),
        ("DEEPNEX_GPU_MEMORY_LIMIT", "12XB",
         'DEEPNEX_GPU_MEMORY_LIMIT: "12XB" is not a byte size (unknown unit "XB"'),
        ("DEEPNEX_JOB_ID", "", "DEEPNEX_JOB_ID is set but empty"),
    ],
)
def test_init_malformed_variable(job_env, name, value, message):
    job_env.setenv(name, value)
    with pytest.raises(deepnex.InvalidArgumentError) as info:
        deepnex.init()
    assert str(info.value).startswith(message)


# --- buffer views -----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, name",
    [
        (np.float32, "float32"),
        (np.float64, "float64"),
        (np.float16, "float16"),
        (np.int32, "int32"),
        (np.int64, "int64"),
        (np.uint8, "uint8"),
        (np.intc, "int32"),
        (np.longlong, "int64"),
    ],
)
def test_view_is_the_arrays_memory(dtype, name):
    a = np.zeros((3, 4), dtype=dtype)
    got_name, shape, address, nbytes = _C._view_info(a, True)
    assert got_name == name
    assert shape == (3, 4)
    assert address == a.ctypes.data
    assert nbytes == a.nbytes


def test_view_shapes():
    assert _C._view_info(np.float32(1.0).reshape(()))[1] == ()
    assert _C._view_info(np.zeros(0, np.float32))[1] == (0,)
    # Size-1 and empty dimensions may carry any stride.
    a = np.zeros((4, 6), np.float32)
    assert _C._view_info(a[:1, :])[2] == a.ctypes.data
    assert _C._view_info(a[1:2, :])[2] == a.ctypes.data + 24
    assert _C._view_info(a[:, 2:2])[1] == (4, 0)
    # A contiguous slice is fine and points into the parent.
    assert _C._view_info(a[2:])[2] == a.ctypes.data + 2 * 24


def test_view_works_on_other_buffer_exporters():
    b = bytearray(b"\x01\x02\x03")
    assert _C._view_info(b, True)[:2] == ("uint8", (3,))
    m = memoryview(np.arange(6, dtype=np.int64))
    assert _C._view_info(m)[:2] == ("int64", (6,))


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.T,
        lambda a: a[:, ::2],
        lambda a: a[::2],
        lambda a: np.asfortranarray(a),
    ],
)
def test_non_contiguous_raises_and_never_copies(make):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    with pytest.raises(deepnex.InvalidArgumentError,
                       match=r"^array: the array is not C-contiguous \(shape "
                             r"\[.*\], strides \[.*\] bytes\); deepnex never copies"):
        _C._view_info(make(a))


def test_read_only_output_raises():
    a = np.zeros(4, np.float32)
    a.setflags(write=False)
    assert _C._view_info(a, False)[2] == a.ctypes.data
    with pytest.raises(deepnex.InvalidArgumentError,
                       match="^array: the array is read-only, but deepnex writes"):
        _C._view_info(a, True)
    with pytest.raises(ValueError, match="read-only"):
        _C._view_info(b"abc", True)


@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint16, np.int16, np.uint32, np.uint64, np.bool_,
              np.complex64]
)
def test_unsupported_dtype_raises(dtype):
    with pytest.raises(deepnex.InvalidArgumentError, match="^array: "):
        _C._view_info(np.zeros(3, dtype=dtype))


def test_big_endian_raises():
    a = np.zeros(3, dtype=">f4")
    with pytest.raises(deepnex.InvalidArgumentError, match="big-endian"):
        _C._view_info(a)


def test_dtype_override():
    bits = np.zeros(5, np.uint16)
    name, shape, address, nbytes = _C._view_info(bits, True, deepnex.DType.bfloat16)
    assert (name, shape, address, nbytes) == ("bfloat16", (5,), bits.ctypes.data, 10)
    assert _C._view_info(bits.view(np.int16), False, deepnex.DType.bfloat16)[0] == (
        "bfloat16"
    )
    f = np.zeros(5, np.float32)
    assert _C._view_info(f, False, deepnex.DType.float32)[0] == "float32"
    with pytest.raises(deepnex.InvalidArgumentError,
                       match="^array: got float32 values, expected float64$"):
        _C._view_info(f, False, deepnex.DType.float64)
    with pytest.raises(deepnex.InvalidArgumentError,
                       match="got float32 values, expected bfloat16"):
        _C._view_info(f, False, deepnex.DType.bfloat16)
    with pytest.raises(deepnex.InvalidArgumentError, match="taken only as bfloat16"):
        _C._view_info(bits)


def test_torch_tensors_through_to_buffer():
    torch = pytest.importorskip("torch")
    from deepnex._convert import to_buffer

    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    buf, dtype = to_buffer(t, "t")
    assert dtype is None
    assert _C._view_info(buf, True)[:3] == ("float32", (2, 3), t.data_ptr())

    w = torch.zeros(4, requires_grad=True)
    assert _C._view_info(to_buffer(w, "w")[0])[2] == w.data_ptr()

    b = torch.zeros(3, 2, dtype=torch.bfloat16)
    buf, dtype = to_buffer(b, "b")
    assert dtype == deepnex.DType.bfloat16
    assert _C._view_info(buf, True, dtype)[:3] == ("bfloat16", (3, 2), b.data_ptr())

    with pytest.raises(deepnex.InvalidArgumentError, match="not C-contiguous"):
        _C._view_info(to_buffer(t.t(), "t")[0])

    a = np.zeros(2, np.float32)
    assert to_buffer(a, "a") == (a, None)


def test_to_buffer_refuses_what_is_neither_an_array_nor_a_tensor():
    from deepnex._convert import to_buffer
    with pytest.raises(TypeError) as e:
        to_buffer([1.0, 2.0], "grad")
    assert str(e.value) == "grad: expected a numpy array or a torch tensor, got list"


def test_byte_size_takes_ints_and_size_strings_and_names_the_field():
    from deepnex._convert import byte_size
    assert byte_size(4096, "memory") == 4096
    assert byte_size(np.int64(8), "memory") == 8
    assert type(byte_size(np.int64(8), "memory")) is int
    assert byte_size("80GiB", "memory") == 80 * GiB
    for value, message in [
            (-1, "memory=-1: must be >= 0"),
            (True, 'memory: expected a byte size such as "80GiB" or an int, got True'),
            (1.5, 'memory: expected a byte size such as "80GiB" or an int, got 1.5'),
            (None, 'memory: expected a byte size such as "80GiB" or an int, got None')]:
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            byte_size(value, "memory")
        assert str(e.value) == message
    with pytest.raises(deepnex.InvalidArgumentError, match='^memory: "12XB" is not a byte size'):
        byte_size("12XB", "memory")


def test_every_module_coerces_sizes_alike():
    # launch and job used to say "spec.memory: -1 is negative".
    spec = deepnex.launch.ContainerSpec(name="c", command=["true"], memory=-1)
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        spec._spec()
    assert str(e.value) == "spec.memory=-1: must be >= 0"
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        deepnex.gpu.Allocator().allocate(deepnex.gpu.Request(user="u", memory=1.5))
    assert str(e.value) == 'memory: expected a byte size such as "80GiB" or an int, got 1.5'


# --- option structs: defaults live in C++ -----------------------------------

def _defaults(fn):
    import inspect
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_python_defaults_are_the_cpp_option_structs():
    from deepnex import collective, gpu, job, launch
    comm = _C.collective.CommunicatorOptions()
    assert (comm.backend, comm.timeout, comm.prefix, comm.transport, comm.connections_per_peer,
            comm.shm_channels, comm.device) == ("auto", 30.0, "deepnex", "auto", 2, 0, -1)
    d = _defaults(collective.Communicator)
    assert {k: d[k] for k in ("backend", "timeout", "prefix", "transport", "connections_per_peer",
                              "shm_channels", "device", "store")} == {
        "backend": "auto", "timeout": 30.0, "prefix": "deepnex", "transport": "auto",
        "connections_per_peer": 2, "shm_channels": 0, "device": -1, "store": ""}
    assert _defaults(collective.Store)["max_value_bytes"] == 64 << 20
    assert _defaults(collective.Store)["max_bytes"] == 1 << 30
    assert _defaults(collective.Store)["address"] == "127.0.0.1:0"
    assert _defaults(collective.StoreClient)["timeout"] == 30.0
    assert (_defaults(collective.GradientBucketer)["bucket_bytes"],
            _defaults(collective.GradientBucketer)["op"]) == (25 << 20, "mean")
    a = _defaults(gpu.Allocator)
    assert (a["fsync"], a["snapshot_every"], a["lease_check_interval"],
            a["reservation_after"]) == (True, 100000, 0.1, 300.0)
    assert _defaults(gpu.CentralClient)["timeout"] == 30.0
    r = gpu.Request(user="u")
    assert (r.gpus, r.mode, r.gpu_memory, r.cpus, r.memory, r.priority, r.replicas, r.spread,
            r.lease) == (0, "exclusive", 0, 0, 0, 0, 1, False, None)
    spec = launch.ContainerSpec(name="c", command=["true"])
    assert (spec.image, spec.restart, spec.backoff, spec.max_backoff, spec.cpus, spec.memory) == (
        "host", "never", 0.1, 10.0, 0.0, 0)
    j = _defaults(job.Job.__init__)
    assert {k: j[k] for k in ("workers", "nodes", "mode", "gpus_per_worker", "gpu_mode", "cpus",
                              "backend", "restart", "optimizer", "lr", "momentum")} == {
        "workers": 1, "nodes": 0, "mode": "sync", "gpus_per_worker": 0,
        "gpu_mode": "exclusive", "cpus": 1.0, "backend": "process", "restart": "never",
        "optimizer": "sgd", "lr": None, "momentum": 0.0}  # lr: the optimizer's own


def test_ps_python_defaults_are_the_cpp_option_structs():
    from deepnex import ps
    server = _C.ps.ServerOptions()
    assert (server.address, server.mode, server.num_workers, server.staleness, server.reduction,
            server.lease_timeout, server.heartbeat_interval, server.lease_policy,
            server.max_message_bytes, server.max_pull_reply_bytes, server.name,
            server.checkpoint_interval) == (
        "127.0.0.1:0", "sync", 1, 0, "mean", 10.0, 0.0, "shrink", 256 << 20, 0, "ps", 0.0)
    s = _defaults(ps.Server)
    assert {k: s[k] for k in (
        "address", "mode", "num_workers", "reduction", "staleness", "reject_nonfinite",
        "max_message_bytes", "max_pull_reply_bytes", "max_pending_reply_bytes",
        "max_deferred_push_bytes", "job_id", "lease_timeout", "heartbeat_interval",
        "lease_policy", "keep_dead_contributions", "name", "checkpoint_every_rounds",
        "checkpoint_interval", "_drop_push_replies")} == {
        "address": "127.0.0.1:0", "mode": "sync", "num_workers": 1, "reduction": "mean",
        "staleness": 0, "reject_nonfinite": True, "max_message_bytes": 256 << 20,
        "max_pull_reply_bytes": None, "max_pending_reply_bytes": 1 << 30,
        "max_deferred_push_bytes": 256 << 20, "job_id": "", "lease_timeout": 10.0,
        "heartbeat_interval": 0.0, "lease_policy": "shrink", "keep_dead_contributions": True,
        "name": "ps", "checkpoint_every_rounds": 0, "checkpoint_interval": 0.0,
        "_drop_push_replies": 0}
    c = _defaults(ps.Client)
    assert c == {"worker_id": 0, "partition_bytes": 4 << 20, "request_bytes": 4 << 20,
                 "timeout": 60.0, "connections_per_server": 2, "token": None,
                 "token_file": None, "tls_ca_file": None, "heartbeat": True,
                 "retry_backoff": 0.05, "transport": "auto", "shm_bytes": 256 << 20}
    assert _C.ps.ClientOptions().retry_backoff == 0.05


def test_ps_option_structs_check_what_is_set_and_name_the_field():
    o = _C.ps.ServerOptions()
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        o.mode = "fast"
    assert str(e.value) == 'mode: unknown "fast" (one of sync, ssp, async)'
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        o.reduction = "max"
    assert str(e.value) == 'reduction: unknown "max" (one of mean, sum)'
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        o.lease_timeout = 0
    assert str(e.value) == "lease_timeout=0.000000: must be positive seconds"
    # 0 or less turns the intervals off, as ps.Server has always taken them.
    o.heartbeat_interval, o.checkpoint_interval = -3, 2.5
    assert (o.heartbeat_interval, o.checkpoint_interval) == (0.0, 2.5)
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        _C.ps.ClientOptions().retry_backoff = 0
    assert str(e.value) == "retry_backoff=0.000000: must be positive seconds"
    # Past about 31 years the milliseconds (and now + the timeout) overflowed:
    # 1e300 s was -9223372036854775808 ms, a deadline already past.
    too_long = ": must be at most 1e+09 seconds (about 31 years)"
    for struct, field, value in [(_C.ps.ClientOptions(), "timeout", 1e300),
                                 (_C.ps.ServerOptions(), "heartbeat_interval", math.inf),
                                 (_C.gpu.Request(), "lease", 1e300),
                                 (_C.collective.StoreClientOptions(), "timeout", math.inf)]:
        with pytest.raises(deepnex.InvalidArgumentError) as e:
            setattr(struct, field, value)
        assert str(e.value) == f"{field}={value:g}{too_long}"
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        deepnex.gpu.Allocator().allocate(deepnex.gpu.Request("u", lease=1e300), wait=False)
    assert str(e.value) == f"lease=1e+300{too_long}"
    # ps.Server and ps.Client take their sizes as _convert reads them.
    with pytest.raises(deepnex.InvalidArgumentError) as e:
        deepnex.ps.Client(["127.0.0.1:1"], partition_bytes=-1)
    assert str(e.value) == "partition_bytes=-1: must be >= 0"


def test_option_structs_check_what_is_set_and_name_the_field():
    from deepnex._convert import options
    o = options(_C.collective.CommunicatorOptions, rank=1, world_size=2, timeout=2.5)
    assert (o.rank, o.world_size, o.timeout, o.prefix) == (1, 2, 2.5, "deepnex")
    with pytest.raises(deepnex.InvalidArgumentError, match="^timeout=0.000000: must be positive"):
        o.timeout = 0
    with pytest.raises(deepnex.InvalidArgumentError, match="backend"):
        o.backend = "carrier-pigeon"
    with pytest.raises(AttributeError):
        options(_C.collective.CommunicatorOptions, no_such_field=1)
    with pytest.raises(deepnex.InvalidArgumentError, match="^lease_check_interval=-1.000000"):
        _C.gpu.AllocatorOptions().lease_check_interval = -1
    request = options(_C.gpu.Request, mode="shared", lease=1.5, replicas=2)
    assert (request.mode, request.lease, request.replicas, request.gpus) == ("shared", 1.5, 2, 0)
    with pytest.raises(deepnex.InvalidArgumentError, match="mode"):
        request.mode = "sideways"
    spec = options(_C.launch.ContainerSpec, backoff=0.5, max_backoff=2.0, restart="always:3",
                   mounts=[_C.launch.Mount("/a", "/b", False)])
    # Setting the policy's text keeps the backoffs set before it.
    assert (spec.restart, spec.backoff, spec.max_backoff) == ("always:3", 0.5, 2.0)
    assert [(m.source, m.target, m.read_only) for m in spec.mounts] == [("/a", "/b", False)]
    j = options(_C.job.JobOptions, gpu_mode="shared", restart="on-failure:2", backend="oci")
    assert (j.gpu_mode, j.restart, j.backend) == ("shared", "on-failure:2", "oci")
    with pytest.raises(deepnex.InvalidArgumentError, match="gpu_mode"):
        j.gpu_mode = "sideways"


# --- what the CLI commands share ---------------------------------------------

def test_job_show_escapes_what_the_jobs_user_wrote():
    from deepnex._cli_jobs import rows, show_text
    job = {"name": "esc", "user": "alice", "state": "failed", "exit_code": 1,
           "command": ["train", "\x1b[1A\x1b[2Kfake"], "mode": "allreduce", "workers": 1,
           "min_workers": 1, "max_workers": 1, "resizes": 0, "last_resize": "", "ps": 0,
           "submitted_ms": 0, "started_ms": 0, "ended_ms": 0, "elapsed": 0.0,
           "gpu_hours": 0.0, "cpu_hours": 0.0, "peak_memory": 0, "restarts": 0,
           "nodes": ["n1"], "report": {"step": 1, "metrics": {"\x1b[2Jacc": 0.5},
                                        "time_ms": 0},
           "message": "bye\x1b[H", "allocations": [], "containers": []}
    shown = show_text(job)
    assert "\x1b" not in shown and "\x07" not in shown
    assert "command:     train '\\x1b[1A\\x1b[2Kfake'" in shown
    assert "last report: step 1 \\x1b[2Jacc=0.5" in shown
    assert "message:     bye\\x1b[H" in shown
    assert rows([job])[1][-1] == "step 1 \x1b[2Jacc=0.5"  # escaped as format_table prints it

def test_cli_common_tables_pairs_and_central_address(monkeypatch):
    import argparse

    from deepnex import _cli_common as common
    assert common.format_table([("A", "BB"), ("ccc", "d")]) == "A    BB\nccc  d"
    # What one user wrote reaches another's terminal escaped: a probe's
    # command and metric name cleared an admin's screen and retitled it.
    assert common.format_table([("A",), ("\x1b[2J\x1b]0;owned\x07\x9b",)]) == (
        "A\n\\x1b[2J\\x1b]0;owned\\x07\\x9b")
    assert common.parse_pairs(["a=1", "b=x=y"], "--env") == {"a": "1", "b": "x=y"}
    assert common.parse_pairs(None, "--env") == {}
    for bad in ("novalue", "=1"):
        with pytest.raises(SystemExit) as e:
            common.parse_pairs([bad], "--selector")
        assert str(e.value) == f"deepnex: --selector {bad!r}: expected KEY=VALUE"
    args = argparse.Namespace(central=None, token=None, token_file=None)
    monkeypatch.delenv("DEEPNEX_CENTRAL", raising=False)
    monkeypatch.setenv("DEEPNEX_TOKEN", "envtok")
    assert (common.central_address(args), common.central_token(args)) == (None, "envtok")
    monkeypatch.setenv("DEEPNEX_CENTRAL", "10.0.0.1:7070")
    assert common.central_address(args) == "10.0.0.1:7070"
    args = argparse.Namespace(central="127.0.0.1:1", token=None, token_file="/t")
    assert (common.central_address(args), common.central_token(args)) == ("127.0.0.1:1", None)


def test_run_reads_central_from_the_environment_when_it_runs(monkeypatch):
    # `deepnex run` used to read $DEEPNEX_CENTRAL when its parser was built.
    import argparse

    from deepnex import _cli_common, _cli_job
    commands = argparse.ArgumentParser().add_subparsers()
    monkeypatch.setenv("DEEPNEX_CENTRAL", "10.0.0.1:7070")
    _cli_job.add_commands(commands)
    monkeypatch.setenv("DEEPNEX_CENTRAL", "10.0.0.2:7070")
    args = commands.choices["run"].parse_args(["--", "true"])
    assert args.central is None
    assert _cli_common.central_address(args) == "10.0.0.2:7070"


def test_import_is_light():
    code = (
        "import sys, deepnex; "
        "bad = [m for m in ('torch',) if m in sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == ""


def test_version_and_cli():
    assert deepnex.__version__ == _C.__version__
    assert deepnex.__version__.count(".") == 2
    out = subprocess.run([sys.executable, "-m", "deepnex", "version"],
                         capture_output=True, text=True, check=True)
    assert out.stdout == f"deepnex {deepnex.__version__}\n"
    out = subprocess.run([sys.executable, "-m", "deepnex"], capture_output=True,
                         text=True)
    assert out.returncode == 2
    assert "usage: deepnex" in out.stdout


@pytest.mark.parametrize("argv, usage, error", [
    # A misspelled flag was told with the top-level usage, naming no flag of
    # the command meant.
    (["run", "--wrkers", "2", "--", "true"], "usage: deepnex run [options]",
     "deepnex run: error: unrecognized arguments: --wrkers"),
    (["image", "share", "--wth", "bob", "img"], "usage: deepnex image share",
     "deepnex image share: error: unrecognized arguments: --wth"),
    (["release", "a1", "a2"], "usage: deepnex release",
     "deepnex release: error: unrecognized arguments: a2"),
    # A prefix was taken as the flag it begins (--workers).
    (["run", "--worker", "2", "--", "true"], "usage: deepnex run [options]",
     "deepnex run: error: unrecognized arguments: --worker"),
    # tune's own `command` hid which command ran: a traceback (probe).
    (["tune", "--bogus", "--", "python3", "x.py"], "usage: deepnex tune",
     "deepnex tune: error: unrecognized arguments: --bogus"),
])
def test_a_bad_flag_is_told_with_its_commands_usage(argv, usage, error):
    out = subprocess.run([sys.executable, "-m", "deepnex", *argv], capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout) == (2, ""), out
    assert out.stderr.startswith(usage), out.stderr
    assert out.stderr.splitlines()[-1].startswith(error), out.stderr
