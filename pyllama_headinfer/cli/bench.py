"""``python -m pyllama_headinfer bench``: sweep frac x depth x KV type, print a table.

    python -m pyllama_headinfer bench --model M.gguf [--fracs 1,0.75,0.5,0.25 | --vram-budget 24GiB] \\
        [--depths 4096,32768] [--types f16,q8_0] [-n 32] [--repeat 1] [--ngl 99] [--json out.json] [--plot out.png] \\
        [--headinfer-attn chunked [--headinfer-attn-chunk CELLS]]

For each point: prompt (prefill) and decode tokens/s, and the KV MiB in the
layers' own buffers (the GPU's when offloaded) and in the HeadInfer host halves
(see :mod:`pyllama_headinfer.bench`). With matplotlib installed, a plot of
decode tokens/s and device KV against the fraction is saved (``--plot``,
default ``bench-<model>.png``; ``--no-plot`` to skip). For llama.cpp's own
tool, ``build --tools`` gives ``llama-bench -hgf 1,0.5,...``. Exit status 1
when a point could not be measured, 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pyllama_headinfer.api.bench import run_sweep, sweep_points
from pyllama_headinfer.api.devices import list_devices
from pyllama_headinfer.api.model import Model
from pyllama_headinfer.errors import EXIT_FAILURE, EXIT_OK
from pyllama_headinfer.cli.options import add_headinfer_mode_arguments, add_threads_argument
from pyllama_headinfer.params import KV_CACHE_TYPES, ContextParams, check_headinfer_frac, parse_size
from pyllama_headinfer.vram.plan import plan_kv
from pyllama_headinfer.vram.speed import calibrate, exact, save_calibration

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_FRACS = "1,0.75,0.5,0.25"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, help="GGUF model file")
    headinfer = parser.add_mutually_exclusive_group()
    headinfer.add_argument("--fracs", default=None,
                           help="comma-separated HeadInfer fractions (default 1,0.75,0.5,0.25)")
    headinfer.add_argument("--vram-budget", default=None,
                           help="instead of --fracs: derive the fraction from this GPU memory budget at every depth")
    parser.add_argument("--depths", default="0,4096", help="comma-separated context depths (default 0,4096)")
    parser.add_argument("--types", "--kv-types", dest="types", default="f16",
                        help="comma-separated KV types, K:V for different ones, e.g. f16,q8_0,q8_0:f16 (default f16)")
    parser.add_argument("-n", "--n-gen", type=int, default=32, help="decoded tokens per measurement (default 32)")
    parser.add_argument("--repeat", "-r", type=int, default=1, help="measurements per point, averaged (default 1)")
    parser.add_argument("--batch", type=int, default=512, help="batch (= ubatch) size of the prefill (default 512)")
    add_headinfer_mode_arguments(parser)
    parser.add_argument("--ngl", "--n-gpu-layers", dest="ngl", type=int, default=99,
                        help="layers to offload to the GPU (default 99 = all)")
    add_threads_argument(parser)
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--plot", type=Path, default=None,
                        help="plot file (default bench-<model>.png; needs matplotlib)")
    parser.add_argument("--no-plot", action="store_true", help="do not plot")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the decode-speed constants of `plan` to this sweep and store them for this "
                             "device (sweep frac 1 at two or more depths per KV type, and a split point)")


def _list(text: str, convert, what: str) -> list:
    try:
        values = [convert(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"cannot read {what} {text!r}: expected a comma-separated list") from None
    if not values:
        raise ValueError(f"no {what} given")
    return values


def parse_kv_types(text: str) -> list[tuple[str, str]]:
    pairs = []
    for item in _list(text, str, "KV types"):
        k, _, v = item.partition(":")
        pair = (k.lower(), (v or k).lower())
        unknown = [t for t in pair if t not in KV_CACHE_TYPES]
        if unknown:
            raise ValueError(f"unknown KV type {unknown[0]!r}; known: {', '.join(sorted(KV_CACHE_TYPES))}")
        pairs.append(pair)
    return pairs


def _depth(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def format_table(results) -> str:
    header = ("frac", "depth", "KV", "prefill tok/s", "decode tok/s", "device KV MiB", "host KV MiB", "split layers")
    rows = [header]
    for r in results:
        if r.error is not None:
            rows.append((f"{r.frac:g}", str(r.point.depth), r.point.kv, "failed", "-", "-", "-", "-"))
            continue
        rows.append((f"{r.frac:g}", str(r.point.depth), r.point.kv,
                     "-" if r.prompt_tps is None else f"{r.prompt_tps:.1f}", f"{r.decode_tps:.2f}",
                     f"{r.device_kv_bytes / MIB:.1f}", f"{r.host_kv_bytes / MIB:.1f}",
                     f"{r.n_layers_split}/{r.n_layers}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_equal_vram_table(results) -> str:
    """The same points ordered by device KV, with exactness: what a byte of GPU memory buys."""
    ok = [r for r in results if r.error is None]
    if not ok:
        return ""
    lines = []
    for depth in sorted({r.point.depth for r in ok}):
        rs = [r for r in ok if r.point.depth == depth]
        ref = next((r.device_kv_bytes + r.host_kv_bytes for r in rs
                    if r.point.kv == "f16" and r.n_layers_split == 0), None)
        lines.append(f"at depth {depth}, by device KV" + ("" if ref else " (no f16 frac-1 point to compare with)") + ":")
        lines.append(f"  {'KV':>10} {'frac':>6} {'device KV MiB':>14} {'vs f16 whole':>12} {'exact':>5} "
                     f"{'decode tok/s':>12}")
        for r in sorted(rs, key=lambda r: (r.device_kv_bytes, -r.decode_tps)):
            ratio = f"{r.device_kv_bytes / ref:.2f}x" if ref else "-"
            lines.append(f"  {r.point.kv:>10} {r.frac:>6.3g} {r.device_kv_bytes / MIB:>14.1f} {ratio:>12} "
                         f"{'yes' if exact(r.point.type_k, r.point.type_v) else 'no':>5} {r.decode_tps:>12.2f}")
    return "\n".join(lines)


def calibration_points(results, weights_bytes: int) -> list[dict]:
    """bench results as the points :func:`pyllama_headinfer.vram.speed.calibrate` fits (KV bytes per token of context
    from the allocation and its size in cells)."""
    points = []
    for r in results:
        if r.error is not None:
            continue
        total = r.device_kv_bytes + r.host_kv_bytes
        n_ctx = r.n_ctx_cells or r.point.depth + 1
        points.append(dict(type_k=r.point.type_k, type_v=r.point.type_v, frac=r.frac, depth=r.point.depth,
                           decode_tok_s=r.decode_tps, weights_bytes=weights_bytes,
                           kv_bytes_per_token=total / n_ctx, host_kv_bytes_per_token=r.host_kv_bytes / n_ctx,
                           n_split_layers=r.n_layers_split))
    return points


def save_plot(results, path: Path, title: str) -> bool:
    """Decode tok/s and device KV MiB against the fraction, one line per (depth, KV type).
    False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict = {}
    for r in results:
        if r.error is None:
            series.setdefault((r.point.depth, r.point.kv), []).append(r)
    for (depth, kv), rs in series.items():
        rs = sorted(rs, key=lambda r: r.frac)
        label = f"depth {depth}, {kv}"
        ax_speed.plot([r.frac for r in rs], [r.decode_tps for r in rs], marker="o", label=label)
        ax_mem.plot([r.frac for r in rs], [r.device_kv_bytes / MIB for r in rs], marker="o", label=label)
    ax_speed.set(xlabel="headinfer_gpu_heads_frac", ylabel="decode tokens/s", title="decode speed")
    ax_mem.set(xlabel="headinfer_gpu_heads_frac", ylabel="device KV MiB", title="KV in device memory")
    for ax in (ax_speed, ax_mem):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def calibrate_from(args: argparse.Namespace, gguf, results) -> None:
    """``--calibrate``: fit the speed model's constants to these results and store them for this device."""
    gpus = [d for d in list_devices() if d.type != "cpu"]
    device = gpus[0].description if gpus else "CPU"
    weights = plan_kv(gguf, ContextParams(n_ctx=4096), n_gpu_layers=args.ngl).weights.device_alloc
    constants = calibrate(calibration_points(results, weights), device)
    path = save_calibration(constants)
    log.info("speed constants of %s stored in %s (plan and --vram-budget use them)", device, path)


