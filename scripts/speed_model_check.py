#!/usr/bin/env python3
"""Predicted vs measured decode speed: the model behind `plan`'s ranking
(pyllama_headinfer/vram/speed.py) against llama-bench rows.

    llama-bench -m b8.gguf -ngl 99 -fa 1 -ctk f16 -ctv f16 -hgf 1,0.5 -d 32768 -p 0 -n 32 -o json > f16.json
    python scripts/speed_model_check.py --model b8.gguf f16.json q8_0.json ... [--markdown]

For every tg row (n_gen > 0, n_prompt == 0) of the llama-bench JSON files:
the configuration (K/V type, -hgf, depth), the device KV share, exactness,
the measured tok/s, the prediction of plan_speed with the constants in use
(stored calibration, else the H200 defaults) and the relative error.
Exit status 1 when a row is off by more than --tolerance (default 15 %).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pyllama_headinfer.params import ContextParams  # noqa: E402
from pyllama_headinfer.vram.plan import plan_kv  # noqa: E402
from pyllama_headinfer.vram.speed import exact, load_calibration, predict_row_step_s  # noqa: E402


def rows_of(paths):
    for path in paths:
        text = Path(path).read_text()
        for row in json.loads(text[text.index("["):]):
            if row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
                yield row


def predict(model: str, row: dict, constants) -> tuple[float, float]:
    """(predicted tok/s, device share of the KV) for one llama-bench row."""
    depth, n_gen = int(row["n_depth"]), int(row["n_gen"])
    t = (row["type_k"], row["type_v"])
    frac = float(row.get("headinfer_gpu_heads_frac", 1.0))
    params = ContextParams(n_ctx=depth + n_gen, type_k=t[0], type_v=t[1], n_batch=int(row.get("n_batch", 2048)),
                           n_ubatch=int(row.get("n_ubatch", 512)))
    p = plan_kv(model, params, n_gpu_layers=int(row.get("n_gpu_layers", 99)))
    r = p.row_for_frac(frac)
    step = predict_row_step_s(constants, p, r, depth + n_gen / 2)  # the average context during the n_gen tokens
    total = r.resident_k + r.resident_v + r.host_half_k + r.host_half_v
    return 1.0 / step, (r.device_kv / total if total else 1.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF llama-bench ran")
    ap.add_argument("--tolerance", type=float, default=0.15)
    ap.add_argument("--device", default=None, help="stored calibration to use (default: the only one / H200)")
    ap.add_argument("files", nargs="+", help="llama-bench -o json outputs")
    args = ap.parse_args(argv)
    constants = load_calibration(args.device)
    print(f"speed constants: {constants.source}")
    print("| K/V | frac | depth | device KV share | exact | measured tok/s | predicted tok/s | error |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for row in sorted(rows_of(args.files), key=lambda r: (r["n_depth"], r["type_k"],
                                                          -float(r.get("headinfer_gpu_heads_frac", 1.0)))):
        predicted, share = predict(args.model, row, constants)
        measured = float(row["avg_ts"])
        err = predicted / measured - 1
        worst = max(worst, abs(err))
        t = row["type_k"] if row["type_k"] == row["type_v"] else f"{row['type_k']}/{row['type_v']}"
        print(f"| {t} | {float(row.get('headinfer_gpu_heads_frac', 1.0)):g} | {row['n_depth']} | {share:.2f} | "
              f"{'yes' if exact(row['type_k'], row['type_v']) else 'no'} | {measured:.2f} | {predicted:.2f} | "
              f"{err:+.1%} |")
    print(f"\nlargest error: {worst:.1%} (tolerance {args.tolerance:.0%})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    raise SystemExit(main())
