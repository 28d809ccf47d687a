"""Device arrays in and out: DLPack / CUDA Array Interface parsing, streams, allocation, :class:`DeviceArray`."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from . import _backend
from ._backend import (
    _BF16, _F16, _F32, _KDL_CPU, _KDL_CUDA, _KDL_CUDA_HOST, _KDL_CUDA_MANAGED, _KDL_NAMES, _NAMES, _U8, _U16,
    _emulated, _require,
)

# ----------------------------------------------------------- device arrays ---


class _DevArray:
    """A parsed C-contiguous device array: pointer, shape, dtype, device, owner."""

    __slots__ = ("obj", "ptr", "shape", "dtype", "device", "lib", "keep", "stream", "readonly")

    def __init__(self, obj: Any, ptr: int, shape: tuple[int, ...], dtype: np.dtype, device: int | None,
                 keep: Any, stream: int | None, readonly: bool) -> None:
        self.obj = obj
        self.ptr = ptr
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.lib = _lib_of(obj)
        self.keep = keep  # a DLPack capsule to keep alive while ptr is in use
        self.stream = stream  # CAI v3 producer stream to order after, if any
        self.readonly = readonly

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def _lib_of(obj: Any) -> str:
    if isinstance(obj, DeviceArray):
        return "dspark"
    mod = type(obj).__module__.split(".")[0]
    return mod if mod in ("cupy", "torch", "jax", "jaxlib", "numba") else ""


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


def _not_device(what: str, obj: Any, where: str) -> TypeError:
    return TypeError(
        f"{what} must be a CUDA device array (an object with __cuda_array_interface__ or __dlpack__ "
        f"on a CUDA device, e.g. a cupy array or a CUDA torch tensor); got {_type_name(obj)} {where}. "
        "Copy it to the device first, or use dspark_core.formats for host arrays."
    )


def _dl_dtype(code: int, bits: int, lanes: int, what: str) -> np.dtype:
    if lanes != 1:
        raise TypeError(f"{what}: vector DLPack dtypes (lanes={lanes}) are not supported")
    if code == 4 and bits == 16:
        return _BF16
    kind = {0: "i", 1: "u", 2: "f", 6: "b"}.get(code)
    if kind is None or bits % 8:
        raise TypeError(f"{what}: unsupported DLPack dtype (code {code}, {bits} bits)")
    return np.dtype(f"{kind}{bits // 8}") if kind != "b" else np.dtype(np.bool_)


def _check_c_contiguous(shape: tuple[int, ...], byte_strides: tuple[int, ...] | None, itemsize: int,
                        what: str) -> None:
    """Raise ValueError unless ``byte_strides`` (None = compact) describe a C-contiguous array."""
    if byte_strides is None:
        return
    acc = itemsize
    for dim, st in zip(reversed(shape), reversed(byte_strides)):
        if dim > 1 and st != acc:
            raise ValueError(
                f"{what} must be C-contiguous (got shape {shape}, byte strides {byte_strides}); "
                "make a contiguous copy first (e.g. .contiguous() / cupy.ascontiguousarray)"
            )
        acc *= dim


def _dev_array(obj: Any, what: str, *, stream: int, writable: bool = False) -> _DevArray:
    """Parse a device array through DLPack or the CUDA array interface.

    Raises TypeError for host / non-CUDA arrays and unsupported objects,
    ValueError for non-contiguous ones.
    """
    if isinstance(obj, DeviceArray):
        return _DevArray(obj, obj.ptr, obj.shape, obj.dtype, obj.device, None, obj._stream, False)
    if isinstance(obj, (np.ndarray, bytes, bytearray, memoryview, list, tuple)):
        raise _not_device(what, obj, "in host memory")
    has_dl = hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__")
    cai = None
    cai_error: Exception | None = None
    if hasattr(type(obj), "__cuda_array_interface__") or hasattr(obj, "__cuda_array_interface__"):
        try:
            cai = obj.__cuda_array_interface__
        except Exception as exc:  # noqa: BLE001 - torch: bfloat16 / requires_grad tensors refuse CAI
            cai_error = exc
    if has_dl:
        dev_type, dev_id = obj.__dlpack_device__()
        dev_type = int(dev_type)
        if dev_type not in (_KDL_CUDA, _KDL_CUDA_MANAGED):
            where = f"on a {_KDL_NAMES.get(dev_type, f'type-{dev_type}')} device"
            if dev_type == _KDL_CPU:
                where = "in host (CPU) memory"
            elif dev_type == _KDL_CUDA_HOST:
                where = "in pinned host memory (not device memory)"
            raise _not_device(what, obj, where)
        if cai is None:
            if _backend._cuda is None:
                raise RuntimeError(f"no CUDA device available: {_backend.unavailable_reason()}")
            try:
                cap = obj.__dlpack__(stream=stream if stream != 0 else 1)
            except TypeError as exc:
                if "stream" not in str(exc):  # a real failure, not an old __dlpack__() signature
                    raise TypeError(f"{what}: __dlpack__() failed: {exc}") from exc
                cap = obj.__dlpack__()
            except Exception as exc:
                raise TypeError(f"{what}: __dlpack__() failed: {exc}") from exc
            ptr, _t, dl_dev, shape, strides, (code, bits, lanes) = _backend._cuda.dlpack_info(cap)
            dt = _dl_dtype(code, bits, lanes, what)
            _check_c_contiguous(shape, None if strides is None else tuple(x * dt.itemsize for x in strides),
                                dt.itemsize, what)
            return _DevArray(obj, int(ptr), tuple(shape), dt, int(dl_dev), cap, None, False)
    if cai is not None:
        try:
            shape = tuple(int(s) for s in cai["shape"])
            typestr = cai["typestr"]
            ptr, readonly = cai["data"]
        except (KeyError, TypeError, ValueError) as exc:
            raise TypeError(f"{what}: malformed __cuda_array_interface__ ({exc})") from exc
        if cai.get("mask") is not None:
            raise TypeError(f"{what}: masked arrays are not supported")
        dt = np.dtype(typestr)
        if dt.byteorder == ">":
            raise TypeError(f"{what}: big-endian data is not supported")
        strides = cai.get("strides")
        _check_c_contiguous(shape, None if strides is None else tuple(int(x) for x in strides), dt.itemsize, what)
        st = cai.get("stream") if int(cai.get("version", 0)) >= 3 else None
        return _DevArray(obj, int(ptr or 0), shape, dt, None, None, None if st is None else int(st), bool(readonly))
    if cai_error is not None:
        raise TypeError(f"{what}: its __cuda_array_interface__ failed: {cai_error}") from cai_error
    raise _not_device(what, obj, "(it has neither __cuda_array_interface__ nor __dlpack__)")


# ---------------------------------------------------------------- streams ---


def _stream_handle(stream: Any, lib: str, device: int | None) -> int:
    """A cudaStream_t as an int (0 = legacy default stream).

    ``stream=None`` means the library's current stream on ``device`` (cupy /
    torch; None = the current device), else the legacy default stream.
    """
    if stream is None:
        if lib == "cupy" and "cupy" in sys.modules:
            cp = sys.modules["cupy"]
            with cp.cuda.Device(device) if device is not None else _nullctx():
                return int(cp.cuda.get_current_stream().ptr)
        if lib == "torch" and "torch" in sys.modules:
            torch = sys.modules["torch"]
            return int(torch.cuda.current_stream(device).cuda_stream)
        return 0
    if isinstance(stream, bool):
        raise TypeError("stream must be None, an int handle or a CUDA stream object, got a bool")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"stream handle must be >= 0, got {stream}")
        return stream
    if hasattr(stream, "__cuda_stream__"):  # CUDA Python stream protocol
        v = stream.__cuda_stream__()
        return int(v[1] if isinstance(v, tuple) else v)
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, numba / cuda-python
        h = getattr(stream, attr, None)
        if h is not None:
            return int(h if isinstance(h, int) else int(h))
    raise TypeError(f"stream must be None, an int handle or a CUDA stream object, got {_type_name(stream)}")


def _array_stream(stream: Any, x: Any, lib: str) -> int:
    """The stream to work on for input ``x`` (see :func:`_stream_handle`), on x's device."""
    if stream is None and lib == "torch":
        if not getattr(x, "is_cuda", False):
            return 0  # a CPU tensor: _dev_array rejects it as host memory
        return _stream_handle(None, lib, int(x.device.index))
    if stream is None and lib == "cupy":
        dev = getattr(x, "device", None)
        return _stream_handle(None, lib, None if dev is None else int(dev.id))
    return _stream_handle(stream, lib, None)


