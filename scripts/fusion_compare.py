#!/usr/bin/env python3
"""Does CUDA's kernel fusion change the logits, split or not?

    python scripts/fusion_compare.py [--model tm/llama-gqa.gguf] [--frac 0.5] [--type f16]

Decodes the same 40-token prompt four times, each in a fresh process (ggml-cuda
reads GGML_CUDA_DISABLE_FUSION once): frac 1.0 and the given frac, each with
fusion on and off, and prints which of the four last-token logits vectors are
bit-identical. On the H200 (docs/GPU.md) the split matched upstream's unfused
computation exactly, and only upstream's fused graph differed.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys
import numpy as np
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
from pyllama_headinfer.llama import Context, Model
from testing_models import CORPUS
model_path, frac, kv, out = sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5]
with Model(model_path, n_gpu_layers=99) as model:
    prompt = model.tokenize(CORPUS)[:40]
    with Context(model, n_ctx=256, flash_attn=True, type_k=kv, type_v=kv, headinfer_gpu_heads_frac=frac) as ctx:
        ctx.decode(prompt)
        np.save(out, ctx.logits(-1))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF model (default: the llama-gqa test model, written to a temp dir)")
    ap.add_argument("--frac", type=float, default=0.5)
    ap.add_argument("--type", default="f16", help="KV type")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="fusion-"))
    model = args.model
    if model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        import testing_models

        model = str(testing_models.write_test_models(tmp, ["llama-gqa"])["llama-gqa"])
    logits = {}
    for frac, fusion in itertools.product((1.0, args.frac), ("on", "off")):
        env = dict(os.environ, GGML_CUDA_DISABLE_FUSION="0" if fusion == "on" else "1")
        out = tmp / f"{frac}-{fusion}.npy"
        subprocess.run([sys.executable, "-c", CHILD, str(ROOT), model, str(frac), args.type, str(out)],
                       env=env, check=True, capture_output=True)
        logits[f"frac {frac:g}, fusion {fusion}"] = np.load(out)
    for (a, x), (b, y) in itertools.combinations(logits.items(), 2):
        verdict = "identical" if np.array_equal(x, y) else f"differ (max |diff| {np.abs(x - y).max():.3g})"
        print(f"{a:22} vs {b:22} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
