"""The parameters of a context, checked once: :class:`ContextParams`, used by
:class:`pyllama_headinfer.api.context.Context`, the VRAM planner
(:mod:`pyllama_headinfer.vram.plan`) and the commands alike; the KV cache
types (:data:`KV_CACHE_TYPES`); sizes like ``"24GiB"`` (:func:`parse_size`).

Nothing here touches llama.cpp: a :class:`ContextParams` is plain data, valid
by construction (a bad value raises ``ValueError`` naming it), so the same
check answers for the API and the command line before anything is loaded.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from dataclasses import dataclass, fields, replace
from typing import Optional, Tuple, Union

from pyllama_headinfer.errors import UsageError

# The KV cache types llama.cpp accepts for type_k / type_v (the ggml type of
# each is GGML_TYPE_<NAME.upper()>; the planner's byte sizes come from gguf's
# GGMLQuantizationType[<NAME.upper()>]).
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")

Size = Union[int, float, str]


# --------------------------------------------------------------------------- #
# sizes
# --------------------------------------------------------------------------- #

_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


# headinfer_vram_budget="auto": the free device memory (resolved by Context once the model is loaded)
AUTO_VRAM_BUDGET = "auto"


def parse_size(value) -> int:
    """Bytes from an int/float or a string like ``"24GiB"``, ``"24 GB"``,
    ``"512M"``, ``"1e9"`` is not accepted. KiB/MiB/GiB/TiB and the bare
    K/M/G/T are binary (2**10 ...), KB/MB/GB/TB decimal; no unit = bytes."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise ValueError(f"a size must be finite, got {value!r}")
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"cannot read {value!r} as a size: use bytes or a number with a unit "
                             "(KiB, MiB, GiB, TiB, K, M, G, T = binary; KB, MB, GB, TB = decimal)")
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"a size must be bytes or a string like '24GiB', got {value!r}")
    if n <= 0:
        raise ValueError(f"a size must be positive, got {value!r}")
    return n


def format_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 2**10:
        return f"{n} B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"  # pragma: no cover


# --------------------------------------------------------------------------- #
# threads
# --------------------------------------------------------------------------- #

def default_n_threads() -> int:
    """The CPU threads a context (and ``serve``'s llama-server) gets unless told
    otherwise: the CPUs this process may run on -- ``len(os.sched_getaffinity(0))``
    where the platform has it (``taskset``, a container's cpuset), else
    ``os.cpu_count()``; at least 1.

    Not llama.cpp's defaults: ``llama_context_default_params`` gives 4 threads
    whatever the machine (reported on 2 CPUs: SmolLM2-135M at 25-31 tok/s with
    4, 66 with 2), llama-server the machine's physical cores, affinity or not.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        n = os.cpu_count() or 1
    return max(1, n)


# --------------------------------------------------------------------------- #
# checks
# --------------------------------------------------------------------------- #

def check_headinfer_frac(frac) -> float:
    """``frac`` as a float in [0, 1]; ValueError naming the value otherwise (NaN, out of range, not a number)."""
    if isinstance(frac, bool) or not isinstance(frac, numbers.Real):
        raise ValueError(f"headinfer_gpu_heads_frac must be a number in [0, 1], got {frac!r}")
    f = float(frac)
    if math.isnan(f) or not 0.0 <= f <= 1.0:
        raise ValueError(f"headinfer_gpu_heads_frac must be in [0, 1], got {frac!r}")
    return f


def check_count(name: str, value, minimum: int) -> int:
    """``value`` as an int in [minimum, 2**31 - 1] (a C int32); ValueError naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value > 2**31 - 1:
        raise ValueError(f"{name} is too large: {value!r}")
    return int(value)


def check_kv_type(name: str, value) -> str:
    """``value`` lower-cased, if it is one of :data:`KV_CACHE_TYPES`; ValueError otherwise."""
    t = str(value).lower()
    if t not in KV_CACHE_TYPES:
        raise ValueError(f"{name} must be one of {sorted(KV_CACHE_TYPES)}, got {value!r}")
    return t