def _same_stream(a: int, b: int) -> bool:
    # 0 (what this module passes for the legacy default stream) and 1 (its
    # CUDA-array-interface spelling) are the same stream.
    return (1 if a == 0 else a) == (1 if b == 0 else b)


def _order_after_producer(a: _DevArray, stream: int, device: int) -> None:
    """Make ``stream`` wait for the producer stream ``a`` reported (CAI v3)."""
    if a.stream is not None and not _same_stream(a.stream, stream) and _backend._cuda is not None:
        _backend._cuda.stream_wait(stream, a.stream, device)


def _check_disjoint(a: _DevArray, o: _DevArray, fn: str) -> None:
    # The kernels read and write through __restrict__ pointers, one element or
    # block per thread: an output overlapping its input would be garbage.
    if a.nbytes and o.nbytes and a.ptr < o.ptr + o.nbytes and o.ptr < a.ptr + a.nbytes:
        raise ValueError(f"{fn}: out overlaps the input; conversions are not done in place")


def _mark_written(out: Any, stream: int, stream_obj: Any = None) -> None:
    """A DeviceArray result remembers the stream that wrote it (CAI v3
    "stream"; :meth:`DeviceArray.get` waits for it), and keeps the stream
    object, when one was given, alive with it so the handle stays valid."""
    if isinstance(out, DeviceArray):
        out._stream = 1 if stream == 0 else stream
        out._stream_ref = None if isinstance(stream_obj, int) else stream_obj


