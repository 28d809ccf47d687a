"""Capture a llama.cpp target's hidden states through llama-cpp-python.

:class:`LlamaCppCapture` evaluates token batches on its own llama.cpp context
and returns, per token, the *feature row* a DSpark / DFlash drafter reads: the
outputs of the tap layers, concatenated::

    row[t] = [ l_out-<layers[0]>[t] | l_out-<layers[1]>[t] | ... ]     float32, n_capture * n_embd

in the order the layers are given, each layer's ``n_embd`` values contiguous
(the layout of ``torch.cat([hidden_states[i + 1] for i in layers], dim=-1)``
in a Hugging Face model). ``l_out-<il>`` is llama.cpp's name for the output of
block ``il`` (0-based, after the residual add), i.e. Hugging Face's
``hidden_states[il + 1]``. Layer ids read from a drafter GGUF
(:attr:`dspark_core.DrafterInfo.target_layers`) are reported as stored; a
file that stores ``hidden_states`` indices (llama.cpp's DFlash converter adds
1) needs ``layer_shift=1`` in :func:`tap_layers_from`.

How: the context is created with ``llama_context_params.cb_eval``. The graph
scheduler asks the callback about every node (``ask=True``); it answers yes
only for the tap tensors, so the graph is computed in pieces ending at them,
and on ``ask=False`` copies the tensor straight into the caller's output
slice with ``ggml_backend_tensor_get`` (one copy, no staging buffer; on a
GPU backend the same call downloads the rows). A batch larger than the
physical batch is split by llama.cpp into ubatches evaluated in order; a
per-layer row cursor places each ubatch's rows.

The last layer: llama.cpp cuts the last block's tensors to the rows whose
logits were requested (``ggml_get_rows`` on ``out_ids``) before
``l_out-<n_layer-1>``, so that layer has rows only for output tokens. Tapping
it works for batches evaluated with ``logits="all"``; any other batch raises
:class:`CaptureError` naming the layer, and the context is rolled back.

Greedy sampling is the argmax of llama.cpp's logits for each output token
(``llama_get_logits_ith``); ``logits="last"`` (prefill chunks) asks for the
last token's logits only, ``"all"`` (verify batches) for every token's.

The KV cache uses ``swa_full``: rolling back rejected draft tokens must not
meet sliding-window cells that llama.cpp already reused.

A crash-prone build. llama-cpp-python compiles llama.cpp with the host's
native CPU flags unless told otherwise. On a CPU with AMX (Intel Sapphire
Rapids and later) that build repacks the weights for llama.cpp's AMX kernels,
which segfault in the first decode of some models (Gemma 3 270M among them),
killing the process before any callback runs. :func:`crash_prone_build` tells
that case from the CPU's flags and the engine's own system info, and
:func:`probe_first_decode` runs a first decode in a child process, so that a
segfault becomes :class:`EngineCrash` with the fix (:data:`PORTABLE_BUILD`)
instead of a silent death.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

#: Token ids: a sequence of ints or an integer array (what the loop's Target takes).
Tokens = Sequence[int] | npt.NDArray[np.integer[Any]]

__all__ = [
    "INSTALL_HINT",
    "PORTABLE_BUILD",
    "CaptureError",
    "EngineCrash",
    "ProbeResult",
    "cpu_flags",
    "crash_message",
    "crash_prone_build",
    "engine_features",
    "portable_build_command",
    "probe_first_decode",
    "system_info",
    "CaptureResult",
    "LlamaCppCapture",
    "available",
    "load_llama",
    "tap_layers_from",
    "default_tap_layers",
]

#: How to install the optional dependency (said by every ImportError of this module).
INSTALL_HINT = "pip install 'dspark_core[llama-cpp]'"

#: Rebuilding llama-cpp-python without the host's native CPU flags (what avoids the AMX crash,
#: see :func:`crash_prone_build`); :func:`portable_build_command` pins the installed version.
PORTABLE_BUILD = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF" pip install --force-reinstall --no-cache-dir --no-binary llama-cpp-python '
    "llama-cpp-python"
)


def portable_build_command(version: str | None = None) -> str:
    """:data:`PORTABLE_BUILD`, for ``version`` (default: the installed llama-cpp-python's, if any)."""
    if version is None:
        from importlib import metadata

        try:
            version = metadata.version("llama-cpp-python")
        except metadata.PackageNotFoundError:
            return PORTABLE_BUILD
    return f"{PORTABLE_BUILD}=={version}"

#: llama.cpp's name of block ``il``'s output tensor.
LAYER_OUTPUT_NAME = "l_out-{}"

_GGML_TYPE_F32 = 0
_GGML_MAX_DIMS = 4
_SEQ = 0  # the one llama.cpp sequence id an adapter uses
_LOGITS = ("last", "all", "none")


class CaptureError(RuntimeError):
    """The engine did not produce every tap row of a batch (the batch is rolled back)."""


class EngineCrash(RuntimeError):
    """llama.cpp killed its process (a signal, e.g. SIGSEGV) in a first decode run in a child process."""


# ---------------------------------------------------------------------------------------
# a crash-prone engine build


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` line; empty where there is none)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def engine_features(info: str) -> dict[str, str]:
    """``{"AVX2": "1", "AMX_INT8": "1", ...}`` from llama.cpp's system info line
    (``"CPU : SSE3 = 1 | AVX2 = 1 | ... |"``, as :func:`system_info` returns it)."""
    out: dict[str, str] = {}
    for part in info.replace("\n", "|").split("|"):
        name, eq, value = part.rpartition("=")
        if eq:
            out[name.split(":")[-1].strip()] = value.strip()
    return out


def system_info() -> str:
    """llama.cpp's system info as the installed llama-cpp-python reports it (its compiled CPU features)."""
    raw = _llama_cpp().llama_print_system_info()
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


#: CPU flags (Linux ``/proc/cpuinfo`` names) of Intel AMX.
_AMX_FLAGS = ("amx_int8", "amx_tile", "amx_bf16")


def crash_prone_build(flags: frozenset[str] | set[str], info: str) -> str | None:
    """Why this llama.cpp build is known to crash on this CPU, or None.

    ``flags``: the CPU's flags (:func:`cpu_flags`); ``info``: the engine's system info
    (:func:`system_info`). Known case: an AMX CPU running a build compiled with AMX
    (``AMX_INT8 = 1``: a ``-march=native`` build on that host), whose AMX kernels segfault
    in the first decode of some models.
    """
    amx = sorted(f for f in _AMX_FLAGS if f in flags)
    if amx and engine_features(info).get("AMX_INT8") == "1":
        return (
            f"this CPU has AMX ({', '.join(amx)}) and llama-cpp-python was built with the host's native flags "
            "(its system info reports AMX_INT8 = 1), so llama.cpp runs its AMX matrix kernels, which segfault "
            "in the first decode of some models"
        )
    return None


@dataclass
class ProbeResult:
    """What :func:`probe_first_decode` saw.

    Attributes:
        returncode: the child's exit status (negative: killed by that signal); None on a timeout.
        stderr: the end of the child's standard error.
    """

    returncode: int | None
    stderr: str

    @property
    def crashed(self) -> bool:
        """The child was killed by a signal (a segfault, an abort, an illegal instruction)."""
        return self.returncode is not None and self.returncode < 0

    @property
    def signal_name(self) -> str:
        if not self.crashed:
            return ""
        try:
            return signal.Signals(-int(self.returncode or 0)).name
        except ValueError:
            return f"signal {-int(self.returncode or 0)}"


# The child: load the model as load_llama does and decode a few tokens (llama_decode).
_PROBE = """
import sys
import llama_cpp
path, threads = sys.argv[1], int(sys.argv[2])
llm = llama_cpp.Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=threads, verbose=False)
llm.eval(llm.tokenize(b"A first decode, in a process of its own.", add_bos=True))
print("first decode ok")
"""


def probe_first_decode(model_path: str | os.PathLike[str], *, n_threads: int | None = None,
                       timeout: float | None = 600.0, python: str | None = None) -> ProbeResult:
    """Load the model and run one decode in a child process (``python``, default this
    interpreter, same environment): a crash there kills the child, not the caller.

    Returns what happened; :attr:`ProbeResult.crashed` says whether a signal killed it.
    A timeout is not a crash (``returncode`` None).
    """
    argv = [python or sys.executable, "-c", _PROBE, os.fspath(model_path), str(n_threads or _default_threads())]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode("utf-8", "replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return ProbeResult(None, err[-2000:])
    return ProbeResult(proc.returncode, proc.stderr[-2000:])


def crash_message(model_path: str | os.PathLike[str], probe: ProbeResult, reason: str | None) -> str:
    """The error of a first decode that killed its process: what happened, the likely cause, the fix."""
    cause = reason or (
        "a known cause is a llama-cpp-python built with the host's native CPU flags (pip's default) on a CPU with "
        "AMX (Intel Sapphire Rapids and later), whose AMX matrix kernels segfault in the first decode of some models"
    )
    return (
        f"llama.cpp was killed by {probe.signal_name} in its first decode of {os.path.basename(os.fspath(model_path))} "
        f"(run in a child process, before any row was captured): {cause}. Rebuild llama-cpp-python without native "
        f"CPU flags: {portable_build_command()}"
    )


def available() -> bool:
    """Whether llama-cpp-python can be imported."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError(f"dspark_core.engines.llama_cpp needs llama-cpp-python: {INSTALL_HINT}") from exc
    return llama_cpp


class _TensorHead(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (stable across ggml versions since 2024).

    Only ``type``, ``ne`` and ``nb`` are read; the name comes from ``ggml_get_name``.
    """

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
    ]


#: ``char name[GGML_MAX_NAME]`` of struct ggml_tensor, read in place.
_TensorName = ctypes.c_char * 64
_MAX_NAME_OFFSET = 1024  # sanity bound on where the name sits inside the struct


class _Ggml:
    """The few libggml functions the callback needs, bound once."""

    def __init__(self, llama_cpp: Any) -> None:
        from llama_cpp import _ggml  # the libggml llama-cpp-python ships and links against

        lib = _ggml.libggml
        # lib["name"] makes function objects of our own: lib.name is shared, and another user
        # setting its restype (c_char_p for ggml_get_name, say) would change ours
        self.get_name = lib["ggml_get_name"]
        self.get_name.argtypes = [ctypes.c_void_p]
        self.get_name.restype = ctypes.c_void_p  # an address: the name lives inside the tensor
        self.tensor_get = lib["ggml_backend_tensor_get"]
        self.tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        self.tensor_get.restype = None
        self.nelements = lib["ggml_nelements"]
        self.nelements.argtypes = [ctypes.c_void_p]
        self.nelements.restype = ctypes.c_int64


_ggml_cache: list[_Ggml] = []


def _ggml(llama_cpp: Any) -> _Ggml:
    if not _ggml_cache:
        _ggml_cache.append(_Ggml(llama_cpp))
    return _ggml_cache[0]


def load_llama(model_path: str | os.PathLike[str], *, n_threads: int | None = None) -> Any:
    """A ``llama_cpp.Llama`` holding the model of ``model_path`` (CPU, quiet).

    Its own context is tiny (the adapters create theirs); it only owns the
    weights, which several :class:`LlamaCppCapture` can share.
    """
    llama_cpp = _llama_cpp()
    path = os.fspath(model_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no model file at {path}")
    return llama_cpp.Llama(
        model_path=path, n_ctx=64, n_batch=64, n_threads=n_threads or _default_threads(), verbose=False
    )


def _default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def default_tap_layers(n_layer: int) -> tuple[int, ...]:
    """EAGLE-3's choice of tap layers: low, middle and high, ``(2, n_layer // 2, n_layer - 3)``."""
    if n_layer < 6:
        raise ValueError(f"a model with {n_layer} layers is too shallow for the default taps; pass layers")
    return (2, n_layer // 2, n_layer - 3)


def tap_layers_from(info: Any, layer_shift: int = 0) -> tuple[int, ...]:
    """Tap layers (``l_out`` indices) from a :class:`~dspark_core.DrafterInfo`.

    ``layer_shift`` is subtracted from each stored id: 0 when the file stores
    block indices, 1 when it stores ``hidden_states`` indices (llama.cpp's
    DFlash converter does).
    """
    layers = tuple(int(x) - layer_shift for x in info.target_layers)
    if not layers:
        raise ValueError("the drafter metadata names no target layers")
    return layers


@dataclass
class CaptureResult:
    """What :meth:`LlamaCppCapture.evaluate` returns (also a :class:`dspark_core.sim.loop.TargetOutput`).

    Attributes:
        rows: float32 ``(n, n_capture * n_embd)``: each token's concatenated tap-layer rows.
        next_tokens: int64 ``(n,)``: the greedy (argmax) token after each position whose
            logits were computed, ``-1`` elsewhere.
    """

    rows: np.ndarray
    next_tokens: np.ndarray


class LlamaCppCapture:
    """A llama.cpp context that captures tap-layer rows of every evaluated token.

    Args:
        model: a ``llama_cpp.Llama`` (its weights are shared, its context untouched)
            or a GGUF model path (loaded with :func:`load_llama`).
        layers: tap layers (``l_out`` indices, in drafter order); ``()`` makes a plain
            engine that captures nothing (no callback installed), for comparisons.
        n_ctx: context length of this adapter's KV cache.
        n_batch: tokens per ``llama_decode`` call (a prefill is evaluated in chunks of this).
        n_ubatch: physical batch (default ``n_batch``; smaller splits each call into ubatches).
        n_threads: CPU threads (default: the ``Llama``'s, else the CPUs this process may use).
        verify_max: :meth:`decode` (the loop's Target API) requests logits for every token
            of a batch of at most this many tokens (single decodes and verify batches),
            for the last token only otherwise (prefill chunks).

    Raises:
        ImportError: llama-cpp-python is missing (the message gives the install command).
        ValueError: a layer outside ``[0, n_layer)``, a repeated layer, or bad sizes.

    The adapter holds one sequence: ``n_past`` tokens are in its KV cache.
    """

    def __init__(
        self,
        model: Any,
        layers: Sequence[int],
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        verify_max: int = 64,
    ) -> None:
        llama_cpp = _llama_cpp()
        self._lc = llama_cpp
        if isinstance(model, (str, os.PathLike)):
            model = load_llama(model, n_threads=n_threads)
        self.llama = model  # keeps the weights alive as long as this context
        self._model = model.model
        self.n_layer = int(llama_cpp.llama_model_n_layer(self._model))
        self.n_embd = int(llama_cpp.llama_model_n_embd(self._model))
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.layers = tuple(int(x) for x in layers)
        bad = [x for x in self.layers if not 0 <= x < self.n_layer]
        if bad:
            raise ValueError(f"tap layers {bad} are outside the model's layers [0, {self.n_layer})")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"tap layers {list(self.layers)} repeat a layer")
        for name, v in (("n_ctx", n_ctx), ("n_batch", n_batch), ("verify_max", verify_max)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        n_ubatch = n_batch if n_ubatch is None else n_ubatch
        if not 1 <= n_ubatch <= n_batch:
            raise ValueError(f"n_ubatch must be in [1, n_batch={n_batch}], got {n_ubatch}")
        self.n_capture = len(self.layers)
        self.feature_dim = self.n_capture * self.n_embd
        self.n_batch = int(n_batch)
        self.verify_max = int(verify_max)
        self.n_threads = int(n_threads or getattr(model, "n_threads", None) or _default_threads())

        # callback state: the slot of each tap tensor name, and where the current batch's rows go
        self._slot_of = {LAYER_OUTPUT_NAME.format(il).encode(): k for k, il in enumerate(self.layers)}
        self._out: np.ndarray | None = None
        self._cursor = [0] * self.n_capture
        self._cb_error: BaseException | None = None
        self._head_checked = False
        self._name_offset = -1  # of the name inside struct ggml_tensor, learned on the first node
        self.callback_s = 0.0  # time spent inside the Python callback (whole adapter life)

        params = llama_cpp.llama_context_default_params()
        params.n_ctx = int(n_ctx)
        params.n_batch = self.n_batch
        params.n_ubatch = int(n_ubatch)
        params.n_seq_max = 1
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads
        if hasattr(params, "swa_full"):  # rollback must not meet reused sliding-window cells
            params.swa_full = True
        params.no_perf = True
        self._cb: Any = None
        if self.layers:
            self._g = _ggml(llama_cpp)
            self._cb = llama_cpp.ggml_backend_sched_eval_callback(self._on_eval)
            params.cb_eval = self._cb
            params.cb_eval_user_data = None
        ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context (llama_init_from_model returned NULL)")
        self._ctx = ctx
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx))
        self._mem = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        b = self._batch
        self._b_token = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._b_pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._b_logits = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        n_seq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        n_seq[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = _SEQ
        self._tokens: list[int] = []

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Free the context and the batch (the model belongs to ``self.llama``)."""
        lc = self._lc
        if getattr(self, "_batch", None) is not None:
            lc.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None

    def __enter__(self) -> "LlamaCppCapture":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except (AttributeError, TypeError):  # interpreter shutdown: modules may be torn down
            pass

    # -- sequence state ----------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Tokens in the KV cache (the next token goes to this position)."""
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The tokens at positions ``[0, n_past)``."""
        return list(self._tokens)

    def reset(self) -> None:
        """Empty the KV cache (a new request)."""
        self._lc.llama_memory_clear(self._mem, True)
        self._tokens.clear()

    def rollback(self, n_past: int) -> None:
        """Drop positions ``>= n_past`` (rejected draft tokens)."""
        if not 0 <= n_past <= self.n_past:
            raise ValueError(f"cannot roll back to {n_past}: the engine is at {self.n_past}")
        if n_past < self.n_past:
            if not self._lc.llama_memory_seq_rm(self._mem, _SEQ, n_past, -1):
                raise RuntimeError(f"llama.cpp refused to remove positions >= {n_past}")
            del self._tokens[n_past:]

    # -- sequence state: a prefix cache's KV (llama_state_seq_*) ---------------------------
    def save_state(self) -> bytes:
        """The KV cache of this adapter's sequence as llama.cpp serialises it
        (``llama_state_seq_get_data``): what a prefix cache keeps of a request, so
        that a later request starting with the same tokens skips their prefill."""
        lc = self._lc
        n = int(lc.llama_state_seq_get_size(self._ctx, _SEQ))
        buf = (ctypes.c_ubyte * n)()
        got = int(lc.llama_state_seq_get_data(self._ctx, buf, n, _SEQ))
        if got != n:
            raise RuntimeError(f"llama.cpp wrote {got} of {n} bytes of the sequence state")
        return bytes(buf)

    def load_state(self, data: bytes, tokens: Sequence[int]) -> None:
        """Replace the KV cache with ``data`` from :meth:`save_state` of a context on the same
        model, whose sequence held ``tokens`` (positions ``[0, len(tokens))``)."""
        lc = self._lc
        self.reset()
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        if int(lc.llama_state_seq_set_data(self._ctx, buf, len(data), _SEQ)) != len(data):
            self.reset()
            raise RuntimeError("llama.cpp could not restore the sequence state (another model or context size?)")
        self._tokens = [int(t) for t in tokens]

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        """``text`` as tokens of this model (``add_bos``: the model's BOS first, if it uses one)."""
        return list(self.llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return bytes(self.llama.detokenize([int(t) for t in tokens])).decode("utf-8", errors="replace")

    # -- evaluation --------------------------------------------------------------------
    def decode(self, tokens: Tokens) -> CaptureResult:
        """The :class:`dspark_core.sim.loop.Target` API: logits for every token of a batch of
        at most ``verify_max`` tokens (or when the last layer is tapped), else the last only."""
        n = len(tokens)
        all_rows = n <= self.verify_max or (self.n_layer - 1) in self.layers
        return self.evaluate(tokens, logits="all" if all_rows else "last")

    def evaluate(self, tokens: Tokens, *, logits: str = "last", out: np.ndarray | None = None) -> CaptureResult:
        """Evaluate ``tokens`` at positions ``[n_past, n_past + n)`` in chunks of ``n_batch``.

        Args:
            tokens: token ids.
            logits: ``"last"`` (the last token's greedy next token only), ``"all"`` (every
                token's: verify batches) or ``"none"``.
            out: optional float32 C-contiguous ``(n, feature_dim)`` array to write the rows
                into (the callback copies each tap tensor straight into it).

        Returns:
            :class:`CaptureResult` (``rows`` is ``out`` when given).

        Raises:
            ValueError: bad tokens, ``logits`` or ``out``; the context would overflow.
            CaptureError: a tap layer produced fewer rows than tokens (the last layer
                without ``logits="all"``), or reading a tensor failed. The batch is
                rolled back: the adapter is left as it was.
            RuntimeError: ``llama_decode`` failed (also rolled back).
        """
        if logits not in _LOGITS:
            raise ValueError(f"logits must be one of {_LOGITS}, got {logits!r}")
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(toks)
        if n == 0:
            raise ValueError("no tokens to evaluate")
        if int(toks.min()) < 0 or int(toks.max()) >= self.n_vocab:
            bad = int(toks.min()) if int(toks.min()) < 0 else int(toks.max())
            raise ValueError(f"token {bad} is outside the vocabulary [0, {self.n_vocab})")
        if self.n_past + n > self.n_ctx:
            raise ValueError(f"{n} tokens at n_past {self.n_past} overflow the context n_ctx={self.n_ctx}")
        if out is None:
            rows = np.empty((n, self.feature_dim), np.float32)
        else:
            if (
                not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n, self.feature_dim)
                or not out.flags.c_contiguous or not out.flags.writeable
            ):
                raise ValueError(f"out must be a writeable C-contiguous float32 array of shape ({n}, {self.feature_dim})")
            rows = out
        next_tokens = np.full(n, -1, np.int64)
        start = self.n_past
        try:
            for lo in range(0, n, self.n_batch):
                hi = min(n, lo + self.n_batch)
                self._decode_chunk(toks[lo:hi], rows[lo:hi], next_tokens[lo:hi], logits, last_chunk=hi == n)
        except BaseException:
            self.rollback(start)
            raise
        return CaptureResult(rows=rows, next_tokens=next_tokens)

    def _decode_chunk(self, toks: np.ndarray, rows: np.ndarray, nxt: np.ndarray, logits: str, last_chunk: bool) -> None:
        lc = self._lc
        m = len(toks)
        p0 = self.n_past
        self._b_token[:m] = toks
        self._b_pos[:m] = np.arange(p0, p0 + m, dtype=np.int64)
        self._b_logits[:m] = 1 if logits == "all" else 0
        if logits == "last" and last_chunk:
            self._b_logits[m - 1] = 1
        self._batch.n_tokens = m
        self._out, self._cb_error, self._cursor = rows, None, [0] * self.n_capture
        try:
            rc = lc.llama_decode(self._ctx, self._batch)
        finally:
            self._out = None
        # llama_decode wrote positions [p0, p0 + m) unless it failed before the graph ran;
        # record them so a rollback covers them either way
        self._tokens.extend(int(t) for t in toks)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc} ({m} tokens at position {p0})")
        if self._cb_error is not None:
            raise CaptureError(f"reading a tap tensor failed: {self._cb_error!r}") from self._cb_error
        short = {il: c for il, c in zip(self.layers, self._cursor) if c != m}
        if short:
            last = self.n_layer - 1
            why = (
                f" (llama.cpp keeps only the logit rows of the last layer {last}: evaluate with logits='all' "
                f"or tap layers below {last})" if last in short else ""
            )
            raise CaptureError(
                "tap layers produced the wrong number of rows for a batch of "
                f"{m}: " + ", ".join(f"layer {il}: {c}" for il, c in short.items()) + why
            )
        want = np.flatnonzero(self._b_logits[:m])
        for i in want:
            ptr = lc.llama_get_logits_ith(self._ctx, int(i))
            if not ptr:
                raise RuntimeError(f"llama.cpp returned no logits for batch row {i}")
            nxt[i] = int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))))

    # -- the eval callback ----------------------------------------------------------------
    def _on_eval(self, t: int, ask: bool, _user_data: int) -> bool:
        """``ggml_backend_sched_eval_callback``: want the tap tensors, copy them when computed.

        Never raises (an exception cannot cross the C boundary): a failure is kept
        for :meth:`evaluate` to raise, and the graph is stopped.
        """
        try:
            # called for every graph node: read the name in place (no FFI call) at its offset
            # inside struct ggml_tensor, taken once from ggml_get_name
            off = self._name_offset
            if off < 0:
                off = self._name_offset = self._g.get_name(t) - t
                if not 0 < off < _MAX_NAME_OFFSET:
                    raise RuntimeError(f"ggml_get_name points {off} bytes into the tensor: unexpected layout")
            k = self._slot_of.get(_TensorName.from_address(t + off).value)
            if k is None:
                return not ask  # not ours: don't split the graph here
            if ask:
                return self._out is not None  # only while a batch of ours runs
            t0 = time.perf_counter()
            self._copy(k, t)
            self.callback_s += time.perf_counter() - t0
            return True
        except BaseException as exc:  # noqa: BLE001 - reported by evaluate()
            self._cb_error = exc
            return False

    def _copy(self, k: int, t: int) -> None:
        """Copy tap tensor ``t`` (slot ``k``) into rows ``[cursor, cursor + ne1)`` of the output."""
        out = self._out
        if out is None:
            return
        h = _TensorHead.from_address(t)
        if not self._head_checked:
            # the ggml_tensor prefix this module reads must match the library's
            if int(np.prod([h.ne[i] for i in range(_GGML_MAX_DIMS)])) != int(self._g.nelements(t)):
                raise RuntimeError("this libggml's struct ggml_tensor layout is not the one this adapter reads")
            self._head_checked = True
        if h.type != _GGML_TYPE_F32:
            raise TypeError(f"tap tensor {self.layers[k]} has ggml type {h.type}, expected F32")
        E = self.n_embd
        n_rows = int(h.ne[1])
        if int(h.ne[0]) != E or h.ne[2] != 1 or h.ne[3] != 1:
            raise ValueError(f"tap tensor of layer {self.layers[k]} has shape {list(h.ne)}, expected [{E}, n, 1, 1]")
        lo = self._cursor[k]
        self._cursor[k] = lo + n_rows
        if lo + n_rows > len(out):
            return  # counted, not written: evaluate() reports the row count
        row_bytes = E * 4
        dst_stride = out.strides[0]
        dst = out.ctypes.data + lo * dst_stride + k * row_bytes
        src_stride = int(h.nb[1])
        get = self._g.tensor_get
        if self.n_capture == 1 and src_stride == row_bytes:
            get(t, dst, 0, n_rows * row_bytes)  # the whole tensor is the output block
            return
        for r in range(n_rows):
            get(t, dst + r * dst_stride, r * src_stride, row_bytes)
