"""CUDA row conversion (``dspark_core.cuda``): GPU bytes equal the CPU path's.

Two groups:

* tests that run everywhere (CI has no GPU): the module imports, reports
  ``available() == False`` cleanly and validates its inputs with clear errors
  (host arrays, non-contiguous / wrong dtype / wrong shape arrays, streams);
* GPU tests (marker ``gpu``), skipped with the reason when no CUDA device is
  usable or neither cupy nor torch is installed: quantize / dequantize on the
  device, byte for byte against ``dspark_core.formats`` on the datasets of
  test_formats.py plus random bit patterns, every input dtype, every policy,
  streams, ``out=``, and ``upload_plan``.

Without a GPU, CI runs this file a second time against a DSPARK_CUDA=EMULATE
build (``cuda._emulated()``): the CUDA host code, the kernels (under a
lock-step warp model) and the binding on emulated devices in host memory, so
the GPU tests run there too. In ctest, csrc/tests/test_cuda_kernels.cpp runs
the kernels' source against the CPU bytes at several grid sizes, and
cuda_ptx_exactness checks nvcc's PTX holds no fused, approximate or
flush-to-zero float instruction.
"""

from __future__ import annotations

import importlib.util
import re
import types

import ml_dtypes
import numpy as np
import pytest

from dspark_core import cuda, formats
from dspark_core.errors import ConfigError
from test_formats import CASES

BF16 = np.dtype(ml_dtypes.bfloat16)
DIM = 256
IN_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
OUT_DTYPES = ["float32", "float16", "bfloat16"]


class FakeCAI:
    """A minimal __cuda_array_interface__ producer (no GPU needed to parse it)."""

    def __init__(self, shape, typestr="<f4", strides=None, ptr=0x7F0000000000):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "version": 3,
            "strides": strides, "stream": None,
        }


class FakeDLPackCPU:
    def __dlpack__(self, stream=None):  # pragma: no cover - never called
        raise AssertionError("should be rejected from __dlpack_device__")

    def __dlpack_device__(self):
        return (1, 0)


# ------------------------------------------------------------- everywhere ---


def test_module_imports_and_reports_availability() -> None:
    assert isinstance(cuda.available(), bool)
    assert cuda.device_count() >= 0
    assert cuda.available() == (cuda.device_count() > 0)
    assert isinstance(cuda._emulated(), bool)
    if cuda._emulated() and cuda.available():  # a DSPARK_CUDA=EMULATE build says so where it names a device
        assert "emulated" in cuda._cuda.device_name(0)
    if not cuda.available():
        reason = cuda.unavailable_reason()
        assert reason, "a reason must be given when CUDA is unavailable"
    else:
        assert cuda.unavailable_reason() == ""


@pytest.mark.parametrize("fn", ["quantize", "dequantize"])
def test_host_array_is_a_type_error(fn: str) -> None:
    x = np.zeros((2, 64), np.float32)
    with pytest.raises(TypeError, match="__cuda_array_interface__"):
        if fn == "quantize":
            cuda.quantize_rows(x, "q8_0")
        else:
            cuda.dequantize_rows(formats.quantize_rows(x, "q8_0"), "q8_0", 64)


def test_dlpack_cpu_object_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="host \\(CPU\\) memory"):
        cuda.quantize_rows(FakeDLPackCPU(), "q8_0")
    with pytest.raises(TypeError, match="__dlpack__"):
        cuda.quantize_rows(object(), "q8_0")


@pytest.mark.skipif(cuda.available(), reason="checks the no-GPU error; a GPU is present")
def test_no_device_is_a_clear_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="no CUDA device available"):
        cuda.quantize_rows(FakeCAI((4, 64)), "q8_0")
    with pytest.raises(RuntimeError, match="no CUDA device available"):
        cuda.dequantize_rows(FakeCAI((4, 68), "|u1"), "q8_0", 64)
    plan = types.SimpleNamespace(encoded_rows=np.zeros((2, 68), np.uint8))
    cfg = types.SimpleNamespace(storage="q8_0", feature_dim=64, stage_dtype="float32")
    with pytest.raises(RuntimeError, match="no CUDA device available"):
        cuda.upload_plan(plan, cfg)


