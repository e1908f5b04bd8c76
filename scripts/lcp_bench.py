#!/usr/bin/env python3
"""llama-cpp-python's ``Llama`` (patched by ``build --llama-cpp-python``) under the split: fill and decode.

For each fraction a fresh ``Llama(model, n_gpu_layers=99, flash_attn=True, n_ctx=..., headinfer_gpu_heads_frac=f)``
evaluates a prompt of ``--prompt-tokens`` token ids (``Llama.eval``, in batches of ``--batch``), then decodes
``--gen`` tokens greedily one at a time (``Llama.sample(temp=0)`` + ``Llama.eval``). Printed per fraction: fill and
decode tok/s (wall clock around those calls) and the KV bytes on the device and in host memory from
``Llama.kv_residency()``. A benchmark, not a test: figures only from the machine it ran on.

    python scripts/lcp_bench.py --model b8.gguf --fracs 1,0.5 --prompt-tokens 32768 --gen 32 [--json OUT]

``llama_cpp`` is imported as installed (or from PYTHONPATH, with ``LLAMA_CPP_LIB_PATH`` naming the build's
libraries, as on a machine without network).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def run(args, frac: float) -> dict:
    from llama_cpp import Llama

    llm = Llama(args.model, n_gpu_layers=99, flash_attn=True, n_ctx=args.prompt_tokens + args.gen + 64,
                n_batch=args.batch, n_ubatch=args.batch, headinfer_gpu_heads_frac=frac, verbose=False)
    try:
        rng = random.Random(0)
        n_vocab = llm.n_vocab()
        prompt = [rng.randrange(min(1000, n_vocab // 2), n_vocab) for _ in range(args.prompt_tokens)]
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for _ in range(args.gen):
            llm.eval([llm.sample(temp=0.0)])
        t2 = time.perf_counter()
        report = llm.kv_residency() or {"buffers": {}, "layers": []}
    finally:
        llm.close()
    host = sum(b["k"] + b["v"] for b in report["buffers"].values() if b["headinfer_host"])
    device = sum(b["k"] + b["v"] for b in report["buffers"].values() if not b["headinfer_host"])
    split = sum(x["n_head_resident"] < x["n_head_kv"] for x in report["layers"])
    return {"frac": frac, "fill_tok_s": len(prompt) / (t1 - t0), "decode_tok_s": args.gen / (t2 - t1),
            "kv_device_mib": device / 2**20, "kv_host_mib": host / 2**20, "layers_split": split,
            "buffers": report["buffers"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--fracs", default="1,0.5")
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = [run(args, float(f)) for f in args.fracs.split(",")]
    print("| frac | layers split | KV device MiB | KV host MiB | fill tok/s | decode tok/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['frac']:g} | {r['layers_split']} | {r['kv_device_mib']:.0f} | {r['kv_host_mib']:.0f} "
              f"| {r['fill_tok_s']:.0f} | {r['decode_tok_s']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
