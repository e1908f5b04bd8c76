"""Which configuration fits fastest: KV cache type x HeadInfer fraction,
ranked by a decode-speed model (issue 17; docs/BENCHMARKS.md, "Which knob
first").

Splitting the KV heads and quantizing the KV cache both shrink the device's
share of the cache; they cost very different amounts of time. Per decoded
token, with the context filled to ``depth`` tokens::

    t_gpu   = weights_on_device / weights_rate
              + kv_fixed[type] + kv_bytes(depth) / kv_rate[type]      all heads are attended on the GPU
    t_link  = host_kv_bytes(depth) / link_rate                        the host heads cross the link
    t_join  = split_kv_bytes(depth) * reassembly_s_per_byte           joining the halves on the device
    t_steps = n_split_layers * split_layer_s                          the split's fixed cost per step
    t       = max(t_gpu + t_join, t_link) + t_steps   (``overlapped``: the scheduler streams the host heads
                                                       one layer ahead while the GPU computes, patch 0018)
            = t_gpu + t_join + t_link + t_steps       (copies one after the other, e.g. GGML_SCHED_STREAM=0)

An unquantized cache (f16, bf16, f32) gives the same results whatever the
fraction: those options are *exact*; q8_0/q4_0 change the numbers.

The rates are a machine's: :data:`H200_DEFAULTS` were measured on an H200
(PCIe Gen5 x16) with the 8B-shaped Q4_K_M model of ``scripts/make_bench_model.py``
(commands in docs/BENCHMARKS.md). ``bench --calibrate`` measures them on
your GPU and stores them (:func:`save_calibration`); :func:`load_calibration`
picks them up, else the defaults are used and the output says so.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional, Sequence

from pyllama_headinfer import paths
from pyllama_headinfer.params import ContextParams, format_bytes
from pyllama_headinfer.vram.model import ModelInfo, read_model_info
from pyllama_headinfer.vram.plan import plan_kv

GB = 1e9
EXACT_TYPES = frozenset({"f32", "f16", "bf16"})
CANDIDATE_TYPES = ("f16", "q8_0", "q4_0")


@dataclass(frozen=True)
class SpeedConstants:
    """A machine's decode-speed constants (rates in bytes/s, times in s)."""
    device: str
    weights_rate: float  # weight bytes read per second in a decode step
    kv_rate: dict  # KV type -> KV bytes attended per second
    kv_fixed: dict  # KV type -> fixed seconds per token of that type's attention kernels
    link_rate: float  # host -> device bytes per second (pinned memory)
    split_layer_s: float  # per split layer and step: the split's fixed cost (scheduler transitions, events)
    reassembly_s_per_byte: float  # per byte of a split layer's K+V: joining the halves on the device
    overlapped: bool = False  # the host heads' copy overlaps compute (the scheduler streams them, patch 0018)
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SpeedConstants":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# Measured on the H200 (docs/BENCHMARKS.md, FACTS.md), 8B-shaped Q4_K_M (4.58 GiB of weights),
# llama-bench -fa 1 -ngl 99, tg32: frac 1.0 f16 277.7/245.3/186.6/92.0 tok/s at 0/8K/32K/128K,
# q8_0 252.1/201.4/125.2/49.6; q4_0 119.3 at 32K (its fixed cost assumed equal to q8_0's);
# reassembly ~0.7 ms per GiB (series at 255b680). With the host heads streamed (patch 0018): f16 at
# 8K/32K/128K, f = 0.75/0.5/0.25, all within 3 % of max(t_gpu + t_join, t_link) + 1.5 ms with the link
# at 54 GB/s (2.5 % under the 55.4 GB/s of one large pinned copy).
H200_DEFAULTS = SpeedConstants(
    device="NVIDIA H200 (defaults)",
    weights_rate=4.918e9 / 3.601e-3,
    kv_rate={"f16": 2.36e12, "bf16": 2.36e12, "f32": 2.36e12, "q8_0": 0.564e12, "q4_0": 0.274e12},
    kv_fixed={"f16": 0.0, "bf16": 0.0, "f32": 0.0, "q8_0": 0.366e-3, "q4_0": 0.366e-3},
    link_rate=54.0 * GB,
    split_layer_s=1.5e-3 / 32,
    reassembly_s_per_byte=0.7e-3 / 2**30,
    overlapped=True,
    source="defaults measured on an NVIDIA H200 (PCIe Gen5 x16); run `bench --calibrate` on your GPU",
)