# HeadInfer: llama_context_params.headinfer_attn (llama.h's enum), by name
HEADINFER_ATTN_TYPES = {
    "joined": "LLAMA_HEADINFER_ATTN_JOINED",  # one attention over the joined heads: bit-identical to frac 1.0 (default)
    "chunked": "LLAMA_HEADINFER_ATTN_CHUNKED",  # every layer in chunks of KV cells merged exactly: the same for every frac
}
# KV cells per chunk with headinfer_attn = "chunked": chunk boundaries fall on the KV cache's padding of 256 cells;
# 0 = the model's default, this many bytes of its largest layer's K and V rows in F16 (llama.h's
# LLAMA_HEADINFER_ATTN_CHUNK_DEFAULT_BYTES; llama_model_headinfer_attn_chunk, vram.memory.default_attn_chunk)
HEADINFER_ATTN_CHUNK_ALIGN = 256
HEADINFER_ATTN_CHUNK_DEFAULT_BYTES = 32 * 2**20


def check_choice(name: str, value, choices) -> str:
    """``value`` if it is one of ``choices`` (names); ValueError listing them otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_attn_chunk(value) -> int:
    """``headinfer_attn_chunk``: 0 (the default) or a positive multiple of 256 KV cells; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value % HEADINFER_ATTN_CHUNK_ALIGN:
        raise ValueError(f"headinfer_attn_chunk must be 0 (the default) or a positive multiple of "
                         f"{HEADINFER_ATTN_CHUNK_ALIGN} KV cells, got {value!r}")
    return value


def _optional_bool(name: str, value) -> Optional[bool]:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None, got {value!r}")
    return value


