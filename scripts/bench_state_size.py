#!/usr/bin/env python3
"""Time llama.cpp's sequence-state calls with and without the HeadInfer split (issue 13.1).

A tiny synthetic model (2 layers, 8 KV heads of 64) holds ``--tokens`` tokens;
``llama_state_seq_get_size``, ``llama_state_seq_get_data`` and ``llama_state_seq_set_data`` (and ``llama_state_seq_save_file`` / ``load_file``, the
slot save of llama-server) are timed at
``headinfer_gpu_heads_frac`` 1.0 and 0.5, on the CPU with
``LLAMA_HEADINFER_FORCE_SPLIT=1`` (the whole split path).  A benchmark, not a
test: it prints the medians (ms) and checks only that both fractions save the
same bytes.

    python scripts/bench_state_size.py [--tokens 4096] [--repeat 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ["LLAMA_HEADINFER_FORCE_SPLIT"] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # testing_models: the test-model writers

from pyllama_headinfer.llama import Context, Model  # noqa: E402
from testing_models import SPECS, write_model  # noqa: E402

SPEC = replace(SPECS["llama-gqa"], name="state-bench", n_layer=2, n_embd=512, n_head=8, n_head_kv=8, head_dim=64,
               n_ctx_train=8192, seed=4242)


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(SPEC, Path(tmp) / SPEC.filename)
        with Model(str(path)) as model:
            tokens = [3 + i % (SPEC.n_vocab - 3) for i in range(args.tokens)]
            saved = {}
            for frac in (1.0, 0.5):
                with Context(model, n_ctx=args.tokens, n_batch=512, n_ubatch=512, n_threads=2,
                             headinfer_gpu_heads_frac=frac) as ctx:
                    for i in range(0, len(tokens), 512):
                        ctx.decode(tokens[i:i + 512], logits="none")
                    lib, ptr, ffi = ctx._lib, ctx._ptr(), ctx._ffi
                    size = int(lib.llama_state_seq_get_size(ptr, 0))
                    buf = ffi.new("uint8_t[]", size)
                    t_size = timed(lambda: lib.llama_state_seq_get_size(ptr, 0), args.repeat)
                    t_data = timed(lambda: lib.llama_state_seq_get_data(ptr, buf, size, 0), args.repeat)
                    saved[frac] = bytes(ffi.buffer(buf, size))
                    t_set = timed(lambda: lib.llama_state_seq_set_data(ptr, buf, size, 0), args.repeat)
                    # the file path (llama-server's slot save/restore), in the temporary directory
                    state_file = os.fsencode(Path(tmp) / "seq.bin")
                    toks = ffi.new("llama_token[]", tokens)
                    n_out = ffi.new("size_t *")
                    t_save = timed(lambda: lib.llama_state_seq_save_file(ptr, state_file, 0, toks, len(tokens)),
                                   args.repeat)
                    t_load = timed(lambda: lib.llama_state_seq_load_file(ptr, state_file, 0, toks, len(tokens), n_out),
                                   args.repeat)
                    split = sum(x["n_head_resident"] < x["n_head_kv"] for x in ctx.kv_residency()["layers"])
                    print(f"frac {frac:4.2f} ({split} layers split): state {size / 2**20:7.2f} MiB, "
                          f"llama_state_seq_get_size {t_size:8.3f} ms, llama_state_seq_get_data {t_data:8.3f} ms, "
                          f"llama_state_seq_set_data {t_set:8.3f} ms, seq_save_file {t_save:8.3f} ms, "
                          f"seq_load_file {t_load:8.3f} ms")
            same = saved[1.0] == saved[0.5]
            print("saved bytes identical across fractions:", same)
            return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