def exact(type_k: str, type_v: str) -> bool:
    """Whether a cache of these types gives the same results as the unsplit f16/bf16/f32 cache would."""
    return type_k in EXACT_TYPES and type_v in EXACT_TYPES


def _rate(table: dict, type_name: str, what: str) -> float:
    if type_name in table:
        return table[type_name]
    raise ValueError(f"no {what} for KV type {type_name!r} in these speed constants (known: {sorted(table)})")


def predict_step_s(c: SpeedConstants, *, weights_bytes: int, type_k: str, type_v: str, kv_bytes_k: float,
                   kv_bytes_v: float, host_kv_bytes: float, n_split_layers: int, split_kv_bytes: float) -> float:
    """Seconds per decoded token (see the module docstring); KV bytes at the depth of interest."""
    t_gpu = (weights_bytes / c.weights_rate
             + max(_rate(c.kv_fixed, type_k, "kv_fixed"), _rate(c.kv_fixed, type_v, "kv_fixed"))
             + kv_bytes_k / _rate(c.kv_rate, type_k, "kv_rate") + kv_bytes_v / _rate(c.kv_rate, type_v, "kv_rate"))
    t_link = host_kv_bytes / c.link_rate
    t_join = split_kv_bytes * c.reassembly_s_per_byte if host_kv_bytes else 0.0
    t_steps = n_split_layers * c.split_layer_s if host_kv_bytes else 0.0
    return (max(t_gpu + t_join, t_link) if c.overlapped else t_gpu + t_join + t_link) + t_steps


def plan_cells(plan) -> int:
    """KV cells a plan allocates (all streams): the context its KV bytes are for."""
    return max(1, plan.geometry.n_ctx_seq * plan.geometry.n_stream)


def predict_row_step_s(c: SpeedConstants, plan, row, filled: float) -> float:
    """:func:`predict_step_s` for one row of a :class:`~pyllama_headinfer.vram.plan.Plan`
    with ``filled`` tokens of context in the cache (the row's KV bytes scaled to them)."""
    scale = filled / plan_cells(plan)
    host = (row.host_half_k + row.host_half_v) * scale
    n = len(plan.rows)
    # the split layers' whole K+V (resident + host heads): what joining the halves touches
    split_full = host * n / (n - row.g) if row.n_split and row.g < n else 0.0
    return predict_step_s(c, weights_bytes=plan.weights.device_alloc, type_k=plan.settings.type_k,
                          type_v=plan.settings.type_v, kv_bytes_k=(row.resident_k + row.host_half_k) * scale,
                          kv_bytes_v=(row.resident_v + row.host_half_v) * scale, host_kv_bytes=host,
                          n_split_layers=row.n_split, split_kv_bytes=split_full)


# --------------------------------------------------------------------------
# ranking the options of a plan


