"""Quantized weights on the CPU, whole and split: the synthetic models are F16/F32,
so they never reach the CPU's quantized matrix kernels (AMX on Intel Xeons with
``amx_int8``, the repacked AVX-512/AVX2 Q4_0/Q8_0 paths, the plain K-quant dot
products).  Here llama.cpp's own quantizer (:func:`quantize_model`) turns two of
them into Q8_0 and Q4_K_M files (Q4_K + Q6_K weights), and each is decoded at
frac 1.0 and 0.5 with the split forced on the CPU: the same tokens and the same
logits, bit for bit.

Which matrix path ran is read from llama.cpp's log ("AMX model buffer size" when
the AMX buffer type took the weights) and printed; on a CPU with AMX and a build
for it (GGML_NATIVE on such a CPU), the AMX path must have run -- that is the
path that crashed before patch 0020.  Each model runs in a subprocess, so a crash
in the C code fails this test alone, with the signal in the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, find_manifest
from test_build import cpuinfo_flags
from testing_models import FORCE_SPLIT

ROOT = Path(__file__).resolve().parents[1]

# model -> quantization -> the weight types the quantized file must hold
CASES = [
    ("llama-gqa", "q8_0", {"Q8_0"}),
    ("llama-gqa", "q4_k_m", {"Q4_K", "Q6_K"}),
    ("gemma3-iswa", "q4_k_m", {"Q4_K", "Q6_K"}),
]


@pytest.fixture(scope="module")
def quantized(gguf_models, tmp_path_factory, built):
    from pyllama_headinfer.llama import quantize_model

    out = tmp_path_factory.mktemp("quantized")
    return {(name, ftype): quantize_model(gguf_models[name], out / f"{name}-{ftype}.gguf", ftype, n_threads=2)
            for name, ftype, _ in CASES}


_SCRIPT = r"""
import json, sys
import numpy as np
from pyllama_headinfer import llama
from pyllama_headinfer.runtime.log import capture_log

path, n_steps = sys.argv[1], int(sys.argv[2])
extra_bufts = len(sys.argv) < 4 or sys.argv[3] != "plain"  # "plain": weights in plain CPU buffers
out = {}
with capture_log() as load_log:
    model = llama.Model(path, use_extra_bufts=extra_bufts)
out["buffers"] = [t for _, t in load_log if "model buffer size" in t]
with model:
    prompt = model.tokenize("Once upon a time there was a little town by the sea")
    for frac in (1.0, 0.5):
        with llama.Context(model, n_ctx=256, n_batch=64, n_threads=2, flash_attn=True,
                           headinfer_gpu_heads_frac=frac) as ctx, llama.Sampler.greedy() as greedy:
            # the prompt as a batch (matrix-matrix kernels: AMX's tile path), then one token a step
            ctx.decode(prompt)
            logits, tokens = [ctx.logits().tolist()], []
            for _ in range(n_steps):
                tokens.append(greedy.sample(ctx))
                ctx.decode([tokens[-1]])
                logits.append(ctx.logits().tolist())
            split = sum(x["n_head_resident"] < x["n_head_kv"] for x in ctx.kv_residency()["layers"])
            out[str(frac)] = {"tokens": tokens, "logits": logits, "layers_split": split}
print(json.dumps(out))
"""


def _cpu_has_amx() -> bool:
    flags = cpuinfo_flags()
    return "amx_int8" in flags and "amx_tile" in flags


def _decode(path: Path, *extra: str) -> dict:
    build_dir = find_manifest().build_dir
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{FORCE_SPLIT: "1"})
    env.setdefault(BUILD_DIR_ENV, str(build_dir))
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _SCRIPT, str(path), "12", *extra],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, f"the decode subprocess died (rc={res.returncode}):\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name,ftype,weight_types", CASES, ids=[f"{n}-{f}" for n, f, _ in CASES])
def test_quantized_model_whole_and_split_are_identical(quantized, name, ftype, weight_types):
    path = quantized[(name, ftype)]
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert weight_types <= types, types
    out = _decode(path)
    amx = any("AMX model buffer" in line for line in out["buffers"])
    print(f"\n{name} {ftype}: {'AMX' if amx else 'regular CPU'} matrix kernels; buffers: "
          + "; ".join(b.strip() for b in out["buffers"]))
    if _cpu_has_amx() and find_manifest().data["cpu_kernels"]["amx"]:
        assert amx, f"a build with ggml's AMX kernels on a CPU with AMX should repack {ftype} weights for AMX: " \
            f"{out['buffers']}"
    whole, split = out["1.0"], out["0.5"]
    assert whole["layers_split"] == 0 and split["layers_split"] > 0
    assert split["tokens"] == whole["tokens"]
    assert split["logits"] == whole["logits"]  # bit for bit, every step (floats survive JSON exactly)


@pytest.mark.parametrize("name,ftype", [("llama-gqa", "q8_0"), ("llama-gqa", "q4_k_m")])
def test_repacked_weights_agree_with_the_plain_cpu_kernels(quantized, name, ftype):
    """The repacked path (AMX where the CPU has it) against the plain CPU kernels
    (``use_extra_bufts=False``) on the prompt's logits (a batch: AMX's tile kernels).
    The two compute in another order and quantize the activations in their own
    blocks, so they are not bit for bit (measured here: correlation 0.9999, max
    difference 1.4-2.0 % of the largest logit; Gemma-3-270M: 0.9998, 2.6 %), and
    greedy decoding of these random-weight models, whose top logits nearly tie,
    may part after a few tokens; a broken tile configuration gives unrelated
    logits, which this catches."""
    path = quantized[(name, ftype)]
    fast, plain = _decode(path), _decode(path, "plain")
    assert not any("AMX model buffer" in line for line in plain["buffers"]), plain["buffers"]
    a, b = np.array(fast["1.0"]["logits"][0]), np.array(plain["1.0"]["logits"][0])
    corr = float(np.corrcoef(a, b)[0, 1])
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    print(f"\n{name} {ftype}: prompt logits, repacked vs plain kernels: correlation {corr:.6f}, "
          f"max difference {rel:.2%} of the largest")
    assert corr >= 0.999 and rel <= 0.05, (corr, rel)