def run(args: argparse.Namespace) -> int:
    fracs = [check_headinfer_frac(f) for f in _list(DEFAULT_FRACS if args.fracs is None else args.fracs, float,
                                                    "fractions")]
    depths = _list(args.depths, _depth, "depths")
    kv_types = parse_kv_types(args.types)
    if args.vram_budget is not None:
        parse_size(args.vram_budget)
    if args.n_gen < 1 or args.repeat < 1 or args.batch < 1:
        raise ValueError("-n, --repeat and --batch must be >= 1")

    # a bad chunk (not a multiple of 256, or given without chunks) is a ValueError naming it, before any model loads
    ContextParams(headinfer_attn=args.headinfer_attn, headinfer_attn_chunk=args.headinfer_attn_chunk)
    points = sweep_points(fracs, depths, kv_types, args.vram_budget, args.headinfer_attn, args.headinfer_attn_chunk)
    with Model(args.model, n_gpu_layers=args.ngl) as model:
        log.info("model: %s (%s), %d points, split layers attend %s", model.path.name, model.description,
                 len(points), "in chunks" if args.headinfer_attn == "chunked" else f"as {args.headinfer_attn!r}")
        results = run_sweep(model, points, n_gen=args.n_gen, n_batch=args.batch, repeat=args.repeat,
                            n_threads=args.threads,
                            progress=lambda i, n, r: log.info("[%d/%d] frac %g: decode %.2f tok/s", i, n,
                                                              r.frac, r.decode_tps))
        title = f"{model.path.name}: {model.description}"
        gguf = model.gguf  # for --calibrate: the file is not read again
    print(format_table(results))
    if len(kv_types) > 1 or len(fracs) > 1:
        print()
        print(format_equal_vram_table(results))
    if args.calibrate:
        calibrate_from(args, gguf, results)
    for r in results:
        if r.error is not None:
            print(f"not measured: depth {r.point.depth}, KV {r.point.kv}, frac {r.frac:g}: {r.error}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps([r.as_dict() for r in results], indent=1) + "\n")
        log.info("results written to %s", args.json)
    if not args.no_plot:
        path = args.plot or Path(f"bench-{Path(args.model).stem}.png")
        if save_plot(results, path, title):
            log.info("plot saved to %s", path)
        elif args.plot is not None:
            log.warning("no plot: matplotlib is not installed")
    return EXIT_FAILURE if any(r.error is not None for r in results) else EXIT_OK