def test_validation_before_touching_the_device() -> None:
    # Non-contiguous (a column slice: row stride 512 bytes for 64 float32).
    with pytest.raises(ValueError, match="C-contiguous"):
        cuda.quantize_rows(FakeCAI((4, 64), strides=(512, 4)), "q8_0")
    # C-contiguous strides spelled out are fine up to the device check.
    ok = FakeCAI((4, 64), strides=(256, 4))
    if not cuda.available():
        with pytest.raises(RuntimeError):
            cuda.quantize_rows(ok, "q8_0")
    with pytest.raises(TypeError, match="float64"):
        cuda.quantize_rows(FakeCAI((4, 64), "<f8"), "q8_0")
    with pytest.raises(ValueError, match="2-D"):
        cuda.quantize_rows(FakeCAI((2, 4, 64)), "q8_0")
    with pytest.raises(ConfigError):
        cuda.quantize_rows(FakeCAI((4, 48)), "q8_0")  # q formats need D % 32 == 0
    with pytest.raises(ConfigError):
        cuda.quantize_rows(FakeCAI((4, 64)), "q5_0")
    with pytest.raises(ValueError, match="nonfinite"):
        cuda.quantize_rows(FakeCAI((4, 64)), "q8_0", nonfinite="ignore")
    with pytest.raises(ValueError, match="whole number"):
        cuda.dequantize_rows(FakeCAI((67,), "|u1"), "q8_0", 64)
    with pytest.raises(TypeError, match="out_dtype"):
        cuda.dequantize_rows(FakeCAI((68,), "|u1"), "q8_0", 64, out_dtype=np.float64)
    with pytest.raises(TypeError, match="stream"):
        cuda.quantize_rows(FakeCAI((4, 64)), "q8_0", stream="default")
    with pytest.raises(ValueError, match="stream"):
        cuda.quantize_rows(FakeCAI((4, 64)), "q8_0", stream=-1)


class HostCAI:
    """A host numpy array dressed up as a device array (for the fake backend)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        ai = a.__array_interface__
        typestr = "<u2" if a.dtype == BF16 else ai["typestr"]
        self.__cuda_array_interface__ = {
            "shape": a.shape, "typestr": typestr, "data": ai["data"], "version": 3,
            "strides": ai["strides"], "stream": None,
        }


class FakeBackend:
    """Stands in for the compiled ``_cuda`` module on a machine without a GPU:
    'device pointers' are host pointers and the conversions run on the CPU
    path. Exercises the Python layer's plumbing (pointers, shapes, codes,
    policies, error messages) everywhere."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def device_count(self) -> int:
        return 1

    def unavailable_reason(self) -> str:
        return ""

    def pointer_device(self, ptr: int) -> int:
        return 0

    @staticmethod
    def _view(ptr: int, nbytes: int) -> np.ndarray:
        import ctypes

        return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), np.uint8)

    def encode(self, src, in_code, dst, st_code, n, dim, pol, report, stream):
        from dspark_core._ext import _row_format

        self.calls.append(("encode", in_code, st_code, n, dim, pol, report, stream))
        dt = IN_DTYPES[in_code]
        x = self._view(src, n * dim * dt.itemsize).view(dt).reshape(n, dim)
        storage = formats.STORAGES[st_code]
        enc, bad = _row_format.encode(np.ascontiguousarray(x), storage, ["keep", "zero", "clamp_f16", "clamp"][pol], None)
        self._view(dst, enc.nbytes)[:] = as_bytes(enc)
        return bad if report else -1

    def decode(self, src, st_code, dst, out_code, n, dim, stream):
        self.calls.append(("decode", st_code, out_code, n, dim, stream))
        storage = formats.STORAGES[st_code]
        rb = formats.row_bytes(storage, dim)
        y = formats.dequantize_rows(self._view(src, n * rb).copy(), storage, dim, IN_DTYPES[out_code])
        self._view(dst, y.nbytes)[:] = as_bytes(y)

    def copy_to_host(self, ptr: int, n: int) -> bytes:
        return self._view(ptr, n).tobytes()

    def stream_wait(self, a, b, device=-1) -> None:
        self.calls.append(("wait", a, b))

    def copy_to_device(self, dst, host, stream) -> None:
        self._view(dst, host.nbytes)[:] = host

    def synchronize(self, stream, device=-1) -> None:
        self.calls.append(("sync", stream, device))

    class Allocation:
        def __init__(self, nbytes: int, device: int = 0) -> None:
            self.buf = np.zeros(max(nbytes, 1), np.uint8)
            self.ptr = self.buf.ctypes.data


