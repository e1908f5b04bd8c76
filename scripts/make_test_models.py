#!/usr/bin/env python3
"""Write the small synthetic GGUF test models (see tests/testing_models.py).

    python scripts/make_test_models.py --out DIR [--model NAME ...] [--check]

--check loads each model with the built bindings and greedily generates a few
tokens (needs `python -m pyllama_headinfer build` first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testing_models: the test-model writers

import testing_models


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="directory to write the .gguf files to")
    ap.add_argument("--model", action="append", choices=sorted(testing_models.SPECS),
                    help="only this model (repeatable; default: all)")
    ap.add_argument("--check", action="store_true", help="load each model with llama.cpp and generate tokens")
    args = ap.parse_args(argv)

    paths = testing_models.write_test_models(args.out, args.model)
    for name, path in paths.items():
        print(f"{name:14s} {path}  ({path.stat().st_size / 1e6:.1f} MB)")
    if args.check:
        from pyllama_headinfer.llama import Context, Model

        for name, path in paths.items():
            with Model(path) as model, Context(model, n_ctx=256, n_threads=2) as ctx:
                prompt = model.tokenize("Once upon a time there was a little town")
                out = list(ctx.generate(prompt, max_tokens=8))
                print(f"{name:14s} ok: {len(prompt)} prompt tokens -> {out} {model.detokenize(out)!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
