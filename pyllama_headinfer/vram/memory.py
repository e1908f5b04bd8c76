"""The memory side of :mod:`pyllama_headinfer.plan`: from a model and the
context settings to bytes, by the rules of the pinned llama.cpp (the sources
are named in :mod:`pyllama_headinfer.plan`'s docstring and at each function).

* :class:`Settings` -> :func:`geometry` (:class:`Geometry`: cache cells,
  streams, the SWA cache of an iSWA pair);
* placement and the head split: :func:`gpu_layer_start`, :func:`kv_layers`
  (:class:`KVLayer`), :func:`n_resident`;
* sizes: :func:`row_size` (ggml_row_size), :func:`cuda_alloc_size`;
* :func:`weights` (:class:`Weights`: weight bytes per device);
* :func:`compute_estimate`: the GPU compute buffer estimate.

Import these from :mod:`pyllama_headinfer.plan`, which re-exports them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from pyllama_headinfer.errors import PlanError, UnsupportedModelError
from pyllama_headinfer.params import (HEADINFER_ATTN_CHUNK_ALIGN, HEADINFER_ATTN_CHUNK_DEFAULT_BYTES, KV_CACHE_TYPES,
                                      ContextParams)
from pyllama_headinfer.vram.model import ModelInfo, TensorInfo

# The KV cache types the Python API accepts (api/context.py KV_CACHE_TYPES).

# CUDA buffer rules at the pin (ggml/src/ggml-cuda/ggml-cuda.cu): 128-byte
# alignment, and quantized tensors whose rows are not a multiple of
# MATRIX_ROW_PADDING elements get one padded row's worth of extra bytes.
CUDA_ALIGNMENT = 128
CUDA_MATRIX_ROW_PADDING = 512

PAD_CTX = 256  # GGML_PAD(n_ctx, 256) in llama_context; the SWA cache too
OP_OFFLOAD_MIN_BATCH = 32  # ggml_backend_cuda_device_offload_op: batch >= 32

FORCE_SPLIT_ENV = "LLAMA_HEADINFER_FORCE_SPLIT"


# --------------------------------------------------------------------------- #
# sizes
# --------------------------------------------------------------------------- #

def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _lround(x: float) -> int:
    """C's lround for x >= 0: halves away from zero (Python's round() is banker's)."""
    return int(math.floor(x + 0.5))


def ggml_type(name: str):
    from gguf import GGMLQuantizationType

    name = str(name).lower()
    if name not in KV_CACHE_TYPES:
        raise ValueError(f"KV cache type must be one of {list(KV_CACHE_TYPES)}, got {name!r}")
    return GGMLQuantizationType[name.upper()]


def block_of(qtype) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES

    return GGML_QUANT_SIZES[qtype]


def row_size(qtype, n: int) -> int:
    """ggml_row_size(type, n): bytes of n elements of a row (n a multiple of the block)."""
    block, size = block_of(qtype)
    if n % block:
        raise PlanError(f"a row of {n} elements is not a whole number of {qtype.name} blocks ({block})")
    return n // block * size


def cuda_alloc_size(qtype, ne0: int, nbytes: int) -> int:
    """Bytes a tensor takes in a CUDA buffer: ggml_backend_cuda_buffer_type_get_alloc_size
    (quantized rows padded to MATRIX_ROW_PADDING) aligned to 128."""
    block, size = block_of(qtype)
    if block > 1 and ne0 % CUDA_MATRIX_ROW_PADDING:
        nbytes += (CUDA_MATRIX_ROW_PADDING - ne0 % CUDA_MATRIX_ROW_PADDING) // block * size
    return _pad(nbytes, CUDA_ALIGNMENT)


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
    attn_chunk: int = 0  # KV cells per chunk with headinfer_attn = "chunked"; 0: one attention per layer

    @classmethod
    def from_params(cls, params: ContextParams, info: ModelInfo, *, n_gpu_layers: int = -1, force_split: bool = False,
                    op_offload: bool = True) -> "Settings":
        """The settings a context with ``params`` gets on the model ``info``:
        ``None`` resolved to llama.cpp's defaults (kv_unified off, swa_full
        on; flash attention "auto" planned as on, the case where layers can
        split; the model's chunk, :func:`default_attn_chunk`)."""
        return cls(n_ctx=params.n_ctx, n_gpu_layers=n_gpu_layers, type_k=params.type_k, type_v=params.type_v,
                   n_seq_max=params.n_seq_max, kv_unified=bool(params.kv_unified),
                   swa_full=True if params.swa_full is None else params.swa_full, n_batch=params.n_batch,
                   n_ubatch=params.n_ubatch, flash_attn=params.flash_attn is not False,
                   offload_kqv=params.offload_kqv, op_offload=op_offload, force_split=force_split,
                   attn_chunk=(params.headinfer_attn_chunk or default_attn_chunk(info))
                   if params.headinfer_attn == "chunked" else 0)


