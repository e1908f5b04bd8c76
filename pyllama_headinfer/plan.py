"""Plan before you load: choose the HeadInfer head fraction from a VRAM budget.

    from pyllama_headinfer import plan

    p = plan.plan_kv("model.gguf", n_ctx=32768, vram_budget="24GiB", n_gpu_layers=99)
    print(p.format())          # the table: one row per g = 1 .. n_head_kv
    p.frac                     # headinfer_gpu_heads_frac for the largest g that fits
    plan.frac_for_budget("model.gguf", 32768, "24GiB")   # the same, or an error saying what would fit

Everything is computed from the GGUF file's metadata and tensor index (read
with ``gguf.GGUFReader``, which maps the file; no weight is read) and from
the rules of the pinned llama.cpp (b11312), restated here with the source
they come from:

* the cache size: ``n_ctx`` padded to 256; one stream per sequence unless
  ``kv_unified`` (``n_ctx_seq = pad(n_ctx / n_seq_max, 256)``) --
  src/llama-context.cpp; the iSWA pair (gemma3 with a sliding window): the
  base cache ``n_ctx_seq`` cells, the SWA cache
  ``pad(min(n_ctx_seq, n_swa * (kv_unified ? n_seq_max : 1) + n_ubatch), 256)``
  cells, or ``n_ctx_seq`` with ``swa_full`` -- src/llama-kv-cache-iswa.cpp;
* the layers: repeating layer ``il`` is on the GPU when
  ``il >= n_layer + 1 - n_gpu_layers`` (the "+1" is the output layer, which
  goes to the GPU as soon as ``n_gpu_layers >= 1``); token_embd stays on the
  CPU; a missing ``output.weight`` (tied embeddings) is duplicated from
  token_embd onto the output layer's device -- src/llama-model.cpp,
  ``load_tensors`` / ``create_tensor``;
* the split (patch 0002, ``headinfer_n_head_resident``): an offloaded layer
  with a non-transposed V cache (flash attention), two or more KV heads and
  a head size that is a multiple of the KV types' block size keeps
  ``clamp(lround(f * n_head_kv), 1, n_head_kv - 1)`` heads for ``f < 1``;
  every other layer stays whole;
* bytes: ``ggml_row_size(type, heads * head_size) * cells * n_stream`` per K
  and per V tensor (``gguf.GGML_QUANT_SIZES``) -- what
  ``llama_kv_residency_buffers`` reports, byte for byte.

The device total adds the offloaded weights and a compute-buffer *estimate*
(see :func:`compute_estimate` and docs/PLAN.md for its basis and limits).
"""

from __future__ import annotations

import errno
import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from .errors import HeadInferError

# Architectures whose KV layout this module knows (see _read_swa): a plain
# attention KV cache per layer, or gemma3's iSWA pair. Others (hybrid and
# recurrent memories, MLA, shared-KV layers, per-arch SWA rules) would each
# need their own rules from llama.cpp.
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")

# The KV cache types the Python API accepts (api/context.py KV_CACHE_TYPES).
KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")

# CUDA buffer rules at the pin (ggml/src/ggml-cuda/ggml-cuda.cu): 128-byte
# alignment, and quantized tensors whose rows are not a multiple of
# MATRIX_ROW_PADDING elements get one padded row's worth of extra bytes.
CUDA_ALIGNMENT = 128
CUDA_MATRIX_ROW_PADDING = 512

PAD_CTX = 256  # GGML_PAD(n_ctx, 256) in llama_context; the SWA cache too
OP_OFFLOAD_MIN_BATCH = 32  # ggml_backend_cuda_device_offload_op: batch >= 32

FORCE_SPLIT_ENV = "LLAMA_HEADINFER_FORCE_SPLIT"


class PlanError(HeadInferError, ValueError):
    """The plan cannot be made, or nothing fits the budget."""


class UnsupportedModelError(PlanError):
    """The model's architecture (or layout) is not one plan knows."""


class BudgetTooSmallError(PlanError):
    """The budget is smaller than the offloaded weights alone."""


class NothingFitsError(PlanError):
    """No head fraction fits the budget."""


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


def parse_size(value) -> int:
    """Bytes from an int/float or a string like ``"24GiB"``, ``"24 GB"``,
    ``"512M"``, ``"1e9"`` is not accepted. KiB/MiB/GiB/TiB and the bare
    K/M/G/T are binary (2**10 ...), KB/MB/GB/TB decimal; no unit = bytes."""
    if isinstance(value, bool):
        raise ValueError(f"a size must be bytes or a string like '24GiB', got {value!r}")
    if isinstance(value, (int, np.integer)):
        n = int(value)
    elif isinstance(value, (float, np.floating)):
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


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _lround(x: float) -> int:
    """C's lround for x >= 0: halves away from zero (Python's round() is banker's)."""
    return int(math.floor(x + 0.5))


def _type(name: str):
    from gguf import GGMLQuantizationType

    name = str(name).lower()
    if name not in KV_TYPES:
        raise ValueError(f"KV cache type must be one of {list(KV_TYPES)}, got {name!r}")
    return GGMLQuantizationType[name.upper()]


def _block(qtype) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


def row_size(qtype, n: int) -> int:
    """ggml_row_size(type, n): bytes of n elements of a row (n a multiple of the block)."""
    block, size = _block(qtype)
    if n % block:
        raise PlanError(f"a row of {n} elements is not a whole number of {qtype.name} blocks ({block})")
    return n // block * size


def cuda_alloc_size(qtype, ne0: int, nbytes: int) -> int:
    """Bytes a tensor takes in a CUDA buffer: ggml_backend_cuda_buffer_type_get_alloc_size
    (quantized rows padded to MATRIX_ROW_PADDING) aligned to 128."""
    block, size = _block(qtype)
    if block > 1 and ne0 % CUDA_MATRIX_ROW_PADDING:
        nbytes += (CUDA_MATRIX_ROW_PADDING - ne0 % CUDA_MATRIX_ROW_PADDING) // block * size
    return _pad(nbytes, CUDA_ALIGNMENT)


# --------------------------------------------------------------------------- #
# the model, from its GGUF metadata
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name, e.g. "F16", "Q4_K"
    ne0: int
    n_bytes: int


