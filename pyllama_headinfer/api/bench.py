"""Speed and memory of the HeadInfer split: one sweep over frac x depth x KV type.

Each point of the sweep gets a fresh context on an already loaded model:

1. ``depth`` filler tokens are decoded (the prefill, timed: prompt tokens/s);
2. one token is decoded untimed (warm-up: graph allocation, CUDA graphs);
3. ``n_gen`` single-token decodes are timed (decode tokens/s), as
   llama-bench's ``tg`` test does after ``-d depth``;
4. the residency report gives the KV bytes in the layers' own (device)
   buffers and in the HeadInfer host halves, as llama.cpp allocated them.

Timings are wall-clock around ``llama_decode`` + ``llama_synchronize``; they
are for comparing configurations in one run on one machine, not for tests.
The command-line front end is :mod:`pyllama_headinfer.cli.bench`.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Callable, Iterable, Optional, Sequence

from pyllama_headinfer.api.context import Context
from pyllama_headinfer.api.residency import kv_residency_totals
from pyllama_headinfer.errors import HeadInferError
from pyllama_headinfer.params import ContextParams

log = logging.getLogger(__name__)

# Filler text for the depth: ordinary words, so any tokenizer yields plain (non-control) tokens.
FILLER_TEXT = ("The history of the city is written in its streets, its markets and its rivers; "
               "each generation adds a layer of stories, names and numbers to the ones before. ")


@dataclasses.dataclass(frozen=True)
class BenchPoint:
    """One configuration of the sweep: ``frac`` or ``vram_budget`` (the fraction
    derived from it), not both; neither is 1.0, HeadInfer off."""
    depth: int
    type_k: str = "f16"
    type_v: str = "f16"
    frac: Optional[float] = None
    vram_budget: Optional[str] = None
    headinfer_attn: str = "joined"  # how split layers attend (ContextParams.headinfer_attn)
    headinfer_attn_chunk: int = 0  # KV cells per chunk with headinfer_attn "chunked" (0: the model's default)

    @property
    def kv(self) -> str:
        return self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"


@dataclasses.dataclass
class BenchResult:
    point: BenchPoint
    frac: float  # the fraction the context used (from the budget, if one was given)
    prompt_tps: Optional[float]  # None at depth 0
    decode_tps: float
    decode_tps_runs: list
    device_kv_bytes: int  # KV in the layers' own buffers (the GPU's, when offloaded)
    host_kv_bytes: int  # KV in the HeadInfer host halves
    n_layers_split: int
    n_layers: int
    error: Optional[str] = None  # why this point could not be measured (e.g. out of device memory)
    n_ctx_cells: int = 0  # KV cells the context allocated (what the KV bytes are for)

    @classmethod
    def failed(cls, point: BenchPoint, error: str) -> "BenchResult":
        frac = float("nan") if point.vram_budget is not None else (1.0 if point.frac is None else point.frac)
        return cls(point=point, frac=frac, prompt_tps=None,
                   decode_tps=float("nan"), decode_tps_runs=[], device_kv_bytes=0, host_kv_bytes=0,
                   n_layers_split=0, n_layers=0, error=error)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(d.pop("point"))
        return d


def sweep_points(fracs: Sequence[float], depths: Sequence[int], kv_types: Sequence[tuple[str, str]],
                 vram_budget: Optional[str] = None, headinfer_attn: str = "joined",
                 headinfer_attn_chunk: int = 0) -> list[BenchPoint]:
    """frac x depth x KV type (or budget x depth x KV type), in that nesting order, all with one attention mode."""
    outer: Iterable = [None] if vram_budget is not None else fracs
    return [BenchPoint(depth=d, type_k=k, type_v=v, frac=f, vram_budget=vram_budget, headinfer_attn=headinfer_attn,
                       headinfer_attn_chunk=headinfer_attn_chunk)
            for (k, v) in kv_types for d in depths for f in outer]


def filler_tokens(model, n: int) -> list[int]:
    """n ordinary tokens of the model's vocabulary (the depth's content does not matter for speed)."""
    if n == 0:
        return []
    unit = model.tokenize(FILLER_TEXT, add_special=False)
    if not unit:
        raise ValueError("the model's tokenizer turns the filler text into no tokens")
    return (unit * (n // len(unit) + 1))[:n]


def _kv_bytes(report: Optional[dict]) -> tuple[int, int, int, int]:
    """(device bytes, host-half bytes, split layers, layers) of a residency report."""
    device, host = kv_residency_totals(report)
    layers = [] if report is None else report["layers"]
    n_split = sum(1 for x in layers if x["n_head_resident"] < x["n_head_kv"])
    return device, host, n_split, len(layers)


def run_point(model, point: BenchPoint, *, n_gen: int = 32, n_batch: int = 512, repeat: int = 1,
              n_threads: Optional[int] = None) -> BenchResult:
    """Measure one configuration (see the module docstring)."""
    if n_gen < 1 or repeat < 1:
        raise ValueError("n_gen and repeat must be >= 1")
    fill = filler_tokens(model, point.depth)
    token = filler_tokens(model, 1)[0]
    n_ctx = point.depth + (n_gen + 1) * repeat + 1
    prompt_tps = []
    decode_tps = []
    params = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads, flash_attn=True,
                           type_k=point.type_k, type_v=point.type_v, headinfer_gpu_heads_frac=point.frac,
                           headinfer_vram_budget=point.vram_budget, headinfer_attn=point.headinfer_attn,
                           headinfer_attn_chunk=point.headinfer_attn_chunk)
    with Context(model, params) as ctx:
        report = ctx.kv_residency()
        ctx.decode([token])  # warm-up, untimed: the first decode of a context allocates and builds its graphs
        ctx.synchronize()
        for _ in range(repeat):
            ctx.clear()
            if fill:
                t0 = time.perf_counter()
                ctx.decode(fill, logits="none")
                ctx.synchronize()
                prompt_tps.append(len(fill) / (time.perf_counter() - t0))
            ctx.decode([token])  # warm-up, untimed
            ctx.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_gen):
                ctx.decode([token])
            ctx.synchronize()
            decode_tps.append(n_gen / (time.perf_counter() - t0))
        frac = ctx.headinfer_gpu_heads_frac
        cells = ctx.n_ctx
    device, host, n_split, n_layers = _kv_bytes(report)
    return BenchResult(point=point, frac=frac, prompt_tps=statistics.mean(prompt_tps) if prompt_tps else None,
                       decode_tps=statistics.mean(decode_tps), decode_tps_runs=decode_tps,
                       device_kv_bytes=device, host_kv_bytes=host, n_layers_split=n_split, n_layers=n_layers,
                       n_ctx_cells=cells)


def run_sweep(model, points: Sequence[BenchPoint], *, progress: Optional[Callable[[int, int, BenchResult], None]] = None,
              **kwargs) -> list[BenchResult]:
    """run_point for every point, in order; ``progress(i, n, result)`` after each. A point that
    fails (llama.cpp cannot create the context, e.g. out of device memory) is recorded with its
    error and the sweep goes on: the other points are still measured."""
    results = []
    for i, point in enumerate(points, 1):
        log.info("[%d/%d] depth %d, KV %s, %s ...", i, len(points), point.depth, point.kv,
                 f"budget {point.vram_budget}" if point.vram_budget is not None
                 else f"frac {1.0 if point.frac is None else point.frac:g}")
        try:
            result = run_point(model, point, **kwargs)
        except HeadInferError as exc:
            log.warning("[%d/%d] not measured: %s", i, len(points), exc)
            result = BenchResult.failed(point, str(exc))
        results.append(result)
        if progress is not None:
            progress(i, len(points), result)
    return results