# ------------------------------------------------------------- allocation ---


def _alloc(lib: str, shape: tuple[int, ...], dtype: np.dtype, device: int, stream: int) -> Any:
    """An empty C-contiguous device array: from the input's library (cupy /
    torch) when it is one of those, else cupy, else torch, else a
    :class:`DeviceArray`. cupy has no bfloat16: there a uint16 array holding
    the bf16 bit patterns is returned."""
    order = [lib] if lib in ("cupy", "torch", "dspark") else []
    order += [x for x in ("cupy", "torch", "dspark") if x not in order]
    for name in order:
        if name == "dspark":
            return DeviceArray(shape, dtype, device)
        if not _usable_backend(name):
            continue
        mod = __import__(name)
        if name == "cupy":
            # Allocate on the stream that will use the memory (cupy's pool,
            # like torch's, reuses a freed block only on its own stream).
            dt = _U16 if dtype == _BF16 else dtype
            if stream in (0, 1):
                on = mod.cuda.Stream.null
            elif stream == 2:
                on = getattr(mod.cuda.Stream, "ptds", None) or _nullctx()
            else:
                on = mod.cuda.ExternalStream(stream)
            with mod.cuda.Device(device):
                with on:
                    return mod.empty(shape, dtype=dt)
        tdt = {_F32: mod.float32, _F16: mod.float16, _BF16: mod.bfloat16, _U8: mod.uint8}[dtype]
        # Allocate on the stream that will use the memory: torch's caching
        # allocator hands a freed block only to later work on the same
        # stream, so a temporary (upload_plan's staging buffer) dropped while
        # the stream still reads it cannot be reused under it.
        cur = int(mod.cuda.current_stream(device).cuda_stream)
        if _same_stream(stream, cur):
            return mod.empty(shape, dtype=tdt, device=f"cuda:{device}")
        with mod.cuda.stream(mod.cuda.ExternalStream(stream, device=f"cuda:{device}")):
            return mod.empty(shape, dtype=tdt, device=f"cuda:{device}")
    raise AssertionError("unreachable")


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _device_of(a: _DevArray) -> int:
    if a.device is None and a.size == 0:
        a.device = 0
    if a.device is None:
        d = _require().pointer_device(a.ptr) if a.ptr else -1
        if d < 0:
            raise TypeError("array memory is not CUDA device memory (host or unregistered pointer)")
        a.device = int(d)
    return a.device


def _check_out(out: Any, what: str, shape: tuple[int, ...], dtype: np.dtype, stream: int) -> _DevArray:
    o = _dev_array(out, what, stream=stream, writable=True)
    ok_dtype = o.dtype == dtype or (dtype == _BF16 and o.dtype == _U16)
    if not ok_dtype or o.shape != shape:
        raise ValueError(
            f"{what} must be a C-contiguous {_NAMES[dtype]} device array of shape {shape}"
            + (" (or uint16 holding bfloat16 bits)" if dtype == _BF16 else "")
            + f"; got {o.dtype} {o.shape}"
        )
    if o.readonly:
        raise ValueError(f"{what} is read-only")
    return o