def default_attn_chunk(info: ModelInfo) -> int:
    """The KV cells per chunk that ``headinfer_attn_chunk = 0`` gives (llama.cpp's
    llama_model_headinfer_attn_chunk, patch 0040): HEADINFER_ATTN_CHUNK_DEFAULT_BYTES
    of the largest layer's K and V rows in F16, in whole multiples of 256 cells,
    at least 256 (8192 cells for 8 KV heads of 128). The model's alone: every
    fraction and cache type attends in the same chunks."""
    n_layer = info.n_layer - info.n_layer_nextn
    row = max((2 * info.n_head_kv[il] * (info.head_k_of(il) + info.head_v_of(il)) for il in range(n_layer)), default=0)
    cells = HEADINFER_ATTN_CHUNK_DEFAULT_BYTES // row if row else 0
    return max(HEADINFER_ATTN_CHUNK_ALIGN, cells // HEADINFER_ATTN_CHUNK_ALIGN * HEADINFER_ATTN_CHUNK_ALIGN)


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
    qk, qv = ggml_type(s.type_k), ggml_type(s.type_v)
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
        elif hk % block_of(qk)[0] or hv % block_of(qv)[0]:
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

def _attn_cells(s: Settings, layer: KVLayer) -> int:
    """The cells one attention reads: the layer's, or in chunked mode one
    chunk's of ``s.attn_chunk`` cells per stream (patches 0032, 0034)."""
    return (min(layer.cells, s.attn_chunk) if s.attn_chunk else layer.cells) * layer.n_stream


def _host_row(s: Settings, layer: KVLayer, g: int) -> int:
    """Bytes per cell of a layer's host K and V with g of its heads resident."""
    n_host = layer.n_head_kv - g
    return row_size(ggml_type(s.type_k), n_host * layer.head_k) + row_size(ggml_type(s.type_v), n_host * layer.head_v)


# the largest staging slot that the scheduler adds a third slot for (patch 0042: GGML_SCHED_STREAM_SMALL_SLOT)
STREAM_SMALL_SLOT = 128 << 20


def _split_transient(s: Settings, layer: KVLayer, g: int) -> tuple[int, int]:
    """A split layer's (slot, joined) device bytes: one of the scheduler's
    staging slots, which holds its host K and V (patch 0018), and its K and V
    joined on the device, both over the cells of one attention
    (:func:`_attn_cells`). (0, 0) for a layer that does not split.

    In chunked mode a chunk that is the layer's whole cache has no neighbouring
    cell for the spare row that takes a batch's rows of other chunks, so its
    joined K, then V, is copied with its first row appended while it is alive
    (patch 0034): one more of the larger of the two."""
    if g >= layer.n_head_kv:
        return 0, 0
    cells = _attn_cells(s, layer)
    joined_k = row_size(ggml_type(s.type_k), layer.n_head_kv * layer.head_k)
    joined_v = row_size(ggml_type(s.type_v), layer.row_v)
    joined = joined_k + joined_v
    if s.attn_chunk and layer.cells <= s.attn_chunk:
        joined += max(joined_k, joined_v)
    return _host_row(s, layer, g) * cells, joined * cells


def _staging(s: Settings, layers: Sequence[KVLayer], resident: Sequence[int], slot: int) -> int:
    """The scheduler's staging buffer for slots of ``slot`` bytes: three slots
    while a slot is small (at most :data:`STREAM_SMALL_SLOT`) and at least
    three splits stream (one per split layer, or per chunk of one in chunked
    mode), two otherwise (patch 0042)."""
    n_streamed = sum(-(-layer.cells // s.attn_chunk) if s.attn_chunk else 1
                     for layer, g in zip(layers, resident) if layer.on_device and g < layer.n_head_kv)
    return (3 if slot <= STREAM_SMALL_SLOT and n_streamed >= 3 else 2) * slot


def arena_estimate(s: Settings, layers: Sequence[KVLayer], resident: Sequence[int]) -> int:
    """The device memory the split adds to stream the host heads (0 when no
    layer splits): the staging slots of the largest split layer's host heads
    (:func:`_staging`) and its joined K and V (:func:`_split_transient`). It
    grows with the context with one attention per layer; in chunked mode it is
    fixed by the chunk size."""
    parts = [_split_transient(s, x, g) for x, g in zip(layers, resident) if x.on_device]
    slot = max((p[0] for p in parts), default=0)
    return _staging(s, layers, resident, slot) + max((p[1] for p in parts), default=0)


def compute_estimate(info: ModelInfo, s: Settings, geo: Geometry, layers: Sequence[KVLayer],
                     resident: Sequence[int], w: Weights) -> int:
    """An *estimate* of the GPU compute buffer llama.cpp reserves (the graph of
    one ubatch of T = min(n_ctx, n_ubatch) tokens, all of them outputs, over a
    full cache; ggml-alloc reuses memory, so the buffer is the peak of the live
    tensors, not their sum):

    * a layer's attention: 4 T (2 n_embd + Q + K + V + attention output) bytes
      of f32 activations, plus its KV working set -- for a split layer the
      concatenated K and V (the whole layer, cache type); with a quantized KV
      type, flash attention's f16 copies of K and V
      (ggml_cuda_flash_attn_ext_get_alloc_size); the largest layer counts;
    * a layer's FFN: 4 T (3 n_embd + 3 n_ff) (the residual stream, the FFN's
      input and its norm; gate, up and their product);
    * the output: 4 T (n_vocab + 2 n_embd) when the logits are computed on
      the GPU (output layer offloaded, or op offload of its matmul);
    * the KQ masks: 2 bytes x cells x T per cache (f16, flash attention);
    * op offload (T >= 32): matmuls of CPU layers run on the GPU with the
      weights copied in: the largest CPU layer's weights (and the CPU output
      weight) on top.

    The larger of the layer stage plus the masks and the output stage, plus
    the staging buffer, which lives outside ggml-alloc. The device's copies of
    the masks are freed after the last layer's attention, so the logits do
    not meet them (measured on an RPC device, which allocates as CUDA does:
    adding the masks to the output over-estimated the 8B shape's buffer by
    544 MiB at 128K cells and n_ubatch 2048). What the split adds:

    * the scheduler's staging buffer (patch 0018): two slots, each one split
      layer's host K and V (the largest), outside ggml-alloc -- the host heads
      are copied there one layer ahead -- or three while slots are small
      (patch 0042: two layers ahead; :func:`_staging`; with the joined K and V
      above: :func:`arena_estimate`);
    * in chunked mode (``s.attn_chunk``): the joined K and V, the staging slots
      and the f16 copies of a quantized K and V are one chunk's, not a whole
      layer's; every layer's attention holds two chunks' results (values and
      log-sum-exp, 4 T n_head (DV + 1)) and the values' scratch (4 T n_head
      DV); the chunks' masks are copied to the device once, as the mask is;
      where one chunk is a split layer's whole cache, its joined K (or V) is
      held twice, once with the spare row appended (:func:`_split_transient`);
    * a split layer's converted rows of the host heads, T rows of its host
      K and V, alive until the layer's host stores after its attention
      (patch 0024; written back from the device when streamed, patch 0023,
      and freed there for a batch, patch 0044): one layer's at a time, the
      largest, in the layer stage. Like the staging buffer, this assumes
      streaming (CUDA's default); without it the stores run at the end of the
      graph and every layer's rows wait for them.

    Not included:
    the CUDA context, cuBLAS workspaces and the CUDA memory pool (outside
    llama.cpp's buffers) -- pass a margin for those. Returns 0 when nothing
    runs on the GPU.
    """
    T = geo.n_tokens_reserve
    offload_ops = s.op_offload and T >= OP_OFFLOAD_MIN_BATCH
    if w.n_layer_gpu == 0 and not w.output_on_gpu and not offload_ops:
        return 0
    qk, qv = ggml_type(s.type_k), ggml_type(s.type_v)
    quantized = block_of(qk)[0] > 1 or block_of(qv)[0] > 1
    f32 = 4
    attn_act = ffn_act = 0
    for il in range(info.n_layer):
        nh, nkv = info.n_head[il], info.n_head_kv[il]
        hk, hv = info.head_k_of(il), info.head_v_of(il)
        attn_act = max(attn_act, f32 * T * (2 * info.n_embd + nh * hk + nkv * hk + nkv * hv + nh * hv))
        ffn_act = max(ffn_act, f32 * T * (3 * info.n_embd + 3 * info.n_ff[il]))
    ws = slot = rows = 0
    masks = {}
    for layer, g in zip(layers, resident):
        masks[layer.is_swa] = 2 * layer.cells * T
        if not (layer.on_device or offload_ops):
            continue
        cells = _attn_cells(s, layer)
        layer_slot, joined = _split_transient(s, layer, g)
        slot = max(slot, layer_slot)  # the staging slots hold the largest layer's host K+V
        lw = joined  # concat results
        if g < layer.n_head_kv:
            rows = max(rows, _host_row(s, layer, g) * T)  # converted rows waiting for the layer's host stores
        if quantized:
            k_elems = layer.n_head_kv * layer.head_k
            lw += 2 * (k_elems + layer.row_v) * cells  # f16 copies of K and V for flash attention
            if s.attn_chunk:
                # and K's own for the log-sum-exp pass (patch 0035), which a batch that takes its row sums from
                # CUDA's MMA kernel does without (0045; whether it does depends on the GPU's SMs: counted)
                lw += 2 * k_elems * cells
        if s.attn_chunk:
            nh = info.n_head[layer.il]
            lw += f32 * T * nh * (2 * (layer.head_v + 1) + layer.head_v)  # two chunks' results, the values' scratch
        ws = max(ws, lw)
    offload_w = w.host_layer_max if offload_ops and w.n_layer_gpu < info.n_layer else 0
    layer_stage = max(attn_act + ws, ffn_act) + offload_w
    output_stage = 0
    if w.output_on_gpu or offload_ops:
        output_stage = f32 * T * (info.n_vocab + 2 * info.n_embd) + (w.host_output if offload_ops else 0)
    staging = _staging(s, layers, resident, slot) if slot else 0
    return max(layer_stage + sum(masks.values()) + rows, output_stage) + staging
