#!/usr/bin/env python3
"""How far is the attention in chunks (headinfer_attn="chunked") from one attention over the joined heads?

    python scripts/attn_chunked_compare.py [--fracs 0.75,0.5,0.25] [--types f16,q8_0] [--steps 32] [--ngl 99]
                                           [--depth 48] [--no-8b-heads] [--no-cuda-fusion] [--chunk 256]

In chunked mode every layer attends in chunks of --chunk KV cells, merged by
their log-sum-exps. For every GPU check model (the test models and the one
with Llama-3-8B's attention geometry) x KV type x fraction: a greedy decode
with the joined heads at frac 1.0, then the same tokens decoded joined and in
chunks at the fraction (so every step sees the same context). Each row prints
the chunks' difference to one attention (stock attention, another float order
once the context holds more than one chunk: set --depth above --chunk: the
largest |delta logit| over all steps and vocabulary, and the share of steps
whose greedy token agrees), then to chunked at frac 1.0, which must be 0 on
every backend. Exit status 0 whatever the difference (a measurement, not a
check); 1 only if something failed to run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # testing_models: the test-model writers

import testing_models  # noqa: E402
from pyllama_headinfer.llama import Context, Model  # noqa: E402
from pyllama_headinfer.runtime.log import capture_log  # noqa: E402

CHUNKED_LOG = "every layer attends in chunks of"  # llama.cpp's line when chunked mode is on
N_PROMPT = 48


def decode(model: Model, frac: float, kv_type: str, mode: str, prompt: list[int], steps: int,
           forced: list[int] | None = None, chunk: int = 0) -> tuple[list[int], np.ndarray]:
    """(greedy tokens, logits of every step [steps + 1, n_vocab]); with ``forced`` those tokens are decoded."""
    n_ctx = -(-(len(prompt) + steps + 1) // 256) * 256
    with capture_log() as log, Context(model, n_ctx=n_ctx, n_batch=512, flash_attn=True, type_k=kv_type,
                                       type_v=kv_type, headinfer_gpu_heads_frac=frac, headinfer_attn=mode,
                                       headinfer_attn_chunk=chunk if mode == "chunked" else 0) as ctx:
        said = any(CHUNKED_LOG in text for _, text in log)
        if said != (mode == "chunked"):
            raise RuntimeError(f"headinfer_attn={mode}, frac {frac}: llama.cpp's log {'says' if said else 'does not say'}"
                               f" that chunked mode is on")
        for i in range(0, len(prompt), 512):
            ctx.decode(prompt[i:i + 512])
        logits = [ctx.logits(-1)]
        tokens = []
        for i in range(steps):
            tokens.append(int(np.argmax(logits[-1])) if forced is None else forced[i])
            ctx.decode([tokens[-1]])
            logits.append(ctx.logits(-1))
    return tokens, np.stack(logits)


def compare(a: np.ndarray, b: np.ndarray) -> str:
    same = np.array_equal(a, b)
    delta = float(np.abs(a.astype(np.float64) - b).max())
    agree = float(np.mean(np.argmax(a, axis=1) == np.argmax(b, axis=1)))
    return f"{'identical' if same else 'differs'} max|d| {delta:.3g} greedy agreement {agree:.1%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fracs", default="0.75,0.5,0.25")
    ap.add_argument("--types", default="f16,q8_0", help="KV types (K and V)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps after the prompt")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--depth", type=int, default=N_PROMPT, help="prompt tokens (the test corpus, repeated)")
    ap.add_argument("--no-8b-heads", dest="with_8b_heads", action="store_false",
                    help="skip the model with Llama-3-8B's attention geometry")
    ap.add_argument("--no-cuda-fusion", action="store_true", help="set GGML_CUDA_DISABLE_FUSION=1 (docs/GPU.md)")
    ap.add_argument("--chunk", type=int, default=256, help="KV cells per chunk (default 256)")
    args = ap.parse_args(argv)
    if args.depth < 1 or args.steps < 0:
        ap.error("--depth must be at least 1 and --steps at least 0")
    logging.getLogger("pyllama_headinfer.llama").setLevel(logging.INFO)  # the split's INFO lines reach the capture
    if args.no_cuda_fusion:
        os.environ["GGML_CUDA_DISABLE_FUSION"] = "1"

    models_dir = Path(tempfile.mkdtemp(prefix="headinfer-models-"))
    paths = testing_models.write_test_models(models_dir)
    if args.with_8b_heads:
        paths.update(testing_models.ensure_gpu_models(models_dir, ["llama-8b-heads"]))
    print(f"{'model':<16} {'kv':<5} {'frac':>5}  chunked vs joined / chunked vs chunked at frac 1.0")
    try:
        compare_models(paths, args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def compare_models(paths: dict[str, Path], args) -> None:
    for name, path in paths.items():
        with Model(path, n_gpu_layers=args.ngl) as model:
            corpus = model.tokenize(testing_models.CORPUS)
            prompt = (corpus * (args.depth // len(corpus) + 1))[:args.depth]
            for kv_type in args.types.split(","):
                base_tokens, base = decode(model, 1.0, kv_type, "joined", prompt, args.steps)
                chunked_base = decode(model, 1.0, kv_type, "chunked", prompt, args.steps, base_tokens, args.chunk)[1]
                for frac in (float(f) for f in args.fracs.split(",")):
                    _, joined = decode(model, frac, kv_type, "joined", prompt, args.steps, base_tokens)
                    _, got = decode(model, frac, kv_type, "chunked", prompt, args.steps, base_tokens, args.chunk)
                    print(f"{name:<16} {kv_type:<5} {frac:>5g}  {compare(joined, got)} / {compare(chunked_base, got)}"
                          f"{'' if np.array_equal(joined, base) else ' (joined differs from frac 1.0)'}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