# --------------------------------------------------------------------------- #
# the parameters of a context
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class ContextParams:
    """What a :class:`~pyllama_headinfer.api.context.Context` is created with.

    Defaults are this package's (``n_ctx`` 512, flash attention on, f16 KV);
    ``n_threads`` None: the CPUs this process may run on
    (:func:`default_n_threads`; :meth:`threads`), ``n_threads_batch`` None:
    ``n_threads``; for the others ``None`` keeps llama.cpp's default
    (``kv_unified``, ``swa_full``; ``flash_attn=None`` is llama.cpp's "auto").

    HeadInfer: at most one of ``headinfer_gpu_heads_frac`` (the fraction of
    each layer's KV heads kept in the layer's own -- device -- buffer, in
    [0, 1]) and ``headinfer_vram_budget`` (bytes or e.g. ``"24GiB"``: the
    fraction is derived from the budget when the context is created; ``"auto"``:
    the free memory of the model's devices, less the 1 GiB per device that
    llama.cpp's ``--fit`` leaves free, plus the offloaded weights). Neither
    given: 1.0, HeadInfer off. Both given is an error, whatever the values.
    The host heads are copied to the device one layer ahead of its attention
    wherever the device can copy while it computes (CUDA; RPC).
    ``headinfer_attn`` (:data:`HEADINFER_ATTN_TYPES`) says how a split layer's
    attention reads its two halves; with ``"chunked"``
    every layer attends in chunks of ``headinfer_attn_chunk`` KV cells (a
    multiple of 256; 0 = the model's default, 32 MiB of a layer's K and V in F16:
    8192 cells for 8 KV heads of 128), merged exactly by their
    log-sum-exps (needs flash attention with that result: the CPU and CUDA;
    elsewhere one attention per layer, with a warning: docs/ARENA.md).
    """

    n_ctx: int = 512
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_threads: Optional[int] = None
    n_threads_batch: Optional[int] = None
    flash_attn: Optional[bool] = True
    type_k: str = "f16"
    type_v: str = "f16"
    offload_kqv: bool = True
    kv_unified: Optional[bool] = None
    swa_full: Optional[bool] = None
    headinfer_gpu_heads_frac: Optional[float] = None
    headinfer_vram_budget: Optional[Size] = None
    headinfer_attn: str = "joined"
    headinfer_attn_chunk: int = 0

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the checked values in place
        if self.headinfer_gpu_heads_frac is not None and self.headinfer_vram_budget is not None:
            raise UsageError(f"give headinfer_gpu_heads_frac ({self.headinfer_gpu_heads_frac!r}) or "
                             f"headinfer_vram_budget ({self.headinfer_vram_budget!r}), not both")
        if self.headinfer_gpu_heads_frac is not None:
            set_(self, "headinfer_gpu_heads_frac", check_headinfer_frac(self.headinfer_gpu_heads_frac))
        if self.headinfer_vram_budget is not None and self.headinfer_vram_budget != AUTO_VRAM_BUDGET:
            parse_size(self.headinfer_vram_budget)  # checked now, kept as given (for messages)
        set_(self, "n_ctx", check_count("n_ctx", self.n_ctx, 0))
        set_(self, "n_batch", check_count("n_batch", self.n_batch, 1))
        set_(self, "n_ubatch", check_count("n_ubatch", self.n_ubatch, 1))
        set_(self, "n_seq_max", check_count("n_seq_max", self.n_seq_max, 1))
        if self.n_threads is not None:
            set_(self, "n_threads", check_count("n_threads", self.n_threads, 1))
        if self.n_threads_batch is not None:
            set_(self, "n_threads_batch", check_count("n_threads_batch", self.n_threads_batch, 1))
        set_(self, "type_k", check_kv_type("type_k", self.type_k))
        set_(self, "type_v", check_kv_type("type_v", self.type_v))
        _optional_bool("flash_attn", self.flash_attn)
        _optional_bool("kv_unified", self.kv_unified)
        _optional_bool("swa_full", self.swa_full)
        set_(self, "offload_kqv", bool(self.offload_kqv))
        check_choice("headinfer_attn", self.headinfer_attn, HEADINFER_ATTN_TYPES)
        set_(self, "headinfer_attn_chunk", check_attn_chunk(self.headinfer_attn_chunk))
        if self.headinfer_attn == "chunked" and self.flash_attn is False:
            raise UsageError("headinfer_attn='chunked' needs flash attention (flash_attn=False given)")
        if self.headinfer_attn_chunk and self.headinfer_attn != "chunked":
            raise UsageError(f"headinfer_attn_chunk={self.headinfer_attn_chunk} applies to headinfer_attn='chunked' "
                             f"only, got headinfer_attn={self.headinfer_attn!r}")

    def threads(self) -> Tuple[int, int]:
        """``(n_threads, n_threads_batch)`` for llama.cpp: as given, else :func:`default_n_threads`
        (resolved now: the affinity may change) and ``n_threads``."""
        n = self.n_threads if self.n_threads is not None else default_n_threads()
        return n, self.n_threads_batch if self.n_threads_batch is not None else n

    @property
    def frac(self) -> float:
        """The fraction asked for: ``headinfer_gpu_heads_frac``, 1.0 when not given."""
        return 1.0 if self.headinfer_gpu_heads_frac is None else self.headinfer_gpu_heads_frac

    @property
    def vram_budget_bytes(self) -> Optional[int]:
        if self.headinfer_vram_budget == AUTO_VRAM_BUDGET:
            raise UsageError("headinfer_vram_budget='auto' is the device's free memory, known once a model is loaded: "
                             "Context resolves it (api.context.resolve_vram_budget); plan with a size")
        return None if self.headinfer_vram_budget is None else parse_size(self.headinfer_vram_budget)

    def replace(self, **changes) -> "ContextParams":
        """A copy with ``changes`` (checked again)."""
        return replace(self, **changes)


CONTEXT_PARAM_NAMES = tuple(f.name for f in fields(ContextParams))