@dataclass
class Option:
    type_k: str
    type_v: str
    frac: float
    g: int
    n_head_kv: int
    device_bytes: int  # weights + KV + compute on the device, as the plan predicts (compared with the budget)
    device_kv: int
    host_kv: int
    fits: bool
    exact: bool
    predicted_decode_tok_s: float
    command: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Ranking:
    options: list  # every candidate, fitting or not, fastest first
    constants: SpeedConstants
    depth: int
    budget: Optional[int]
    notes: list = field(default_factory=list)

    @property
    def fitting(self) -> list:
        return [o for o in self.options if o.fits]

    @property
    def fastest(self) -> Optional[Option]:
        return next(iter(self.fitting), None)

    @property
    def fastest_exact(self) -> Optional[Option]:
        return next((o for o in self.fitting if o.exact), None)

    def choose(self, allow_quantized: bool) -> Optional[Option]:
        """What a tool picks for the user: the fastest exact option, or the fastest of all
        when quantized caches are allowed; None when nothing fits."""
        return self.fastest if allow_quantized else self.fastest_exact

    def faster_alternative(self, pick: Optional[Option]) -> str:
        """A phrase naming the fastest option when it is not ``pick`` (else "")."""
        best = self.fastest
        if best is None or best is pick:
            return ""
        return (f"fastest overall: K/V {best.type_k} at frac {best.frac:.6g} ({best.predicted_decode_tok_s:.1f} "
                "tok/s predicted, not exact: --allow-quantized-kv)")

    def to_dict(self) -> dict:
        return {"depth": self.depth, "budget": self.budget, "speed_constants": self.constants.to_dict(),
                "options": [o.to_dict() for o in self.options],
                "fastest": None if self.fastest is None else self.fastest.to_dict(),
                "fastest_exact": None if self.fastest_exact is None else self.fastest_exact.to_dict(),
                "notes": list(self.notes)}

    def format(self) -> str:
        lines = [f"options at depth {self.depth} (decode speed: {self.constants.source}):",
                 f"{'K':>5} {'V':>5} {'frac':>6} {'device total':>13} {'device KV':>11} {'host KV':>11} "
                 f"{'exact':>5} {'pred. tok/s':>11}  fits"]
        for o in self.options:
            lines.append(f"{o.type_k:>5} {o.type_v:>5} {o.frac:>6.3f} {format_bytes(o.device_bytes):>13} "
                         f"{format_bytes(o.device_kv):>11} {format_bytes(o.host_kv):>11} "
                         f"{'yes' if o.exact else 'no':>5} {o.predicted_decode_tok_s:>11.1f}  "
                         f"{'yes' if o.fits else 'no'}")
        lines.append("")
        for label, o in (("fastest overall", self.fastest), ("fastest exact", self.fastest_exact)):
            if o is None:
                lines.append(f"{label}: nothing fits")
            else:
                lines.append(f"{label}: K {o.type_k} / V {o.type_v}, frac {o.frac:.6g} "
                             f"({o.predicted_decode_tok_s:.1f} tok/s predicted, device {format_bytes(o.device_bytes)})"
                             + (f"\n    {o.command}" if o.command else ""))
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def rank_options(model, params: ContextParams, *, types: Sequence[str] = CANDIDATE_TYPES,
                 depth: Optional[int] = None, constants: Optional[SpeedConstants] = None,
                 command_prefix: str = "", **plan_options) -> Ranking:
    """Every KV type (K = V) x fraction for ``model`` with the context
    ``params`` (their KV types replaced by each candidate; the budget is
    ``params.headinfer_vram_budget``), fastest first.

    ``depth``: the filled context the speed is predicted at (default: the
    whole context, the slowest point). Other keyword arguments
    (``n_gpu_layers``, ``force_split``, ``margin``) go to
    :func:`pyllama_headinfer.vram.plan.plan_kv`.
    """
    info = model if isinstance(model, ModelInfo) else read_model_info(model)
    c = constants or load_calibration()
    budget = params.vram_budget_bytes
    params = params.replace(headinfer_gpu_heads_frac=None)  # the ranking tries every fraction
    options = []
    notes = []
    for t in dict.fromkeys(types):
        plan = plan_kv(info, params.replace(type_k=t, type_v=t), **plan_options)
        cells = plan_cells(plan)
        d = cells if depth is None else min(int(depth), cells)
        for r in plan.rows:
            try:
                t_step = predict_row_step_s(c, plan, r, d)
            except ValueError as exc:
                notes.append(str(exc))
                break
            fits = True if budget is None else bool(r.fits)
            cmd = (f"{command_prefix} --cache-type-k {t} --cache-type-v {t} --frac {r.frac:.6g}".strip()
                   if command_prefix else "")
            options.append(Option(type_k=t, type_v=t, frac=r.frac, g=r.g, n_head_kv=len(plan.rows),
                                  device_bytes=r.device_total, device_kv=r.device_kv, host_kv=r.host_kv,
                                  fits=fits, exact=exact(t, t), predicted_decode_tok_s=1.0 / t_step, command=cmd))
    options.sort(key=lambda o: (not o.fits, -o.predicted_decode_tok_s))
    if c.source.startswith("defaults"):
        notes.append("speeds use the H200 defaults; `python -m pyllama_headinfer bench --calibrate` measures "
                     "your GPU")
    return Ranking(options=options, constants=c, depth=(cells if depth is None else d), budget=budget, notes=notes)


# --------------------------------------------------------------------------
# calibration files


CALIBRATION_DIR = "speed"  # in the cache


def calibration_dir() -> Path:
    return paths.cache_dir() / CALIBRATION_DIR


def _slug(device: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device).strip("_") or "device"


