#!/usr/bin/env python3
"""The tables of a GPU session's raw output (scripts/gpu_session.sh), computed rather than by hand.

    python scripts/gpu_tables.py perf fa_perf.txt --base pin --new new
        plain FLASH_ATTN_EXT perf, one variant against another: per case the best us/run of each
        (`test-backend-ops perf` sections headed "== VARIANT"), their ratio, and over the cases
        both have: the geometric mean, how many are within 3 % and 5 %, the extremes
    python scripts/gpu_tables.py decode decode.md --cell-bytes 131072 --link-gbs 54.92
        the decode table (llama-bench markdown sections headed "== VARIANT: ..."): per variant,
        depth and fraction the tok/s, its ratio to the overlapped ceiling and to the serial floor
        (docs/BENCHMARKS.md, "Method"), and the second variant's tok/s over the first's

--cell-bytes is the KV cache's bytes per cell over all layers (the 8B-shaped benchmark model with
an f16 cache: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes = 131072).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict

PERF_LINE = re.compile(r"^\s*(FLASH_ATTN_EXT\(.*?\)):\s+\d+ runs -\s+([\d.]+) us/run")
BENCH_ROW = re.compile(r"\|\s*([\d.]+)\s*\|\s*tg(\d+) @ d(\d+)\s*\|\s*([\d.]+) ± [\d.]+\s*\|\s*$")


def sections(lines):
    """(variant, lines) for each section headed "== VARIANT" or "== VARIANT: ..."."""
    name, body = None, []
    for line in lines:
        if line.startswith("== "):
            if name is not None:
                yield name, body
            name, body = line[3:].split(":")[0].strip(), []
        elif name is not None:
            body.append(line)
    if name is not None:
        yield name, body


def perf_cases(lines) -> dict[str, dict[str, float]]:
    """variant -> case -> best us/run over the variant's sections."""
    best: dict[str, dict[str, float]] = defaultdict(dict)
    for name, body in sections(lines):
        for line in body:
            m = PERF_LINE.match(line)
            if m:
                case, us = m.group(1), float(m.group(2))
                best[name][case] = min(us, best[name].get(case, math.inf))
    return best


def perf_summary(cases, base: str, new: str) -> dict:
    common = [c for c in cases.get(base, {}) if c in cases.get(new, {})]
    if not common:
        raise SystemExit(f"no case measured in both '{base}' and '{new}'")
    ratios = {c: cases[new][c] / cases[base][c] for c in common}
    values = list(ratios.values())
    return {
        "cases": len(values),
        "geomean": math.exp(sum(math.log(r) for r in values) / len(values)),
        # rounded: 19/20 is within 5 %, though 1 - 19/20 is a little above 0.05 in floating point
        "within_3": sum(round(abs(r - 1), 9) <= 0.03 for r in values),
        "within_5": sum(round(abs(r - 1), 9) <= 0.05 for r in values),
        "min": min(values),
        "max": max(values),
        "ratios": ratios,
    }


def decode_rows(lines) -> dict[str, dict[int, dict[float, float]]]:
    """variant -> depth -> fraction -> tok/s, from llama-bench's markdown (an -hgf column before the test)."""
    rows: dict[str, dict[int, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    for name, body in sections(lines):
        for line in body:
            m = BENCH_ROW.search(line)
            if m:
                rows[name][int(m.group(3))][float(m.group(1))] = float(m.group(4))
    return rows


def ceiling_and_floor(tok_s: float, full_tok_s: float, frac: float, depth: int, cell_bytes: int, link: float):
    """(of the overlapped ceiling, of the serial floor) for a fraction's decode rate."""
    t_gpu = 1.0 / full_tok_s
    t_link = (1.0 - frac) * depth * cell_bytes / link
    return tok_s * max(t_gpu, t_link), tok_s * (t_gpu + t_link)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="table", required=True)
    p = sub.add_parser("perf")
    p.add_argument("file")
    p.add_argument("--base", default="pin")
    p.add_argument("--new", default="new")
    p.add_argument("--cases", action="store_true", help="print every case's ratio")
    d = sub.add_parser("decode")
    d.add_argument("file")
    d.add_argument("--cell-bytes", type=int, required=True)
    d.add_argument("--link-gbs", type=float, required=True, help="the host-to-device copy rate, GB/s")
    args = ap.parse_args(argv)

    with open(args.file, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if args.table == "perf":
        s = perf_summary(perf_cases(lines), args.base, args.new)
        if args.cases:
            for case, r in s["ratios"].items():
                print(f"{r:6.3f}  {case}")
        print(f"{args.new} / {args.base}, us/run over {s['cases']} cases: geometric mean {s['geomean']:.3f}, "
              f"{s['within_3']} within 3 %, {s['within_5']} within 5 %, {s['min']:.3f} - {s['max']:.3f}")
        return 0

    rows = decode_rows(lines)
    if not rows:
        raise SystemExit(f"no llama-bench tg row in {args.file}")
    link = args.link_gbs * 1e9
    variants = list(rows)
    print(f"| variant | depth | frac 1.0 | fraction: tok/s (of the ceiling, of the floor) at {args.link_gbs} GB/s |")
    print("|---|---:|---:|---|")
    for v in variants:
        for depth, by_frac in sorted(rows[v].items()):
            full = by_frac.get(1.0)
            cells = []
            for frac in sorted((f for f in by_frac if f < 1.0), reverse=True):
                if full is None:
                    cells.append(f"{frac:g}: {by_frac[frac]:.2f}")
                    continue
                ceil, floor = ceiling_and_floor(by_frac[frac], full, frac, depth, args.cell_bytes, link)
                cells.append(f"{frac:g}: {by_frac[frac]:.2f} ({100 * ceil:.1f} %, {100 * floor:.0f} %)")
            print(f"| {v} | {depth} | {full if full is not None else '-'} | {'; '.join(cells)} |")
    if len(variants) == 2:
        a, b = variants
        print(f"\n{b} / {a}, tok/s:")
        for depth in sorted(set(rows[a]) & set(rows[b])):
            fracs = sorted(set(rows[a][depth]) & set(rows[b][depth]), reverse=True)
            print(f"  {depth}: " + ", ".join(f"f {f:g} {rows[b][depth][f] / rows[a][depth][f]:.3f}" for f in fracs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
