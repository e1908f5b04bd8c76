"""Plan before you load: choose the HeadInfer head fraction from a VRAM budget.

    from pyllama_headinfer.params import ContextParams
    from pyllama_headinfer.vram.plan import frac_for_budget, plan_kv

    params = ContextParams(n_ctx=32768, headinfer_vram_budget="24GiB")
    p = plan_kv("model.gguf", params, n_gpu_layers=99)
    print(p.format())          # the table: one row per g = 1 .. n_head_kv
    p.frac                     # headinfer_gpu_heads_frac for the largest g that fits
    frac_for_budget("model.gguf", params)   # the same, or an error saying what would fit

Everything is computed from the GGUF file's metadata and tensor index (read
by :mod:`pyllama_headinfer.vram.gguf`, which walks the mapped file; no weight
is read) and from
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
* the split (patch 0011, ``headinfer_n_head_resident``): an offloaded layer
  with a non-transposed V cache (flash attention), two or more KV heads and
  a head size that is a multiple of the KV types' block size keeps
  ``clamp(lround(f * n_head_kv), 1, n_head_kv - 1)`` heads for ``f < 1``;
  every other layer stays whole;
* bytes: ``ggml_row_size(type, heads * head_size) * cells * n_stream`` per K
  and per V tensor (``gguf.GGML_QUANT_SIZES``) -- what
  ``llama_memory_get_kv_buffers`` reports, byte for byte.

The device total adds the offloaded weights and a compute-buffer *estimate*
(see :func:`compute_estimate` and docs/PLAN.md for its basis and limits).

Where the code is (each name in one module; import it from there):

* :mod:`.plan` (this module) -- :func:`plan_kv`, :func:`frac_for_budget`,
  :func:`plan_for_context`, :class:`Plan` (its table, its choice, the error
  when nothing fits and what would), :class:`Row`, :func:`frac_for_g`,
  :func:`force_split_from_env`;
* :mod:`.model` -- the model: :class:`~.model.ModelInfo`,
  :func:`~.model.read_model_info` (per-layer metadata, the SWA pattern),
  ``SUPPORTED_ARCHS``;
* :mod:`.memory` -- the bytes: :class:`~.memory.Settings` (a
  :class:`~pyllama_headinfer.params.ContextParams` resolved to llama.cpp's
  defaults) -> :func:`~.memory.geometry`, :func:`~.memory.kv_layers`,
  :func:`~.memory.n_resident`, :func:`~.memory.weights`,
  :func:`~.memory.compute_estimate`, llama.cpp's constants;
* :mod:`.gguf` -- the GGUF reader (shared with the pre-flight ``check_gguf``);
* :mod:`pyllama_headinfer.params` -- the context's parameters, the KV
  types, :func:`~pyllama_headinfer.params.parse_size`;
* :mod:`pyllama_headinfer.errors` -- :class:`PlanError` and its subclasses.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from pyllama_headinfer.params import ContextParams, format_bytes, parse_size
from pyllama_headinfer.vram.gguf import GGUFFile
from pyllama_headinfer.vram.memory import (FORCE_SPLIT_ENV, PAD_CTX, Geometry, KVLayer, Settings, Weights,
                                           arena_estimate, block_of, compute_estimate, cuda_alloc_size, default_attn_chunk,
                                           geometry, ggml_type, gpu_layer_start, kv_layers, n_resident, row_size,
                                           weights)
from pyllama_headinfer.errors import BudgetTooSmallError, NothingFitsError, PlanError, UnsupportedModelError
from pyllama_headinfer.vram.model import ModelInfo, read_model_info

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
    arena: int  # of compute: what streaming the host heads adds (memory.arena_estimate; fixed in chunked mode)
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
                     f"n_ubatch {geo.n_ubatch}, flash attention {'on' if s.flash_attn else 'off'}"
                     + (f", attention in chunks of {s.attn_chunk} cells" if s.attn_chunk else ""))
        start = gpu_layer_start(i, s.n_gpu_layers)
        where = "none" if w.n_layer_gpu == 0 else f"layers {start}-{i.n_layer - 1}"
        lines.append(f"offload: n_gpu_layers {s.n_gpu_layers} -> {where} ({w.n_layer_gpu} of {i.n_layer})"
                     f"{' + output' if w.output_on_gpu else ''} on the GPU; weights on the GPU "
                     f"{fb(w.device_alloc)}, in host memory {fb(w.host)}")
        if self.budget is not None:
            lines.append(f"budget: {fb(self.budget)}" + (f" (margin {fb(self.margin)})" if self.margin else ""))
        lines.append("")
        head = f"{'g':>3} {'frac':>6} {'split':>7} {'device KV':>12} {'host KV':>12} {'compute*':>11} " \
               f"{'(arena)':>10} {'device total':>13}  fits"
        lines.append(head)
        for r in self.rows:
            fits = "-" if r.fits is None else ("yes" if r.fits else "no")
            mark = "  <- chosen" if self.chosen is not None and r.g == self.chosen.g else ""
            lines.append(f"{r.g:>3} {r.frac:>6.3f} {f'{r.n_split}/{len(self.layers)}':>7} {fb(r.device_kv):>12} "
                         f"{fb(r.host_kv):>12} {fb(r.compute):>11} {fb(r.arena):>10} {fb(r.device_total):>13}  "
                         f"{fits}{mark}")
        lines.append("* compute: an estimate of llama.cpp's GPU compute buffer (docs/PLAN.md); (arena): the part of it "
                     "that streams the host heads (staging slots and joined K/V: a layer's, or a chunk's in chunked "
                     "mode); device total = weights + KV + compute, as CUDA allocates them; the CUDA context itself "
                     "is not included")
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
    qk, qv = ggml_type(s.type_k), ggml_type(s.type_v)
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
               device_kv_alloc=dalloc, compute=compute, arena=arena_estimate(s, layers, res), device_total=total,
               fits=fits,
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
    """What would fit when nothing does: attention in chunks (its device memory for the host heads does
    not grow with the context), fewer GPU layers, a quantized KV type, a shorter context."""
    info, s, budget, margin = plan.info, plan.settings, plan.budget, plan.margin
    out = []

    def best(p: Plan) -> str:
        r = p.chosen
        return f"g = {r.g} of {p.n_head_kv}, frac {r.frac:.6g}, device total {format_bytes(r.device_total)}"

    if not s.attn_chunk and s.flash_attn:
        p = _compute(info, replace(s, attn_chunk=default_attn_chunk(info)), budget, margin)
        if p.chosen is not None:
            out.append(f"attention in chunks: headinfer_attn = 'chunked' ({best(p)}; another float order than "
                       "one attention per layer, the same at every fraction)")

    ngl = info.n_layer + 1 if s.n_gpu_layers < 0 else min(s.n_gpu_layers, info.n_layer + 1)
    for k in range(ngl - 1, -1, -1):
        p = _compute(info, replace(s, n_gpu_layers=k), budget, margin)
        if p.chosen is not None:
            if k > 0:  # with no GPU layer at all there is nothing to plan
                out.append(f"fewer GPU layers: n_gpu_layers {k} ({best(p)})")
            break
    def bytes_per_value(t: str) -> float:
        block, size = block_of(ggml_type(t))
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


def plan_kv(model: str | os.PathLike | GGUFFile | ModelInfo, params: ContextParams, *, n_gpu_layers: int = -1,
            force_split: bool = False, margin=0, op_offload: bool = True) -> Plan:
    """Plan the KV cache of ``model`` (a GGUF path, a :class:`GGUFFile` already
    read, or a :class:`ModelInfo`) for a context with ``params``: one
    :class:`Row` per g = 1 .. n_head_kv, and with
    ``params.headinfer_vram_budget`` the largest g whose estimated device total
    plus ``margin`` fits (``Plan.chosen``; ``Plan.frac``).

    ``n_gpu_layers`` is the model's (-1 = all); ``force_split`` plans as
    ``LLAMA_HEADINFER_FORCE_SPLIT=1`` runs (layers in host memory split too).
    When nothing fits, ``Plan.chosen`` is None and ``Plan.suggestions`` says
    what would fit."""
    info = model if isinstance(model, ModelInfo) else read_model_info(model)
    if not isinstance(params, ContextParams):
        raise TypeError(f"params must be a ContextParams, got {type(params).__name__}")
    if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, (int, np.integer)):
        raise ValueError(f"n_gpu_layers must be an int, got {n_gpu_layers!r}")
    s = Settings.from_params(params, info, n_gpu_layers=int(n_gpu_layers), force_split=bool(force_split),
                             op_offload=bool(op_offload))
    budget = params.vram_budget_bytes
    margin = 0 if not margin else parse_size(margin)
    plan = _compute(info, s, budget, margin)
    if budget is not None and plan.chosen is None:
        plan.suggestions = _suggest(plan)
    return plan


def frac_for_budget(model: str | os.PathLike | GGUFFile | ModelInfo, params: ContextParams, **kwargs) -> float:
    """``headinfer_gpu_heads_frac`` for the largest g that fits
    ``params.headinfer_vram_budget`` (1.0 when everything fits unsplit).
    Raises BudgetTooSmallError when the offloaded weights alone exceed the
    budget, NothingFitsError when no g fits; both say what would. Keyword
    arguments as :func:`plan_kv`."""
    if params.headinfer_vram_budget is None:
        raise ValueError("frac_for_budget needs params with a headinfer_vram_budget")
    return plan_kv(model, params, **kwargs).frac


def planned_gpu_layers(n_gpu_layers: int, gpu_offload: bool) -> int:
    """The layers a context's plan counts on the device: the model's, or on a build without GPU offload every layer
    (what LLAMA_HEADINFER_FORCE_SPLIT=1 splits there, the layers' own buffers standing for the device)."""
    return n_gpu_layers if gpu_offload else -1


def plan_for_context(model: str | os.PathLike | GGUFFile | ModelInfo, params: ContextParams, *,
                     n_gpu_layers: int, gpu_offload: bool) -> Plan | None:
    """The plan behind a context created with ``params.headinfer_vram_budget``:
    the context's parameters and where its model's layers are.

    On a build without GPU offload nothing is on a device: with
    LLAMA_HEADINFER_FORCE_SPLIT=1, which makes llama.cpp split every layer as
    if it were offloaded, it plans as if every layer were (the layers' own
    buffers stand for the device); without it there is nothing to budget and
    this returns None. Raises like :func:`frac_for_budget` when nothing fits."""
    force = force_split_from_env()
    if not gpu_offload and not force:
        return None
    p = plan_kv(model, params, n_gpu_layers=planned_gpu_layers(n_gpu_layers, gpu_offload), force_split=force)
    emulated = "" if gpu_offload else \
        f" (a build without GPU offload under {FORCE_SPLIT_ENV}=1: planned as if every layer were offloaded)"
    if emulated:
        p.notes.append(emulated.strip(" ()"))
    if p.chosen is None:
        err = p.error()
        raise type(err)(str(err) + emulated)
    return p


# headinfer_vram_budget="auto": what llama.cpp's --fit leaves free on each device by default (fit_params_target)
AUTO_VRAM_BUDGET_MARGIN = 1 << 30


def auto_vram_budget(model: str | os.PathLike | GGUFFile | ModelInfo, n_gpu_layers: int, free_bytes: int,
                     n_devices: int, *, gpu_offload: bool) -> int:
    """``headinfer_vram_budget="auto"`` in bytes: ``free_bytes``, the free memory of ``n_devices`` devices measured with
    the model's weights on them already, less llama.cpp's 1 GiB ``--fit`` margin per device, plus those weights as the
    plan counts them (:func:`planned_gpu_layers`; the budget is a device total: weights + KV + compute). At least 1
    byte: a budget the weights exceed is refused by the plan with its advice."""
    info = model if isinstance(model, ModelInfo) else read_model_info(model)
    on_device = weights(info, planned_gpu_layers(n_gpu_layers, gpu_offload)).device_alloc
    return max(1, int(free_bytes) + on_device - AUTO_VRAM_BUDGET_MARGIN * int(n_devices))


def force_split_from_env(environ=os.environ) -> bool:
    """Whether LLAMA_HEADINFER_FORCE_SPLIT is on, read as llama.cpp reads it (atoi != 0)."""
    v = environ.get(FORCE_SPLIT_ENV)
    if not v:
        return False
    m = re.match(r"\s*[+-]?\d+", v)
    return bool(m and int(m.group(0)) != 0)