@dataclass(frozen=True)
class ModelInfo:
    """What the plan needs of a model, read from its GGUF file (no weights)."""
    path: str
    arch: str
    name: str | None
    n_layer: int  # block_count (llama.cpp's n_layer_all)
    n_layer_nextn: int  # trailing NextN/MTP layers (no KV in the main context)
    n_ctx_train: int
    n_embd: int
    n_vocab: int
    n_head: tuple  # per layer
    n_head_kv: tuple  # per layer
    n_ff: tuple  # per layer
    head_k: int
    head_v: int
    head_k_swa: int
    head_v_swa: int
    n_swa: int  # sliding window (0: none)
    is_swa: tuple  # per layer
    tensors: tuple = field(repr=False)

    @property
    def iswa(self) -> bool:
        return any(self.is_swa)

    def head_k_of(self, il: int) -> int:
        return self.head_k_swa if self.is_swa[il] else self.head_k

    def head_v_of(self, il: int) -> int:
        return self.head_v_swa if self.is_swa[il] else self.head_v

    @property
    def tied_output(self) -> bool:
        return not any(t.name == "output.weight" for t in self.tensors)


@dataclass(frozen=True)
class _Array:
    etype: int  # GGUF value type of the elements
    count: int
    values: tuple | None  # numbers (None for strings: only the count is kept)


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read_gguf(path: Path) -> tuple[dict, list]:
    """The metadata and the tensor index of a GGUF file, as (key -> value,
    [(name, ggml type id, ne, n_bytes)]). String arrays (the vocabulary) are
    skipped over, keeping their length: gguf.GGUFReader builds numpy views of
    every token and needs seconds for a 128k vocabulary; this needs
    milliseconds. Run after check_gguf (which bounds-checks the same walk)."""
    import mmap
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        pos = 8  # magic, version

        def unpack(fmt: str):
            nonlocal pos
            (v,) = struct.unpack_from(fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = unpack("<Q")
            pos += n
            return mm[pos - n:pos].decode("utf-8", "replace")

        def value(vtype: int):
            nonlocal pos
            if vtype in _GGUF_SCALARS:
                return unpack(_GGUF_SCALARS[vtype])
            if vtype == _GGUF_STRING:
                return string()
            if vtype == _GGUF_ARRAY:
                etype, count = unpack("<I"), unpack("<Q")
                if etype in _GGUF_SCALARS:
                    fmt = _GGUF_SCALARS[etype]
                    size = struct.calcsize(fmt)
                    values = struct.unpack_from("<" + fmt[1] * count, mm, pos) if count <= 1 << 20 else None
                    pos += size * count
                    return _Array(etype, count, values)
                if etype == _GGUF_STRING:
                    for _ in range(count):
                        n = unpack("<Q")  # (not `pos += unpack(...)`: that would drop unpack's own advance)
                        pos += n
                    return _Array(etype, count, None)
                raise PlanError(f"{path.name}: nested GGUF arrays are not supported")
            raise PlanError(f"{path.name}: unknown GGUF value type {vtype}")

        n_tensors, n_kv = unpack("<Q"), unpack("<Q")
        kv = {}
        for _ in range(n_kv):
            key = string()
            kv[key] = value(unpack("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            ne = [unpack("<Q") for _ in range(unpack("<I"))]
            ttype = unpack("<I")
            pos += 8  # offset
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            tensors.append((name, ttype, ne, math.prod(ne) // block * type_size))
    return kv, tensors


def _is_array(kv: dict, key: str) -> bool:
    return isinstance(kv.get(key), _Array)


def _scalar(kv: dict, key: str, default=None):
    v = kv.get(key, default)
    if isinstance(v, _Array):
        raise UnsupportedModelError(f"{key} is an array, expected a single value")
    return v


def _per_layer(kv: dict, key: str, n_layer: int, default=None) -> list | None:
    """llama_model_loader::get_key_or_arr: a scalar for every layer, or an array of exactly n_layer values."""
    v = kv.get(key)
    if v is None:
        return None if default is None else [default] * n_layer
    if isinstance(v, _Array):
        if v.count != n_layer or v.values is None:
            raise PlanError(f"{key} has {v.count} values for {n_layer} layers (llama.cpp refuses this model)")
        return [int(x) for x in v.values]
    return [int(v)] * n_layer


def read_model_info(path: str | os.PathLike) -> ModelInfo:
    """Read the layers, heads, head sizes, sliding window, vocabulary and the
    tensor index of a GGUF model. Raises FileNotFoundError / IsADirectoryError,
    ModelError (not a GGUF, truncated) or UnsupportedModelError."""
    from gguf import GGMLQuantizationType

    from .api.gguf_check import check_gguf

    path = Path(os.fspath(path))
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "model file not found", str(path))
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "model path is a directory", str(path))
    check_gguf(path)  # a clear ModelError for "not a GGUF" and truncated files
    meta, gguf_tensors = _read_gguf(path)

    arch = _scalar(meta, "general.architecture")
    if not arch:
        raise UnsupportedModelError(f"{path} has no general.architecture: not a llama.cpp model")
    if arch not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(
            f"{path.name}: architecture {arch!r} is not supported by plan (supported: {', '.join(SUPPORTED_ARCHS)}). "
            "Its KV cache layout (sliding-window rules, shared or MLA KV layers, recurrent state) would need "
            "its own rules from llama.cpp; nothing is guessed.")

    def key(k: str) -> str:
        return f"{arch}.{k}"

    n_layer = _scalar(meta, key("block_count"))
    n_embd = _scalar(meta, key("embedding_length"))
    n_ctx_train = _scalar(meta, key("context_length"))
    if not n_layer or not n_embd or n_ctx_train is None:
        raise PlanError(f"{path.name}: {arch}.block_count, .embedding_length or .context_length is missing")
    n_layer, n_embd, n_ctx_train = int(n_layer), int(n_embd), int(n_ctx_train)
    n_nextn = int(_scalar(meta, key("nextn_predict_layers"), 0) or 0)
    if n_nextn > n_layer:
        raise PlanError(f"{path.name}: nextn_predict_layers {n_nextn} > block_count {n_layer}")

    n_head = _per_layer(meta, key("attention.head_count"), n_layer, 0)
    n_head_kv = _per_layer(meta, key("attention.head_count_kv"), n_layer) or list(n_head)
    n_ff = _per_layer(meta, key("feed_forward_length"), n_layer, 0)
    if n_head[0] <= 0:
        raise UnsupportedModelError(f"{path.name}: no attention heads (head_count is 0)")
    head_k = int(_scalar(meta, key("attention.key_length"), n_embd // n_head[0]))
    head_v = int(_scalar(meta, key("attention.value_length"), n_embd // n_head[0]))
    head_k_swa = int(_scalar(meta, key("attention.key_length_swa"), head_k))
    head_v_swa = int(_scalar(meta, key("attention.value_length_swa"), head_v))

    # sliding window: only gemma3 of the supported architectures reads it
    # (src/models/gemma3.cpp: load_swa_pattern(ml, 6), dense_first = false)
    n_swa = 0
    is_swa = [False] * n_layer
    if arch == "gemma3":
        n_swa = int(_scalar(meta, key("attention.sliding_window"), 0) or 0)
        if n_swa > 0:
            pattern = meta.get(key("attention.sliding_window_pattern"))
            if isinstance(pattern, _Array):
                if pattern.values is None:
                    raise PlanError(f"{path.name}: sliding_window_pattern is not an array of numbers")
                values = [bool(x) for x in pattern.values]
                if len(values) > n_layer:
                    raise PlanError(f"{path.name}: sliding_window_pattern has {len(values)} values for {n_layer} layers")
                is_swa = values + [False] * (n_layer - len(values))
            else:
                n_pattern = int(_scalar(meta, key("attention.sliding_window_pattern"), 6))
                n_main = n_layer - n_nextn
                is_swa = [il < n_main and (n_pattern == 0 or il % n_pattern < n_pattern - 1)
                          for il in range(n_layer)]
            if not any(is_swa):
                raise UnsupportedModelError(f"{path.name}: a sliding window of {n_swa} but no SWA layer "
                                            "(llama.cpp asserts on this model)")

    tensors = tuple(TensorInfo(name, GGMLQuantizationType(ttype).name, ne[0] if ne else 1, nbytes)
                    for name, ttype, ne, nbytes in gguf_tensors)
    toks = meta.get("tokenizer.ggml.tokens")
    if isinstance(toks, _Array):
        n_vocab = toks.count
    else:
        emb = [ne for name, _, ne, _ in gguf_tensors if name == "token_embd.weight"]
        n_vocab = int(emb[0][1]) if emb and len(emb[0]) > 1 else 0

    return ModelInfo(path=str(path), arch=arch, name=_scalar(meta, "general.name"), n_layer=n_layer,
                     n_layer_nextn=n_nextn, n_ctx_train=n_ctx_train, n_embd=n_embd, n_vocab=n_vocab,
                     n_head=tuple(n_head), n_head_kv=tuple(n_head_kv), n_ff=tuple(n_ff), head_k=head_k,
                     head_v=head_v, head_k_swa=head_k_swa, head_v_swa=head_v_swa, n_swa=n_swa,
                     is_swa=tuple(is_swa), tensors=tensors)


# --------------------------------------------------------------------------- #
# settings -> cache geometry, layer placement
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Settings:
    """The context and model parameters the plan assumes (defaults: this
    package's Context defaults, all layers offloaded)."""
    n_ctx: int
    n_gpu_layers: int = -1  # -1 = all (llama.cpp: n_layer + 1)
    type_k: str = "f16"
    type_v: str = "f16"
    n_seq_max: int = 1
    kv_unified: bool = False  # llama_context_default_params
    swa_full: bool = True  # llama_context_default_params (common's CLI tools default to False)
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = True
    offload_kqv: bool = True
    op_offload: bool = True
    force_split: bool = False  # LLAMA_HEADINFER_FORCE_SPLIT: host-memory layers split too


@dataclass(frozen=True)
class Geometry:
    """The cache sizes llama.cpp derives from the settings."""
    n_ctx: int  # padded (llama_n_ctx)
    n_ctx_seq: int  # cells per stream of the (base) cache
    n_stream: int
    n_batch: int
    n_ubatch: int
    n_tokens_reserve: int  # tokens of the graph llama.cpp reserves the compute buffer for
    cells_base: int
    cells_swa: int  # 0 without an iSWA pair


def geometry(info: ModelInfo, s: Settings) -> Geometry:
    """src/llama-context.cpp (llama_context::llama_context) and src/llama-kv-cache-iswa.cpp."""
    if s.n_seq_max < 1 or s.n_seq_max > 256:
        raise ValueError(f"n_seq_max must be in [1, 256], got {s.n_seq_max}")
    if s.n_ctx < 0:
        raise ValueError(f"n_ctx must be >= 0, got {s.n_ctx}")
    if s.n_batch < 1 or s.n_ubatch < 1:
        raise ValueError("n_batch and n_ubatch must be >= 1")
    n_ctx = s.n_ctx or info.n_ctx_train
    n_batch = min(n_ctx, s.n_batch)  # causal attention
    n_ubatch = min(n_batch, s.n_ubatch)
    n_ctx = _pad(n_ctx, PAD_CTX)
    if s.kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = _pad(n_ctx // s.n_seq_max, PAD_CTX)
        n_ctx = n_ctx_seq * s.n_seq_max
    n_stream = 1 if s.kv_unified else s.n_seq_max
    cells_swa = 0
    if info.iswa:
        cells_swa = n_ctx_seq if s.swa_full else \
            _pad(min(n_ctx_seq, info.n_swa * (s.n_seq_max if s.kv_unified else 1) + n_ubatch), PAD_CTX)
    return Geometry(n_ctx=n_ctx, n_ctx_seq=n_ctx_seq, n_stream=n_stream, n_batch=n_batch, n_ubatch=n_ubatch,
                    n_tokens_reserve=min(n_ctx, n_ubatch), cells_base=n_ctx_seq, cells_swa=cells_swa)


def gpu_layer_start(info: ModelInfo, n_gpu_layers: int) -> int:
    """The first repeating layer on the GPU (src/llama-model.cpp, load_tensors):
    i_gpu_start = max(n_layer + 1 - ngl, 0); ngl < 0 means n_layer + 1. Layer
    n_layer is the output layer: on the GPU when ngl >= 1."""
    ngl = info.n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    return max(info.n_layer + 1 - ngl, 0)


@dataclass(frozen=True)
class KVLayer:
    il: int
    is_swa: bool  # in the SWA cache of an iSWA pair
    n_head_kv: int
    head_k: int
    head_v: int
    row_v: int  # V row elements (n_embd_v_gqa; the max over layers when V is transposed)
    cells: int
    n_stream: int
    on_device: bool  # its K/V buffer is the GPU's
    why_whole: str | None  # why it is never split (None: splits for f < 1)


def kv_layers(info: ModelInfo, s: Settings, geo: Geometry) -> list[KVLayer]:
    """The attention layers of the cache(s), in the residency report's order
    (by layer; base and SWA caches of an iSWA pair are disjoint)."""
    qk, qv = _type(s.type_k), _type(s.type_v)
    start = gpu_layer_start(info, s.n_gpu_layers)
    n_main = info.n_layer - info.n_layer_nextn
    v_trans = not s.flash_attn
    row_v_max = max(info.n_head_kv[il] * info.head_v_of(il) for il in range(info.n_layer))
    out = []
    for il in range(n_main if info.n_layer_nextn and n_main > 0 else info.n_layer):
        n = info.n_head_kv[il]
        hk, hv = info.head_k_of(il), info.head_v_of(il)
        on_device = s.offload_kqv and il >= start
        if v_trans:
            why = "the V cache is transposed (flash attention is off)"
        elif n < 2:
            why = "the layer has a single KV head"
        elif hk % _block(qk)[0] or hv % _block(qv)[0]:
            why = "the head size is not a multiple of the KV type's block size"
        elif not on_device and not s.force_split:
            why = f"the layer's KV is in host memory already ({FORCE_SPLIT_ENV}=1 splits it anyway)"
        else:
            why = None
        swa = info.is_swa[il]
        out.append(KVLayer(il=il, is_swa=swa, n_head_kv=n, head_k=hk, head_v=hv,
                           row_v=row_v_max if v_trans else n * hv,
                           cells=geo.cells_swa if swa else geo.cells_base, n_stream=geo.n_stream,
                           on_device=on_device, why_whole=why))
    return out


def n_resident(layer: KVLayer, frac: float) -> int:
    """headinfer_n_head_resident: the heads a layer keeps in its own buffer at ``frac``
    (a C float, as the context parameter is)."""
    if not float(np.float32(frac)) < 1.0 or layer.why_whole:
        return layer.n_head_kv
    g = _lround(float(np.float32(frac)) * layer.n_head_kv)
    return max(1, min(g, layer.n_head_kv - 1))


# --------------------------------------------------------------------------- #
# weights
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Weights:
    device: int  # ggml_nbytes of the tensors on the GPU
    device_alloc: int  # ... as CUDA allocates them (row padding, alignment)
    host: int
    host_layer_max: int  # the largest CPU layer (its matmuls run on the GPU via op offload)
    host_output: int  # output weight on the CPU (ditto), 0 when on the GPU
    n_layer_gpu: int
    output_on_gpu: bool


_INPUT_TENSORS = ("token_embd", "position_embd", "token_types")
_OUTPUT_TENSORS = ("output", "output_norm")
_PER_LAYER_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")  # one copy per layer
_BLK = re.compile(r"^blk\.(\d+)\.")


def weights(info: ModelInfo, n_gpu_layers: int) -> Weights:
    """Bytes of the weights per device for ``n_gpu_layers`` (src/llama-model.cpp
    load_tensors, llama-model-loader.cpp create_tensor): token_embd on the
    CPU; output/output_norm on the output layer's device; blk.N.* on layer N's;
    rope_freqs (llama) duplicated into every layer; a missing output.weight
    duplicated from token_embd onto the output layer's device."""
    from gguf import GGMLQuantizationType

    start = gpu_layer_start(info, n_gpu_layers)
    out_gpu = info.n_layer >= start
    n_main = info.n_layer - info.n_layer_nextn
    dev = dev_alloc = host = host_out = 0
    per_layer_host = [0] * info.n_layer

    def add(t: TensorInfo, on_gpu: bool, il: int | None = None, copies: int = 1):
        nonlocal dev, dev_alloc, host
        if on_gpu:
            dev += t.n_bytes * copies
            dev_alloc += cuda_alloc_size(GGMLQuantizationType[t.type], t.ne0, t.n_bytes) * copies
        else:
            host += t.n_bytes * copies
            if il is not None:
                per_layer_host[il] += t.n_bytes

    for t in info.tensors:
        m = _BLK.match(t.name)
        stem = t.name.split(".", 1)[0]
        if m:
            il = int(m.group(1))
            if il >= info.n_layer:
                raise PlanError(f"tensor {t.name} names layer {il} of a {info.n_layer}-layer model")
            add(t, il >= start, il)
        elif stem in _INPUT_TENSORS:
            add(t, False)
            if t.name == "token_embd.weight" and info.tied_output:
                add(t, out_gpu)  # the duplicated output tensor
                if not out_gpu:
                    host_out += t.n_bytes
        elif stem in _OUTPUT_TENSORS:
            add(t, out_gpu)
            if not out_gpu and t.name == "output.weight":
                host_out += t.n_bytes
        elif stem in _PER_LAYER_TENSORS:
            n_gpu = sum(1 for il in range(n_main) if il >= start)
            add(t, True, copies=n_gpu)
            add(t, False, copies=n_main - n_gpu)
        else:
            raise UnsupportedModelError(f"{Path(info.path).name}: tensor {t.name!r} is not one llama.cpp's "
                                        f"{info.arch} loader places; plan does not guess where it goes")
    return Weights(device=dev, device_alloc=dev_alloc, host=host, host_layer_max=max(per_layer_host, default=0),
                   host_output=host_out, n_layer_gpu=sum(1 for il in range(info.n_layer) if il >= start),
                   output_on_gpu=out_gpu)


# --------------------------------------------------------------------------- #
# the compute buffer estimate
# --------------------------------------------------------------------------- #

def compute_estimate(info: ModelInfo, s: Settings, geo: Geometry, layers: Sequence[KVLayer],
                     resident: Sequence[int], w: Weights) -> int:
    """An *estimate* of the GPU compute buffer llama.cpp reserves (the graph of
    one ubatch of T = min(n_ctx, n_ubatch) tokens, all of them outputs, over a
    full cache; ggml-alloc reuses memory, so the buffer is the peak of the live
    tensors, not their sum):

    * a layer's attention: 4 T (2 n_embd + Q + K + V + attention output) bytes
      of f32 activations, plus its KV working set -- for a split layer the
      concatenated K and V (the whole layer, cache type) and the uploaded copy
      of its host half (the scheduler copies the host tensors to the GPU);
      with a quantized KV type, flash attention's f16 copies of K and V
      (ggml_cuda_flash_attn_ext_get_alloc_size); the largest layer counts;
    * a layer's FFN: 4 T (2 n_embd + 3 n_ff);
    * the output: 4 T (n_vocab + 2 n_embd) when the logits are computed on
      the GPU (output layer offloaded, or op offload of its matmul);
    * the KQ masks: 2 bytes x cells x T per cache (f16, flash attention);
    * op offload (T >= 32): matmuls of CPU layers run on the GPU with the
      weights copied in: the largest CPU layer's weights (and the CPU output
      weight) on top.

    The largest of the layer and output stages, plus masks. Not included:
    the CUDA context, cuBLAS workspaces and the CUDA memory pool (outside
    llama.cpp's buffers) -- pass a margin for those. Returns 0 when nothing
    runs on the GPU.
    """
    T = geo.n_tokens_reserve
    offload_ops = s.op_offload and T >= OP_OFFLOAD_MIN_BATCH
    if w.n_layer_gpu == 0 and not w.output_on_gpu and not offload_ops:
        return 0
    qk, qv = _type(s.type_k), _type(s.type_v)
    quantized = _block(qk)[0] > 1 or _block(qv)[0] > 1
    f32 = 4
    attn_act = ffn_act = 0
    for il in range(info.n_layer):
        nh, nkv = info.n_head[il], info.n_head_kv[il]
        hk, hv = info.head_k_of(il), info.head_v_of(il)
        attn_act = max(attn_act, f32 * T * (2 * info.n_embd + nh * hk + nkv * hk + nkv * hv + nh * hv))
        ffn_act = max(ffn_act, f32 * T * (2 * info.n_embd + 3 * info.n_ff[il]))
    ws = 0
    masks = {}
    for layer, g in zip(layers, resident):
        cells = layer.cells * layer.n_stream
        masks[layer.is_swa] = 2 * layer.cells * T
        if not (layer.on_device or offload_ops):
            continue
        full_k = row_size(qk, layer.n_head_kv * layer.head_k) * cells
        full_v = row_size(qv, layer.row_v) * cells
        lw = 0
        if g < layer.n_head_kv:
            lw += full_k + full_v  # concat results
            lw += row_size(qk, (layer.n_head_kv - g) * layer.head_k) * cells  # uploaded host halves
            lw += row_size(qv, (layer.n_head_kv - g) * layer.head_v) * cells
        if quantized:
            lw += 2 * (layer.n_head_kv * layer.head_k + layer.row_v) * cells  # f16 copies for flash attention
        ws = max(ws, lw)
    offload_w = w.host_layer_max if offload_ops and w.n_layer_gpu < info.n_layer else 0
    layer_stage = max(attn_act + ws, ffn_act) + offload_w
    output_stage = 0
    if w.output_on_gpu or offload_ops:
        output_stage = f32 * T * (info.n_vocab + 2 * info.n_embd) + (w.host_output if offload_ops else 0)
    return max(layer_stage, output_stage) + sum(masks.values())


# --------------------------------------------------------------------------- #
# the plan
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Row:
    """One candidate: g heads of n_head_kv resident (f = g / n_head_kv)."""
    g: int
    frac: float
    n_split: int  # layers split at this fraction
    resident_k: int  # K/V bytes in the layers' own buffers (device or, for CPU layers, host)
    resident_v: int
    host_half_k: int  # K/V bytes of the host halves ("headinfer host" buffers)
    host_half_v: int
    device_kv: int  # KV bytes on the GPU (ggml_nbytes; what the residency report shows)
    host_kv: int  # KV bytes in host memory (host halves + layers not offloaded)
    device_kv_alloc: int  # device_kv as CUDA allocates it
    compute: int  # compute buffer estimate
    device_total: int  # weights + KV + compute (CUDA allocation sizes)
    fits: bool | None  # None without a budget
    layers: tuple = field(repr=False, default=())  # (il, n_head_kv, n_head_resident, is_swa)


@dataclass
class Plan:
    info: ModelInfo
    settings: Settings
    geometry: Geometry
    weights: Weights
    layers: list
    rows: list
    budget: int | None
    margin: int
    chosen: Row | None
    notes: list = field(default_factory=list)
    suggestions: list = field(default_factory=list)

    @property
    def n_head_kv(self) -> int:
        return len(self.rows)

    @property
    def frac(self) -> float:
        """headinfer_gpu_heads_frac of the chosen row; raises when nothing fits (or no budget)."""
        if self.chosen is None:
            raise self.error()
        return self.chosen.frac

    @property
    def g(self) -> int:
        if self.chosen is None:
            raise self.error()
        return self.chosen.g

    def row(self, g: int) -> Row:
        return self.rows[g - 1]

    def row_for_frac(self, frac: float) -> Row:
        """The row a context with ``headinfer_gpu_heads_frac = frac`` allocates."""
        widest = max(self.layers, key=lambda x: x.n_head_kv)
        return _row(self.info, self.settings, self.geometry, self.layers, self.weights, frac,
                    n_resident(widest, frac), self.budget, self.margin)

    def error(self) -> PlanError:
        if self.budget is None:
            return PlanError("no VRAM budget was given, so nothing was chosen")
        avail = self.budget - self.margin
        if self.weights.device_alloc > avail:
            return BudgetTooSmallError(
                f"the budget ({format_bytes(self.budget)}{self._margin_text()}) is smaller than the weights the "
                f"GPU gets with n_gpu_layers={self.settings.n_gpu_layers} ({format_bytes(self.weights.device_alloc)}). "
                + self._advice())
        smallest = min(self.rows, key=lambda r: r.device_total)
        return NothingFitsError(
            f"no head fraction fits the budget ({format_bytes(self.budget)}{self._margin_text()}): the smallest "
            f"estimate is {format_bytes(smallest.device_total)} at g = {smallest.g}. " + self._advice())

    def _margin_text(self) -> str:
        return f" less a margin of {format_bytes(self.margin)}" if self.margin else ""

    def _advice(self) -> str:
        return ("What would fit: " + "; ".join(self.suggestions) + ".") if self.suggestions else \
            "Nothing tried fits either (fewer GPU layers, a quantized KV type, a shorter context)."

    def residency(self, g_or_row: int | Row | None = None) -> dict:
        """The predicted residency of a row (default: the chosen one), shaped
        like the totals of Context.kv_residency(): layers (il, n_head_kv,
        n_head_resident, is_swa), and K/V bytes in the layers' own buffers
        ("resident") and in the separately allocated host halves."""
        row = self.chosen if g_or_row is None else g_or_row if isinstance(g_or_row, Row) else self.row(g_or_row)
        if row is None:
            raise self.error()
        return {"layers": [dict(il=il, n_head_kv=n, n_head_resident=r, is_swa=swa) for il, n, r, swa in row.layers],
                "resident": {"k": row.resident_k, "v": row.resident_v},
                "host_half": {"k": row.host_half_k, "v": row.host_half_v}}

    def to_dict(self) -> dict:
        d = {"model": {k: v for k, v in asdict(self.info).items() if k != "tensors"},
             "settings": asdict(self.settings), "geometry": asdict(self.geometry), "weights": asdict(self.weights),
             "budget": self.budget, "margin": self.margin,
             "rows": [{k: v for k, v in asdict(r).items() if k != "layers"} for r in self.rows],
             "chosen": None if self.chosen is None else {"g": self.chosen.g, "frac": self.chosen.frac},
             "notes": list(self.notes), "suggestions": list(self.suggestions)}
        return d

    # -- text ------------------------------------------------------------- #

    def format(self, exact: bool = False, per_layer: bool = False, summary: bool = True) -> str:
        """The table (``exact``: byte counts), the per-layer split of the
        choice (``per_layer``) and the summary line (``summary``)."""
        fb = (lambda n: f"{n}") if exact else format_bytes
        i, s, geo, w = self.info, self.settings, self.geometry, self.weights
        kvs = sorted(set(i.n_head_kv[x.il] for x in self.layers))
        heads = "/".join(str(n) for n in kvs)
        lines = [f"model: {Path(i.path).name} ({i.arch}, {i.n_layer} layers, {heads} KV heads per layer, "
                 f"head size {i.head_k}/{i.head_v}, vocab {i.n_vocab})"]
        if i.iswa:
            n_swa_layers = sum(1 for x in self.layers if x.is_swa)
            lines.append(f"sliding window: {i.n_swa} tokens on {n_swa_layers} of {len(self.layers)} layers "
                         f"(iSWA: SWA cache {geo.cells_swa} cells{', swa_full' if s.swa_full else ''})")
        lines.append(f"context: n_ctx {s.n_ctx or i.n_ctx_train} -> {geo.n_ctx_seq} cells x {geo.n_stream} "
                     f"stream{'s' if geo.n_stream > 1 else ''} (n_seq_max {s.n_seq_max}"
                     f"{', kv_unified' if s.kv_unified else ''}), K {s.type_k} / V {s.type_v}, "
                     f"n_ubatch {geo.n_ubatch}, flash attention {'on' if s.flash_attn else 'off'}")
        start = gpu_layer_start(i, s.n_gpu_layers)
        where = "none" if w.n_layer_gpu == 0 else f"layers {start}-{i.n_layer - 1}"
        lines.append(f"offload: n_gpu_layers {s.n_gpu_layers} -> {where} ({w.n_layer_gpu} of {i.n_layer})"
                     f"{' + output' if w.output_on_gpu else ''} on the GPU; weights on the GPU "
                     f"{fb(w.device_alloc)}, in host memory {fb(w.host)}")
        if self.budget is not None:
            lines.append(f"budget: {fb(self.budget)}" + (f" (margin {fb(self.margin)})" if self.margin else ""))
        lines.append("")
        head = f"{'g':>3} {'frac':>6} {'split':>7} {'device KV':>12} {'host KV':>12} {'compute*':>11} " \
               f"{'device total':>13}  fits"
        lines.append(head)
        for r in self.rows:
            fits = "-" if r.fits is None else ("yes" if r.fits else "no")
            mark = "  <- chosen" if self.chosen is not None and r.g == self.chosen.g else ""
            lines.append(f"{r.g:>3} {r.frac:>6.3f} {f'{r.n_split}/{len(self.layers)}':>7} {fb(r.device_kv):>12} "
                         f"{fb(r.host_kv):>12} {fb(r.compute):>11} {fb(r.device_total):>13}  {fits}{mark}")
        lines.append("* compute: an estimate of llama.cpp's GPU compute buffer (docs/PLAN.md); device total = "
                     "weights + KV + compute, as CUDA allocates them; the CUDA context itself is not included")
        for note in self.notes:
            lines.append(f"note: {note}")
        if per_layer and self.chosen is not None:
            lines.append("")
            lines.append(f"layers at g = {self.chosen.g}:")
            for il, n, r, swa in self.chosen.layers:
                lines.append(f"  layer {il:3d}: {r}/{n} heads resident{' swa' if swa else ''}")
        if summary:
            lines.append("")
            lines.append(self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        if self.budget is None:
            return "no budget given (--vram): nothing chosen"
        if self.chosen is None:
            return "nothing fits: " + str(self.error())
        r = self.chosen
        if r.g == self.n_head_kv:
            return (f"choice: g = {r.g} of {self.n_head_kv} (headinfer_gpu_heads_frac = 1.0): everything fits "
                    f"on the GPU, no split needed (device total {format_bytes(r.device_total)})")
        if r.n_split == 0:
            return (f"choice: g = {r.g} of {self.n_head_kv} (headinfer_gpu_heads_frac = {r.frac:.6g}), but no layer "
                    "splits at these settings (see the notes)")
        return (f"choice: g = {r.g} of {self.n_head_kv} KV heads on the GPU: headinfer_gpu_heads_frac = "
                f"{r.frac:.6g} (device total {format_bytes(r.device_total)}, {format_bytes(r.host_kv)} of KV "
                "in host memory)")


def _row(info: ModelInfo, s: Settings, geo: Geometry, layers: Sequence[KVLayer], w: Weights, frac: float,
         g: int, budget: int | None, margin: int) -> Row:
    qk, qv = _type(s.type_k), _type(s.type_v)
    res = [n_resident(x, frac) for x in layers]
    rk = rv = hk = hv = dkv = dalloc = hostkv = 0
    for x, r in zip(layers, res):
        cells = x.cells * x.n_stream
        k = row_size(qk, r * x.head_k) * cells
        v = row_size(qv, x.row_v if r == x.n_head_kv else r * x.head_v) * cells
        kh = row_size(qk, (x.n_head_kv - r) * x.head_k) * cells
        vh = row_size(qv, (x.n_head_kv - r) * x.head_v) * cells
        rk, rv, hk, hv = rk + k, rv + v, hk + kh, hv + vh
        hostkv += kh + vh
        if x.on_device:
            dkv += k + v
            dalloc += cuda_alloc_size(qk, r * x.head_k, k) + \
                cuda_alloc_size(qv, x.row_v if r == x.n_head_kv else r * x.head_v, v)
        else:
            hostkv += k + v
    compute = compute_estimate(info, s, geo, layers, res, w)
    total = w.device_alloc + dalloc + compute
    fits = None if budget is None else total + margin <= budget
    return Row(g=g, frac=float(frac), n_split=sum(1 for x, r in zip(layers, res) if r < x.n_head_kv),
               resident_k=rk, resident_v=rv, host_half_k=hk, host_half_v=hv, device_kv=dkv, host_kv=hostkv,
               device_kv_alloc=dalloc, compute=compute, device_total=total, fits=fits,
               layers=tuple((x.il, x.n_head_kv, r, x.is_swa) for x, r in zip(layers, res)))


def frac_for_g(g: int, n_head_kv: int) -> float:
    """The fraction that gives g of n_head_kv heads: g / n (1.0 = no split).
    round(float32(g / n) * n) == g for every 1 <= g <= n (checked in the tests)."""
    return 1.0 if g >= n_head_kv else g / n_head_kv


def _compute(info: ModelInfo, s: Settings, budget: int | None, margin: int) -> Plan:
    geo = geometry(info, s)
    layers = kv_layers(info, s, geo)
    if not layers:
        raise UnsupportedModelError(f"{Path(info.path).name}: no attention layer has a KV cache")
    w = weights(info, s.n_gpu_layers)
    n_max = max(x.n_head_kv for x in layers)
    if n_max < 1:
        raise UnsupportedModelError(f"{Path(info.path).name}: no KV heads")
    rows = [_row(info, s, geo, layers, w, frac_for_g(g, n_max), g, budget, margin) for g in range(1, n_max + 1)]
    chosen = None
    if budget is not None:
        fitting = [r for r in rows if r.fits]
        chosen = fitting[-1] if fitting else None
    notes = []
    whole: dict = {}
    for x in layers:
        if x.why_whole:
            whole[x.why_whole] = whole.get(x.why_whole, 0) + 1
    for why, n in whole.items():
        notes.append(f"{n} of {len(layers)} layers never split: {why}")
    if len(set(x.n_head_kv for x in layers)) > 1:
        notes.append(f"KV heads differ per layer: g counts heads of the widest layer ({n_max}); a layer with n heads "
                     "keeps clamp(round(frac * n), 1, n - 1)")
    return Plan(info=info, settings=s, geometry=geo, weights=w, layers=layers, rows=rows, budget=budget,
                margin=margin, chosen=chosen, notes=notes)


def _suggest(plan: Plan) -> list[str]:
    """What would fit when nothing does: fewer GPU layers, a quantized KV type, a shorter context."""
    info, s, budget, margin = plan.info, plan.settings, plan.budget, plan.margin
    out = []

    def best(p: Plan) -> str:
        r = p.chosen
        return f"g = {r.g} of {p.n_head_kv}, frac {r.frac:.6g}, device total {format_bytes(r.device_total)}"

    ngl = info.n_layer + 1 if s.n_gpu_layers < 0 else min(s.n_gpu_layers, info.n_layer + 1)
    for k in range(ngl - 1, -1, -1):
        p = _compute(info, replace(s, n_gpu_layers=k), budget, margin)
        if p.chosen is not None:
            if k > 0:  # with no GPU layer at all there is nothing to plan
                out.append(f"fewer GPU layers: n_gpu_layers {k} ({best(p)})")
            break
    def bytes_per_value(t: str) -> float:
        block, size = _block(_type(t))
        return size / block

    for t in ("q8_0", "q4_0"):
        if bytes_per_value(t) >= max(bytes_per_value(s.type_k), bytes_per_value(s.type_v)):
            continue  # the cache is that small already
        p = _compute(info, replace(s, type_k=t, type_v=t), budget, margin)
        if p.chosen is not None:
            out.append(f"a quantized KV cache: type_k = type_v = {t} ({best(p)})")
            break
    if info.iswa and s.swa_full:
        p = _compute(info, replace(s, swa_full=False), budget, margin)
        if p.chosen is not None:
            out.append(f"a window-sized SWA cache: swa_full off ({best(p)})")
    n_ctx = s.n_ctx or info.n_ctx_train
    lo, hi, found = 1, (n_ctx - 1) // PAD_CTX, None  # candidates: k * 256 < n_ctx
    while lo <= hi:
        mid = (lo + hi) // 2
        p = _compute(info, replace(s, n_ctx=mid * PAD_CTX), budget, margin)
        if p.chosen is not None:
            found, lo = p, mid + 1
        else:
            hi = mid - 1
    if found is not None:
        out.append(f"a shorter context: n_ctx {found.settings.n_ctx} ({best(found)})")
    if s.n_seq_max > 1:
        p = _compute(info, replace(s, n_seq_max=1), budget, margin)
        if p.chosen is not None:
            out.append(f"one sequence: n_seq_max 1 ({best(p)})")
    return out


def plan_kv(model: str | os.PathLike | ModelInfo, n_ctx: int, vram_budget=None, *, n_gpu_layers: int = -1,
            type_k: str = "f16", type_v: str = "f16", n_seq_max: int = 1, kv_unified: bool = False,
            swa_full: bool = True, n_batch: int = 512, n_ubatch: int = 512, flash_attn: bool = True,
            offload_kqv: bool = True, op_offload: bool = True, force_split: bool = False, margin=0) -> Plan:
    """Plan the KV cache of ``model`` (a GGUF path or a :class:`ModelInfo`) for
    a context of ``n_ctx`` tokens: one :class:`Row` per g = 1 .. n_head_kv, and
    with ``vram_budget`` (bytes or a string like "24GiB") the largest g whose
    estimated device total plus ``margin`` fits (``Plan.chosen``; ``Plan.frac``).

    The other parameters are the context's and the model's (``n_gpu_layers``
    -1 = all); ``force_split`` plans as ``LLAMA_HEADINFER_FORCE_SPLIT=1`` runs
    (layers in host memory split too). When nothing fits, ``Plan.chosen`` is
    None and ``Plan.suggestions`` says what would fit."""
    info = model if isinstance(model, ModelInfo) else read_model_info(model)
    for name, value in (("n_ctx", n_ctx), ("n_gpu_layers", n_gpu_layers), ("n_seq_max", n_seq_max),
                        ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    s = Settings(n_ctx=int(n_ctx), n_gpu_layers=int(n_gpu_layers), type_k=str(type_k).lower(),
                 type_v=str(type_v).lower(), n_seq_max=int(n_seq_max), kv_unified=bool(kv_unified),
                 swa_full=bool(swa_full), n_batch=int(n_batch), n_ubatch=int(n_ubatch), flash_attn=bool(flash_attn),
                 offload_kqv=bool(offload_kqv), op_offload=bool(op_offload), force_split=bool(force_split))
    _type(s.type_k), _type(s.type_v)
    budget = None if vram_budget is None else parse_size(vram_budget)
    margin = 0 if not margin else parse_size(margin)
    plan = _compute(info, s, budget, margin)
    if budget is not None and plan.chosen is None:
        plan.suggestions = _suggest(plan)
    return plan


def frac_for_budget(model: str | os.PathLike | ModelInfo, n_ctx: int, vram_budget, **kwargs) -> float:
    """``headinfer_gpu_heads_frac`` for the largest g that fits ``vram_budget``
    (1.0 when everything fits unsplit). Raises BudgetTooSmallError when the
    offloaded weights alone exceed the budget, NothingFitsError when no g fits;
    both say what would. Keyword arguments as :func:`plan_kv`."""
    if vram_budget is None:
        raise ValueError("frac_for_budget needs a vram_budget")
    return plan_kv(model, n_ctx, vram_budget, **kwargs).frac


def plan_for_context(model_path: str | os.PathLike, vram_budget, *, n_gpu_layers: int, gpu_offload: bool,
                     n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, type_k: str, type_v: str,
                     flash_attn: bool | None, offload_kqv: bool, kv_unified: bool | None,
                     swa_full: bool | None) -> Plan | None:
    """The plan behind ``Context(..., headinfer_vram_budget=...)``: the
    context's parameters (None = llama.cpp's defaults; flash_attn None (auto)
    is planned as on) and where its model's layers are.

    On a build without GPU offload nothing is on a device: with
    LLAMA_HEADINFER_FORCE_SPLIT=1, which makes llama.cpp split every layer as
    if it were offloaded, it plans as if every layer were (the layers' own
    buffers stand for the device); without it there is nothing to budget and
    this returns None. Raises like :func:`frac_for_budget` when nothing fits."""
    force = force_split_from_env()
    if not gpu_offload and not force:
        return None
    p = plan_kv(model_path, n_ctx, vram_budget, n_gpu_layers=n_gpu_layers if gpu_offload else -1,
                type_k=type_k, type_v=type_v, n_seq_max=n_seq_max, kv_unified=bool(kv_unified),
                swa_full=True if swa_full is None else swa_full, n_batch=n_batch, n_ubatch=n_ubatch,
                flash_attn=flash_attn is not False, offload_kqv=offload_kqv, force_split=force)
    emulated = "" if gpu_offload else \
        f" (a build without GPU offload under {FORCE_SPLIT_ENV}=1: planned as if every layer were offloaded)"
    if emulated:
        p.notes.append(emulated.strip(" ()"))
    if p.chosen is None:
        err = p.error()
        raise type(err)(str(err) + emulated)
    return p


def force_split_from_env(environ=os.environ) -> bool:
    """Whether LLAMA_HEADINFER_FORCE_SPLIT is on, read as llama.cpp reads it (atoi != 0)."""
    v = environ.get(FORCE_SPLIT_ENV)
    if not v:
        return False
    m = re.match(r"\s*[+-]?\d+", v)
    return bool(m and int(m.group(0)) != 0)


__all__ = ["plan_kv", "frac_for_budget", "read_model_info", "parse_size", "format_bytes", "Plan", "Row",
           "Settings", "Geometry", "ModelInfo", "KVLayer", "Weights", "PlanError", "UnsupportedModelError",
           "BudgetTooSmallError", "NothingFitsError", "SUPPORTED_ARCHS", "KV_TYPES", "frac_for_g",
           "compute_estimate", "kv_layers", "geometry", "weights", "gpu_layer_start", "n_resident",
           "force_split_from_env", "plan_for_context", "row_size", "cuda_alloc_size"]