@pytest.fixture
def fake(monkeypatch):
    fb = FakeBackend()
    monkeypatch.setattr(cuda._backend, "_cuda", fb)  # the one extension handle every cuda module reads
    return fb


@pytest.mark.parametrize("dtype", IN_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("storage", formats.STORAGES)
def test_python_layer_with_fake_backend(fake, storage: str, dtype: np.dtype) -> None:
    assert cuda.available()
    x = CASES["massive"].astype(dtype)
    want = formats.quantize_rows(x, storage)
    out = np.zeros_like(want)
    r = cuda.quantize_rows(HostCAI(x), storage, out=HostCAI(out), stream=7,
                           in_dtype="bfloat16" if dtype == BF16 else None)
    assert isinstance(r, HostCAI)
    np.testing.assert_array_equal(as_bytes(out), as_bytes(want))
    assert fake.calls[-1] == ("encode", IN_DTYPES.index(dtype), formats.STORAGES.index(storage), 8, DIM, 0, True, 7)
    for od in IN_DTYPES:
        y = np.zeros((8, DIM), od)
        cuda.dequantize_rows(HostCAI(as_bytes(want)), storage, DIM, od, out=HostCAI(y))
        np.testing.assert_array_equal(as_bytes(y), as_bytes(formats.dequantize_rows(want, storage, DIM, od)))
    # A 1-D row is one row; the wrong out shape / dtype is a ValueError.
    one = np.zeros_like(want[:1])
    cuda.quantize_rows(HostCAI(np.ascontiguousarray(x[0])), storage, out=HostCAI(one),
                       in_dtype=dtype if dtype == BF16 else None)
    np.testing.assert_array_equal(as_bytes(one), as_bytes(want[:1]))
    with pytest.raises(ValueError, match="shape"):
        cuda.quantize_rows(HostCAI(x), storage, out=HostCAI(np.zeros_like(want[:2])),
                           in_dtype=dtype if dtype == BF16 else None)


def test_fake_backend_policies_and_errors(fake) -> None:
    x = CASES["gauss_1"].copy()
    x[2, 9] = np.inf
    x[4, 0] = np.nan
    out = np.zeros((8, DIM // 32 * 34), np.uint8)
    with pytest.raises(ValueError, match="row 2, column 9 holds inf, a non-finite value"):
        cuda.quantize_rows(HostCAI(x), "q8_0", out=HostCAI(out))
    for pol in ("keep", "zero", "clamp_f16", "clamp"):
        cuda.quantize_rows(HostCAI(x), "q8_0", out=HostCAI(out), nonfinite=pol)
        np.testing.assert_array_equal(out, formats.quantize_rows(x, "q8_0", nonfinite=pol))
        assert fake.calls[-1][6] is False  # no synchronising report outside "error"
    # A producer stream (CUDA array interface v3) is ordered before our stream.
    a = HostCAI(CASES["gauss_1"])
    a.__cuda_array_interface__["stream"] = 5
    cuda.quantize_rows(a, "q8_0", out=HostCAI(out), stream=9)
    assert ("wait", 9, 5) in fake.calls
    # ... and so is the out array's stream; 0 and 1 both name the legacy
    # default stream, so nothing waits there.
    o = HostCAI(out)
    o.__cuda_array_interface__["stream"] = 6
    n_calls = len(fake.calls)
    cuda.quantize_rows(a, "q8_0", out=o, stream=9)
    assert ("wait", 9, 6) in fake.calls[n_calls:]
    a.__cuda_array_interface__["stream"] = 1
    n_calls = len(fake.calls)
    cuda.quantize_rows(a, "q8_0", out=HostCAI(out), stream=0)
    assert not [c for c in fake.calls[n_calls:] if c[0] == "wait"]
    # Read-only out.
    ro = HostCAI(out)
    ro.__cuda_array_interface__["data"] = (ro.__cuda_array_interface__["data"][0], True)
    with pytest.raises(ValueError, match="read-only"):
        cuda.quantize_rows(HostCAI(CASES["gauss_1"]), "q8_0", out=ro)


def test_overlapping_out_is_rejected(fake) -> None:
    x = CASES["gauss_1"].copy()
    # f32 -> f32 in place, and an out starting inside the input.
    with pytest.raises(ValueError, match="overlaps"):
        cuda.quantize_rows(HostCAI(x), "f32", out=HostCAI(x))
    raw = np.zeros(x.nbytes * 2, np.uint8)
    xs = raw[: x.nbytes].view(np.float32).reshape(x.shape)
    xs[:] = x
    q = raw[x.nbytes - 64 : x.nbytes - 64 + 8 * 68 * DIM // 64].reshape(8, -1)
    with pytest.raises(ValueError, match="overlaps"):
        cuda.quantize_rows(HostCAI(xs), "q8_0", out=HostCAI(q))
    enc = formats.quantize_rows(x, "q8_0")  # 8 x 272 bytes
    buf = np.zeros(8192, np.uint8)
    data = buf[: enc.nbytes].reshape(enc.shape)
    data[:] = enc
    y = buf[1024 : 1024 + 8 * DIM * 2].view(np.float16).reshape(8, DIM)  # starts inside data
    with pytest.raises(ValueError, match="overlaps"):
        cuda.dequantize_rows(HostCAI(data), "q8_0", DIM, "float16", out=HostCAI(y))
    # Adjacent, not overlapping, is fine.
    y = buf[enc.nbytes : enc.nbytes + 8 * DIM * 2].view(np.float16).reshape(8, DIM)
    cuda.dequantize_rows(HostCAI(data), "q8_0", DIM, "float16", out=HostCAI(y))
    np.testing.assert_array_equal(y, formats.dequantize_rows(enc, "q8_0", DIM, np.float16))
    assert [c[0] for c in fake.calls if c[0] in ("encode", "decode")] == ["decode"]


class FakeTorchCPUTensor:
    """Looks like a CPU torch tensor (module "torch", is_cuda False) without torch."""

    __module__ = "torch"
    is_cuda = False

    def __dlpack__(self, stream=None):  # pragma: no cover - never called
        raise AssertionError("should be rejected from __dlpack_device__")

    def __dlpack_device__(self):
        return (1, 0)


def test_cpu_tensor_is_a_type_error_without_touching_its_streams() -> None:
    with pytest.raises(TypeError, match="host \\(CPU\\) memory"):
        cuda.quantize_rows(FakeTorchCPUTensor(), "q8_0")
    with pytest.raises(TypeError, match="host \\(CPU\\) memory"):
        cuda.dequantize_rows(FakeTorchCPUTensor(), "q8_0", 64)


def test_fake_backend_device_array_and_upload_plan(fake, monkeypatch) -> None:
    """Without cupy / torch the results are dspark DeviceArrays."""
    monkeypatch.setattr(cuda.interop, "_importable", lambda name: False)
    from dspark_core import Stager, StagerConfig

    cfg = StagerConfig(DIM, 4, 64, storage="q4_0", stage_dtype="bfloat16")
    st = Stager(cfg)
    st.begin(0)
    st.process(0, np.arange(10), CASES["student_t3"][:8].repeat(2, axis=0)[:10])
    plan = st.draft(0, 10)
    got = cuda.upload_plan(plan, st)
    assert isinstance(got, cuda.DeviceArray) and got.dtype == BF16 and got.shape == plan.rows.shape
    np.testing.assert_array_equal(as_bytes(got.get()), as_bytes(plan.rows))
    assert got.__cuda_array_interface__["typestr"] == "<u2"
    d = cuda.DeviceArray.from_numpy(CASES["gauss_1"])
    q = cuda.quantize_rows(d, "q8_0")
    assert isinstance(q, cuda.DeviceArray)
    np.testing.assert_array_equal(q.get(), formats.quantize_rows(CASES["gauss_1"], "q8_0"))
    # Stream bookkeeping (CAI v3): nothing written -> None; written on the
    # legacy stream -> 1; on another stream -> that stream, which get() waits
    # for (a legacy-stream copy would not wait for a non-blocking stream),
    # and whose object is kept alive with the array.
    assert cuda.DeviceArray((2, 3), np.float32).__cuda_array_interface__["stream"] is None
    assert q.__cuda_array_interface__["stream"] == 1

    class Stream:  # a stream object (the CUDA Python protocol)
        def __cuda_stream__(self):
            return (0, 77)

    s = Stream()
    q2 = cuda.quantize_rows(d, "q8_0", stream=s)
    assert q2.__cuda_array_interface__["stream"] == 77 and q2._stream_ref is s
    n_calls = len(fake.calls)
    q2.get()
    assert ("sync", 77, 0) in fake.calls[n_calls:]
    assert q2.__cuda_array_interface__["stream"] == 1  # waited for: its work is done
    n_calls = len(fake.calls)
    q.get()
    assert not [c for c in fake.calls[n_calls:] if c[0] == "sync"]


@pytest.mark.skipif(cuda._cuda is None, reason="dspark_core built without the CUDA extension")
def test_dlpack_capsule_parsing() -> None:
    """The extension's DLPack reader on a host (numpy) capsule: layout, dtype, strides."""
    a = np.arange(24, dtype=np.float16).reshape(4, 6)
    ptr, dev_type, dev_id, shape, strides, dt = cuda._cuda.dlpack_info(a.__dlpack__())
    assert (ptr, dev_type, dev_id, shape, dt) == (a.ctypes.data, 1, 0, (4, 6), (2, 16, 1))
    assert strides in (None, (6, 1))
    b = a[:, ::2]
    ptr, _, _, shape, strides, _ = cuda._cuda.dlpack_info(b.__dlpack__())
    assert shape == (4, 3) and strides == (6, 2)


# ------------------------------------------------------------------- GPU ---

_HAVE_CUPY = importlib.util.find_spec("cupy") is not None
_HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _gpu_skip_reason() -> str | None:
    if not cuda.available():
        return f"no CUDA device: {cuda.unavailable_reason()}"
    return None


gpu = pytest.mark.skipif(_gpu_skip_reason() is not None, reason=_gpu_skip_reason() or "")
# "dspark": dspark_core.cuda.DeviceArray (needs no array library).
# Only libraries that reach a device (a CPU-only torch or a cupy built for
# another CUDA is installed but not usable).
LIBS = ["dspark"] + [lib for lib, ok in (("cupy", _HAVE_CUPY), ("torch", _HAVE_TORCH)) if ok and cuda._usable_backend(lib)]


def to_dev(a: np.ndarray, lib: str):
    """Host array -> device array of ``lib``; bfloat16 goes as uint16 bits on cupy."""
    a = np.ascontiguousarray(a)
    if lib == "dspark":
        return cuda.DeviceArray.from_numpy(a)
    if lib == "cupy":
        import cupy as cp

        return cp.asarray(a.view(np.uint16) if a.dtype == BF16 else a)
    import torch

    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(a.copy()).cuda()


def to_host_bytes(d) -> np.ndarray:
    if isinstance(d, cuda.DeviceArray):
        return d.get().view(np.uint8).reshape(-1)
    mod = type(d).__module__.split(".")[0]
    if mod == "cupy":
        return d.get().view(np.uint8).reshape(-1)
    import torch

    t = d.detach()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.cpu().numpy().view(np.uint8).reshape(-1)


def as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def quant(x_dev, storage, lib, dtype, **kw):
    if lib == "cupy" and dtype == BF16:
        kw["in_dtype"] = "bfloat16"
    return cuda.quantize_rows(x_dev, storage, **kw)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("dtype", IN_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_encode_bytes_equal_cpu(name: str, storage: str, dtype: np.dtype, lib: str) -> None:
    with np.errstate(all="ignore"):
        x = CASES[name].astype(dtype)  # f16 / bf16 inputs may hold inf (f16_edges)
    xd = to_dev(x, lib)
    for policy in ("keep", "zero", "clamp_f16", "clamp"):
        want = formats.quantize_rows(x, storage, nonfinite=policy)
        got = quant(xd, storage, lib, dtype, nonfinite=policy)
        np.testing.assert_array_equal(to_host_bytes(got), as_bytes(want), err_msg=f"policy {policy}")
    try:
        want = formats.quantize_rows(x, storage)
    except ValueError as exc:
        with pytest.raises(ValueError, match=re.escape(str(exc).split(" (")[0])):
            quant(xd, storage, lib, dtype)
    else:
        np.testing.assert_array_equal(to_host_bytes(quant(xd, storage, lib, dtype)), as_bytes(want))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("storage", formats.STORAGES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_bytes_equal_cpu(name: str, storage: str, out_dtype: str, lib: str) -> None:
    enc = formats.quantize_rows(CASES[name], storage, nonfinite="keep")
    odt = BF16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
    want = formats.dequantize_rows(enc, storage, DIM, odt)
    raw = as_bytes(enc)
    got = cuda.dequantize_rows(to_dev(raw, lib), storage, DIM, out_dtype)
    np.testing.assert_array_equal(to_host_bytes(got), as_bytes(want))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("storage", formats.STORAGES)
def test_random_bits_and_nonfinite(storage: str, lib: str) -> None:
    """Arbitrary bit patterns (NaN payloads, inf, subnormals) through every
    input dtype and policy, and random bytes (any fp16 d) through decode."""
    rng = np.random.default_rng(11)
    bits = rng.integers(0, 2**32, (37, 32 * 9), dtype=np.uint64).astype(np.uint32)
    for dtype in IN_DTYPES:
        if dtype == np.float32:
            x = bits.view(np.float32)
        else:
            x = (bits & 0xFFFF).astype(np.uint16).view(dtype)
        xd = to_dev(x, lib)
        for policy in ("keep", "zero", "clamp_f16", "clamp"):
            want = formats.quantize_rows(x, storage, nonfinite=policy)
            got = quant(xd, storage, lib, dtype, nonfinite=policy)
            np.testing.assert_array_equal(to_host_bytes(got), as_bytes(want), err_msg=f"{dtype} {policy}")
    dim = 32 * 9
    rb = formats.row_bytes(storage, dim)
    raw = rng.integers(0, 256, 41 * rb, dtype=np.uint8)
    for out_dtype in OUT_DTYPES:
        odt = BF16 if out_dtype == "bfloat16" else np.dtype(out_dtype)
        want = formats.dequantize_rows(raw, storage, dim, odt)
        got = cuda.dequantize_rows(to_dev(raw, lib), storage, dim, out_dtype)
        np.testing.assert_array_equal(to_host_bytes(got), as_bytes(want), err_msg=out_dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
def test_large_run_one_call(lib: str) -> None:
    """A long contiguous run (many grid-stride iterations) in one call."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4099, 1024)) * rng.uniform(1e-3, 1e4, (4099, 1))).astype(np.float32)
    xd = to_dev(x, lib)
    for storage in ("q8_0", "q4_0", "bf16"):
        q = cuda.quantize_rows(xd, storage)
        np.testing.assert_array_equal(to_host_bytes(q), as_bytes(formats.quantize_rows(x, storage)))
        y = cuda.dequantize_rows(q, storage, 1024, "float16")
        want = formats.dequantize_rows(formats.quantize_rows(x, storage), storage, 1024, np.float16)
        np.testing.assert_array_equal(to_host_bytes(y), as_bytes(want))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
def test_error_policy_names_first_nonfinite(lib: str) -> None:
    x = CASES["gauss_1"].copy()
    x[3, 77] = np.nan
    x[5, 1] = np.inf
    x[1, 200] = -np.inf  # earlier in flat order than (3, 77)
    with pytest.raises(ValueError, match="row 1, column 200"):
        cuda.quantize_rows(to_dev(x, lib), "q8_0")
    x[1, 200] = 0.0
    with pytest.raises(ValueError, match="row 3, column 77 holds nan"):
        cuda.quantize_rows(to_dev(x, lib), "f16")
    # Overflow is non-finite too: a massive activation above f16's range.
    x[2, 5] = 87929.0
    with pytest.raises(ValueError, match=r"row 2, column 5 holds 87929, which overflows f16"):
        cuda.quantize_rows(to_dev(x, lib), "f16")
    cuda.quantize_rows(to_dev(x[:3], lib), "bf16")  # bf16 carries it (rows 0..2 hold no NaN)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
def test_out_and_stream(lib: str) -> None:
    x = CASES["massive"]
    xd = to_dev(x, lib)
    want_q = formats.quantize_rows(x, "q4_0")
    want_y = formats.dequantize_rows(want_q, "q4_0", DIM, BF16)
    if lib == "dspark":
        stream = None
        out_q = cuda.DeviceArray(want_q.shape, np.uint8)
        out_y = cuda.DeviceArray((x.shape[0], DIM), BF16)
        handles = [0, 2]  # legacy and per-thread default streams
    elif lib == "cupy":
        import cupy as cp

        stream = cp.cuda.Stream(non_blocking=True)
        out_q = cp.empty(want_q.shape, cp.uint8)
        out_y = cp.empty((x.shape[0], DIM), cp.uint16)  # bf16 bits
        handles = [stream, stream.ptr]
    else:
        import torch

        stream = torch.cuda.Stream()
        out_q = torch.empty(want_q.shape, dtype=torch.uint8, device="cuda")
        out_y = torch.empty((x.shape[0], DIM), dtype=torch.bfloat16, device="cuda")
        handles = [stream, stream.cuda_stream]
    for h in handles:
        r = cuda.quantize_rows(xd, "q4_0", out=out_q, stream=h, nonfinite="keep")
        assert r is out_q
        r = cuda.dequantize_rows(out_q, "q4_0", DIM, "bfloat16", out=out_y, stream=h)
        assert r is out_y
        if lib == "dspark":  # a DeviceArray reports the stream that wrote it (CAI v3; 1 = legacy)
            assert out_q.__cuda_array_interface__["stream"] == (1 if h == 0 else h)
            assert out_y.__cuda_array_interface__["stream"] == (1 if h == 0 else h)
        if stream is not None:
            stream.synchronize()
        np.testing.assert_array_equal(to_host_bytes(out_q), as_bytes(want_q))
        np.testing.assert_array_equal(to_host_bytes(out_y), as_bytes(want_y))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("lib", LIBS)
def test_device_array_errors(lib: str) -> None:
    x = to_dev(CASES["gauss_1"], lib)
    if lib != "dspark":  # DeviceArray has no views
        with pytest.raises(ValueError, match="C-contiguous"):
            cuda.quantize_rows(x[:, ::2], "q8_0")
    with pytest.raises(TypeError, match="float64"):
        cuda.quantize_rows(to_dev(CASES["gauss_1"].astype(np.float64), lib), "q8_0")
    with pytest.raises(ValueError, match="shape"):
        cuda.quantize_rows(x, "q8_0", out=to_dev(np.zeros((8, 67), np.uint8), lib))
    with pytest.raises(ValueError, match="uint8"):
        cuda.quantize_rows(x, "q8_0", out=to_dev(np.zeros((8, 68), np.int8), lib))
    q = cuda.quantize_rows(x, "q8_0")
    with pytest.raises(ValueError, match="float32"):
        cuda.dequantize_rows(q, "q8_0", DIM, out=to_dev(np.zeros((8, DIM), np.float16), lib))
    with pytest.raises(ValueError, match="whole number"):
        cuda.dequantize_rows(q, "q8_0", DIM - 32)


@gpu
@pytest.mark.gpu
@pytest.mark.skipif(cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("lib", LIBS)
def test_wrong_device_is_rejected(lib: str) -> None:
    x = to_dev(CASES["gauss_1"], lib)
    if lib == "dspark":
        out = cuda.DeviceArray((8, 68 * DIM // 64), np.uint8, device=1)
    elif lib == "cupy":
        import cupy as cp

        with cp.cuda.Device(1):
            out = cp.empty((8, 68 * DIM // 64), cp.uint8)
    else:
        import torch

        out = torch.empty((8, 68 * DIM // 64), dtype=torch.uint8, device="cuda:1")
    with pytest.raises(ValueError, match="device"):
        cuda.quantize_rows(x, "q8_0", out=out)


@gpu
@pytest.mark.gpu
def test_concurrent_conversions_from_threads() -> None:
    """The binding releases the GIL: conversions from several threads at once
    each give their own bytes, while another thread makes failing CUDA calls
    the whole time. (That the emulated runtime keeps the last error per
    thread, as CUDA does, is checked deterministically in ctest.)"""
    import threading

    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal((64, DIM)).astype(np.float32) * (10.0 ** k) for k in range(3)]
    wants = [formats.quantize_rows(x, "q4_0") for x in inputs]
    errors: list[BaseException] = []
    done = threading.Event()

    def convert(k: int) -> None:
        try:
            d = cuda.DeviceArray.from_numpy(inputs[k])
            for _ in range(15):
                np.testing.assert_array_equal(cuda.quantize_rows(d, "q4_0").get(), wants[k])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def fail_repeatedly() -> None:
        while not done.is_set():
            try:
                cuda.DeviceArray((2, 2), np.float32, device=99)  # cudaSetDevice(99) fails
            except RuntimeError:
                pass

    failing = threading.Thread(target=fail_repeatedly)
    workers = [threading.Thread(target=convert, args=(k,)) for k in range(3)]
    failing.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    done.set()
    failing.join()
    assert not errors, errors


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("storage", ["f32", "f16", "bf16", "q8_0", "q4_0"])
@pytest.mark.parametrize("stage_dtype", ["float32", "bfloat16"])
def test_upload_plan_equals_plan_rows(storage: str, stage_dtype: str) -> None:
    from dspark_core import Stager, StagerConfig

    cfg = StagerConfig(DIM, 4, 64, storage=storage, stage_dtype=stage_dtype)
    st = Stager(cfg)
    st.begin(0)
    rows = CASES["student_t3"][:8]
    rows = np.concatenate([rows, CASES["massive"][:4]])
    st.process(0, np.arange(12), rows)
    plan = st.draft(0, 12)
    assert plan.skip is None and plan.n_rows > 0
    got = cuda.upload_plan(plan, st)  # the Stager's config: storage, D, stage dtype
    np.testing.assert_array_equal(to_host_bytes(got), as_bytes(plan.rows))
    got32 = cuda.upload_plan(plan, cfg, "float32")
    want32 = formats.dequantize_rows(plan.encoded_rows, storage, DIM, np.float32)
    np.testing.assert_array_equal(to_host_bytes(got32), as_bytes(want32))