def _prepare_out(a: _DevArray, out: Any, lib: str, shape: tuple[int, ...], dtype: np.dtype, stream: int,
                 fn: str) -> tuple[Any, _DevArray]:
    """The output of a conversion of ``a`` on ``stream``: ``out`` checked, or a
    new array from ``lib`` on a's device; the stream ordered after the
    producers of both (CAI v3). Returns (the array to return, its view)."""
    dev = _device_of(a)
    _order_after_producer(a, stream, dev)
    if out is None:
        out = _alloc(lib, shape, dtype, dev, stream)
    o = _check_out(out, f"{fn}: out", shape, dtype, stream)
    _check_disjoint(a, o, fn)
    _order_after_producer(o, stream, dev)
    return out, o


class DeviceArray:
    """A minimal owning, C-contiguous device array (cudaMalloc'd by dspark_core).

    What the conversions return when neither cupy nor torch is installed, and
    a way to move host data without them. Exposes
    ``__cuda_array_interface__`` (bfloat16 appears there as ``<u2``: the
    interface has no bfloat16), so numba / cupy / torch can wrap it.
    """

    __slots__ = ("shape", "dtype", "device", "_mem", "_stream", "_stream_ref", "__weakref__")

    def __init__(self, shape: Any, dtype: Any = np.float32, device: int = 0) -> None:
        cu = _require()
        self.shape = tuple(int(x) for x in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        if any(x < 0 for x in self.shape):
            raise ValueError(f"DeviceArray: negative dimension in shape {self.shape}")
        self.dtype = _BF16 if (isinstance(dtype, str) and dtype == "bfloat16") else np.dtype(dtype)
        self.device = int(device)
        if self.device < 0:
            raise ValueError(f"DeviceArray: device must be a CUDA device ordinal >= 0, got {self.device}")
        self._mem = cu.Allocation(self.nbytes, self.device)
        # The stream whose work on this memory a consumer must order after
        # (CAI v3 "stream": None while nothing was written, 1 = the legacy
        # default stream). A raw int handle given by the caller must outlive
        # the arrays written on it; a stream object is kept in _stream_ref.
        self._stream: int | None = None
        self._stream_ref: Any = None

    @property
    def ptr(self) -> int:
        return int(self._mem.ptr)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def __cuda_array_interface__(self) -> dict:
        typestr = "<u2" if self.dtype == _BF16 else self.dtype.str
        return {"shape": self.shape, "typestr": typestr, "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": self._stream}

    @classmethod
    def from_numpy(cls, a: Any, device: int = 0, stream: Any = None) -> "DeviceArray":
        """Copy a host array to a new DeviceArray (ordered on ``stream``)."""
        a = np.ascontiguousarray(a)
        d = cls(a.shape, a.dtype, device)
        if a.nbytes:
            s = _stream_handle(stream, "", device)
            _require().copy_to_device(d.ptr, a.reshape(-1).view(np.uint8), s)
            _mark_written(d, s, stream)
        return d

    def get(self, stream: Any = None) -> np.ndarray:
        """Copy to a new host numpy array (after synchronizing ``stream`` when given)."""
        cu = _require()
        if stream is not None:
            cu.synchronize(_stream_handle(stream, "", self.device), self.device)
        elif self._stream is not None and not _same_stream(self._stream, 0):
            # Written on another stream: the legacy-stream copy below would
            # not wait for a non-blocking one.
            cu.synchronize(self._stream, self.device)
            self._stream, self._stream_ref = 1, None
        raw = cu.copy_to_host(self.ptr, self.nbytes) if self.nbytes else b""
        return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape).copy()

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, device={self.device})"


def _usable_backend(name: str) -> bool:
    """cupy / torch is installed *and* sees a CUDA device (a CPU-only torch
    does not), and this build's devices are real ones (an emulated device's
    memory is host memory, which cupy / torch arrays are not)."""
    if not _importable(name) or _emulated():
        return False
    try:
        mod = __import__(name)
        if name == "torch":
            return bool(mod.cuda.is_available())
        return int(mod.cuda.runtime.getDeviceCount()) > 0
    except Exception:  # noqa: BLE001 - any failure to reach a device means "not usable"
        return False


def _importable(name: str) -> bool:
    if name in sys.modules:
        return True
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _current_device(lib: str) -> int:
    if lib == "dspark":
        return 0
    mod = __import__(lib)
    if lib == "cupy":
        return int(mod.cuda.Device().id)
    return int(mod.cuda.current_device())