def save_calibration(c: SpeedConstants, directory: Optional[Path] = None) -> Path:
    if directory is None:
        directory = paths.writable_cache_dir(CALIBRATION_DIR)
    else:
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{_slug(c.device)}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(c.to_dict(), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def load_calibration(device: Optional[str] = None, directory: Optional[Path] = None) -> SpeedConstants:
    """The stored constants of ``device`` (or the only stored ones), else :data:`H200_DEFAULTS`."""
    directory = directory or calibration_dir()
    files = sorted(directory.glob("*.json")) if directory.is_dir() else []
    if device is not None:
        files = [f for f in files if f.stem == _slug(device)]
    if len(files) != 1:
        return H200_DEFAULTS
    try:
        return SpeedConstants.from_dict(json.loads(files[0].read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return H200_DEFAULTS


def calibrate(points: Iterable[dict], device: str, base: SpeedConstants = H200_DEFAULTS) -> SpeedConstants:
    """Constants fitted to ``bench`` results.

    ``points``: dicts with ``type_k``, ``type_v``, ``frac``, ``depth``, ``decode_tok_s``,
    ``weights_bytes``, ``kv_bytes_per_token`` (K+V of one token, all heads), ``host_kv_bytes_per_token`` and
    ``n_split_layers``. Frac-1.0 points at two or more depths of one type give that type's KV rate and fixed
    cost (the smallest type's depth-0 point gives the weights rate); split points give the link rate, with
    this series' split overheads of ``base``. What cannot be fitted keeps ``base``'s value.
    """
    pts = [p for p in points if p.get("decode_tok_s")]
    weights_rate, kv_rate, kv_fixed = base.weights_rate, dict(base.kv_rate), dict(base.kv_fixed)
    by_type: dict = {}
    for p in pts:
        if p["frac"] >= 1.0 and p["type_k"] == p["type_v"]:
            by_type.setdefault(p["type_k"], []).append(p)
    zero_f16 = [p for p in by_type.get("f16", []) if p["depth"] == 0]
    if zero_f16:
        p = zero_f16[0]
        weights_rate = p["weights_bytes"] * p["decode_tok_s"]
    for t, ps in by_type.items():
        ps = sorted(ps, key=lambda p: p["depth"])
        if len(ps) >= 2 and ps[-1]["depth"] > ps[0]["depth"]:
            t0, t1 = 1 / ps[0]["decode_tok_s"], 1 / ps[-1]["decode_tok_s"]
            b0 = ps[0]["depth"] * ps[0]["kv_bytes_per_token"]
            b1 = ps[-1]["depth"] * ps[-1]["kv_bytes_per_token"]
            if t1 > t0 and b1 > b0:
                kv_rate[t] = (b1 - b0) / (t1 - t0)
                w = ps[0]["weights_bytes"] / weights_rate
                kv_fixed[t] = max(0.0, t0 - w - b0 / kv_rate[t])
    c = replace(base, device=device, weights_rate=weights_rate, kv_rate=kv_rate, kv_fixed=kv_fixed,
                source=f"calibrated with bench on {device}")
    links = []
    for p in pts:
        if p["frac"] < 1.0 and p.get("host_kv_bytes_per_token") and p["depth"] > 0:
            host = p["depth"] * p["host_kv_bytes_per_token"]
            kv = p["depth"] * p["kv_bytes_per_token"]
            try:
                t_gpu = predict_step_s(c, weights_bytes=p["weights_bytes"], type_k=p["type_k"], type_v=p["type_v"],
                                       kv_bytes_k=kv / 2, kv_bytes_v=kv / 2, host_kv_bytes=0, n_split_layers=0,
                                       split_kv_bytes=0)
            except ValueError:
                continue
            t_join = kv * c.reassembly_s_per_byte
            t_rest = 1 / p["decode_tok_s"] - p["n_split_layers"] * c.split_layer_s
            if c.overlapped:
                # only a step bound by the link says how fast the link is
                if t_rest > t_gpu + t_join:
                    links.append(host / t_rest)
            elif t_rest - t_gpu - t_join > 0:
                links.append(host / (t_rest - t_gpu - t_join))
    if links:
        c = replace(c, link_rate=sorted(links)[len(links) // 2])
    if not all(math.isfinite(v) and v > 0 for v in (c.weights_rate, c.link_rate, *c.kv_rate.values())):
        raise ValueError("the bench results give no usable speed constants (non-positive rates)")
    return c
