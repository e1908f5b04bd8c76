"""Attention in chunks of KV cells (patch 0032, ``headinfer_attn="chunked"``; issue 30).

Every layer attends in chunks of ``headinfer_attn_chunk`` cells, merged by
their log-sum-exps (``ggml_flash_attn_ext_lse``, patch 0031). The chunks are
the same for every head fraction, so within the mode every fraction gives
frac 1.0's bits (``LLAMA_HEADINFER_FORCE_SPLIT=1`` splits on the CPU); against
one attention (the joined heads) it is another float order, measured here by
``scripts/attn_chunked_compare.py`` and bounded, and exactly the
same when the context fits in one chunk.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from testing_models import FORCE_SPLIT

ROOT = Path(__file__).resolve().parents[1]


def _compare(chunk: int, depth: int) -> list[tuple[str, str]]:
    """(vs joined, vs chunked at frac 1.0) for every model x KV type x fraction of the comparison script."""
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "attn_chunked_compare.py"), "--no-8b-heads",
                          "--chunk", str(chunk), "--depth", str(depth), "--steps", "8",
                          "--fracs", "0.75,0.5,0.25", "--types", "f16,q8_0"],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, **{FORCE_SPLIT: "1"}), timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 3 * 2 * 3, run.stdout  # models x KV types x fractions
    # "model kv frac  <vs joined> / <vs chunked at frac 1.0>"
    return [tuple(re.match(r"\S+\s+\S+\s+\S+\s+(.*) / (.*)$", row).groups()) for row in rows]


def test_chunks_give_frac_1s_bits_at_every_fraction_and_stay_close_to_one_attention(built):
    # 600 prompt tokens + 8 steps in chunks of 256 cells: three chunks per layer
    for vs_joined, vs_frac_1 in _compare(chunk=256, depth=600):
        assert vs_frac_1 == "identical max|d| 0 greedy agreement 100.0%", vs_frac_1
        assert vs_joined.startswith("differs"), vs_joined  # the chunks are really there: another float order
        delta = float(re.search(r"max\|d\| (\S+)", vs_joined).group(1))
        assert delta < 0.1, vs_joined  # a wrong merge (a chunk lost or counted twice) moves logits by O(1)


def test_one_chunk_is_one_attention(built):
    """A context within one chunk: the attention with its log-sum-exp gives the same bits as without."""
    for vs_joined, vs_frac_1 in _compare(chunk=1024, depth=600):
        assert vs_joined == vs_frac_1 == "identical max|d| 0 greedy agreement 100.0%", (vs_joined, vs_frac_1)


def _compute_buffer_mib(llama, model, n_ctx: int, frac: float, **mode) -> float:
    """The CPU compute buffer llama.cpp reserves for a context (its log line), in MiB."""
    from pyllama_headinfer.runtime.log import capture_log, compute_buffers_mib

    with capture_log() as log, llama.Context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True,
                                             headinfer_gpu_heads_frac=frac, **mode):
        pass
    sizes = compute_buffers_mib(log)
    assert "CPU" in sizes, f"llama.cpp logged no CPU compute buffer size: {sizes}"
    return sizes["CPU"]


def test_a_split_layer_in_chunks_holds_one_chunk_of_its_heads(llama, gguf_models, monkeypatch):
    """Patch 0034: the device memory a split layer needs beyond frac 1.0 does not grow with the context in
    chunks (one chunk's heads at a time), as it does with the joined heads (the whole layer). On the CPU the
    compute buffer shows it: its growth at f 0.5 over f 1.0, from 4K to 16K cells."""
    monkeypatch.setenv(FORCE_SPLIT, "1")
    logger = logging.getLogger("pyllama_headinfer.llama")
    monkeypatch.setattr(logger, "level", logging.INFO)  # sched_reserve's lines reach the capture
    growth = {}
    with llama.Model(gguf_models["llama-gqa"]) as model:
        for name, mode in (("joined", {}), ("chunked", dict(headinfer_attn="chunked", headinfer_attn_chunk=256))):
            extra = {n_ctx: _compute_buffer_mib(llama, model, n_ctx, 0.5, **mode) -
                     _compute_buffer_mib(llama, model, n_ctx, 1.0, **mode) for n_ctx in (4096, 16384)}
            growth[name] = extra[16384] - extra[4096]
    assert growth["joined"] > 8, growth  # the whole layer's heads: ~1 MiB per 1K cells for this model
    assert growth["chunked"] < growth["joined"] / 4, growth  # the chunk idxs inputs only


def _decode_two_sequences_with_a_shift(llama, model, frac: float) -> np.ndarray:
    """Two sequences in one batch (two KV streams), one shifted (K-shift) and extended: every step's logits."""
    prompt = model.tokenize("Chunks of cells, merged by their log-sum-exps. " * 40)[:300]
    with llama.Context(model, n_ctx=2048, n_batch=1024, n_ubatch=512, n_seq_max=2, flash_attn=True,
                       headinfer_gpu_heads_frac=frac, headinfer_attn="chunked", headinfer_attn_chunk=256) as ctx:
        rows = ctx.decode_batch({0: prompt, 1: prompt[::-1]})
        logits = [ctx.logits(rows[0]), ctx.logits(rows[1])]
        ctx.seq_rm(1, 0, 40)
        ctx.seq_add(1, 40, -1, -40)  # K-shift of the rest of sequence 1
        for step in range(4):
            rows = ctx.decode_batch({0: [prompt[step]], 1: [prompt[-step - 1]]})
            logits += [ctx.logits(rows[0]), ctx.logits(rows[1])]
    return np.stack(logits)


def test_chunks_with_several_sequences_and_a_k_shift_are_exact_across_fractions(llama, gguf_models, monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with llama.Model(gguf_models["llama-gqa"]) as model:
        whole = _decode_two_sequences_with_a_shift(llama, model, 1.0)
        for frac in (0.5, 0.25):
            assert np.array_equal(_decode_two_sequences_with_a_shift(llama, model, frac), whole), frac


def _fill_the_cache(llama, model, frac: float, kv_type: str) -> np.ndarray:
    """1000 prompt tokens and 24 greedy steps in a cache of 1024 cells, chunks of 256: the last logits of the prompt
    and every step's."""
    prompt = model.tokenize("A cache filled to its last cell. " * 150)[:1000]
    with llama.Context(model, n_ctx=1024, n_batch=512, n_ubatch=512, flash_attn=True, headinfer_gpu_heads_frac=frac,
                       type_k=kv_type, type_v=kv_type, headinfer_attn="chunked", headinfer_attn_chunk=256) as ctx:
        ctx.decode(prompt)
        logits = [ctx.logits(-1)]
        for _ in range(24):
            ctx.decode([int(np.argmax(logits[-1]))])
            logits.append(ctx.logits(-1))
    return np.stack(logits)


@pytest.mark.parametrize("n_head_kv, kv_type", [(4, "f16"), (2, "q8_0")])
def test_chunks_of_a_full_cache_are_exact_across_fractions(llama, tmp_path, monkeypatch, n_head_kv, kv_type):
    """Once the cells in use reach the cache's end, a split layer's last chunk has no cell after it: its spare row
    (where a ubatch's rows of other chunks are written) is the cell before it, its own cells one row further
    (get_split_chunk, set_input_join_idxs). The prompt's second ubatch and every step here attend such a chunk; in F16
    with four KV heads of 64 and in q8_0 with two (a row of 136 bytes)."""
    from dataclasses import replace
    from testing_models import SPECS, write_model

    path = write_model(replace(SPECS["llama-gqa"], n_head_kv=n_head_kv), tmp_path / "model.gguf")
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with llama.Model(path) as model:
        whole = _fill_the_cache(llama, model, 1.0, kv_type)
        for frac in (0.5, 0.25):
            assert np.array_equal(_fill_the_cache(llama, model, frac, kv_type), whole), frac


def test_a_state_saved_in_one_mode_loads_in_the_other(llama, gguf_models, monkeypatch):
    """The mode changes how the cache is read, not what it holds: a state saved from the joined heads at
    frac 0.5 continues in chunks with the same bits at frac 1.0 and 0.25, and close to the joined heads."""
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with llama.Model(gguf_models["llama-gqa"]) as model:
        prompt = model.tokenize("A state crosses modes. " * 60)[:400]
        with llama.Context(model, n_ctx=1024, flash_attn=True, headinfer_gpu_heads_frac=0.5) as ctx:
            ctx.decode(prompt)
            state = ctx.save_state()

        def continued(**mode) -> np.ndarray:
            with llama.Context(model, n_ctx=1024, flash_attn=True, **mode) as ctx:
                ctx.load_state(state)
                ctx.decode(prompt[:3])
                return ctx.logits(-1)

        chunked = continued(headinfer_attn="chunked", headinfer_attn_chunk=256)
        assert np.array_equal(continued(headinfer_attn="chunked", headinfer_attn_chunk=256,
                                        headinfer_gpu_heads_frac=0.25), chunked)
        joined = continued()
        assert not np.array_equal(joined, chunked) and np.abs(joined - chunked).max() < 0.1


@pytest.mark.parametrize("kwargs, message", [
    (dict(headinfer_attn="chunked", headinfer_attn_chunk=100), "multiple of 256"),
    (dict(headinfer_attn="chunked", headinfer_attn_chunk=-256), "multiple of 256"),
    (dict(headinfer_attn="chunked", headinfer_attn_chunk=True), "multiple of 256"),
    (dict(headinfer_attn="joined", headinfer_attn_chunk=512), "applies to headinfer_attn='chunked' only"),
    (dict(headinfer_attn="chunked", flash_attn=False), "needs flash attention"),
])
def test_bad_chunk_parameters_are_value_errors(kwargs, message):
    from pyllama_headinfer.params import ContextParams

    with pytest.raises(ValueError, match=message):
        ContextParams(**kwargs)


def test_the_default_chunk_is_the_models(llama, gguf_models, tmp_path):
    """headinfer_attn_chunk 0 (patch 0040): 32 MiB of the largest layer's K and V rows in F16, a multiple of 256
    cells; the same number from llama.cpp (llama_model_headinfer_attn_chunk, which a context in the mode logs and
    uses) and from the planner's model of it (vram.memory.default_attn_chunk), for three head shapes."""
    from dataclasses import replace

    import testing_models
    from pyllama_headinfer.runtime.log import capture_log
    from pyllama_headinfer.vram.memory import default_attn_chunk
    from pyllama_headinfer.vram.model import read_model_info

    gqa = testing_models.SPECS["llama-gqa"]
    paths = {
        32768: gguf_models["llama-gqa"],  # 4 KV heads of 64: 1 KiB a cell
        131072: testing_models.write_model(testing_models.EXTRA_SPECS["llama-mqa"], tmp_path / "mqa.gguf"),  # 1 of 64
        8192: testing_models.write_model(replace(gqa, name="heads-8x128", n_layer=1, n_embd=1024, n_head=8, n_head_kv=8,
                                                 head_dim=128), tmp_path / "8x128.gguf"),  # the 8B shape's 4 KiB
    }
    for expected, path in paths.items():
        assert default_attn_chunk(read_model_info(path)) == expected, path
        with llama.Model(str(path)) as model:
            assert model.headinfer_attn_chunk == expected, path
            with capture_log() as log, llama.Context(model, n_ctx=512, flash_attn=True, headinfer_attn="chunked"):
                pass
        assert any(f"attends in chunks of {expected} KV cells" in text for _, text in log), path


def test_the_mode_is_a_cli_flag(built, gguf_models):
    run = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "-v", "generate", "--model",
                          str(gguf_models["llama-gqa"]), "--prompt", "Once upon a time", "-n", "4", "--temp", "0",
                          "--ctx", "512", "--headinfer-attn", "chunked", "--headinfer-attn-chunk", "256"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "every layer attends in chunks of 256 KV cells" in run.stderr, run.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "generate", "--model", str(gguf_models["llama-gqa"]),
                          "--prompt", "x", "--headinfer-attn", "chunked", "--headinfer-attn-chunk", "300"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "multiple of 256" in bad.stderr, (bad.returncode, bad.stderr[-500:])


def test_a_real_quantized_model_in_chunks(built):
    """Gemma 3 270M Q4_K_M (real weights, the CPU's quantized kernels; iSWA): in one chunk the mode gives one
    attention's bits; in chunks of 256 cells (3 at 700 tokens) another float order, which this model moves by about
    as much as stock llama.cpp's own change of ubatch (docs/ARENA.md: 0.68-0.94 against 0.68)."""
    from testing_models import CORPUS
    from testing_real_models import GEMMA3_270M, ensure_model

    from pyllama_headinfer import llama

    with llama.Model(str(ensure_model(GEMMA3_270M))) as model:
        tokens = (model.tokenize(CORPUS) * 20)[:700]

        def last_logits(**mode) -> np.ndarray:
            with llama.Context(model, n_ctx=1024, n_batch=512, flash_attn=True, **mode) as ctx:
                for i in range(0, len(tokens), 512):
                    ctx.decode(tokens[i:i + 512])
                return ctx.logits(-1)

        joined = last_logits()
        one_chunk = last_logits(headinfer_attn="chunked", headinfer_attn_chunk=1024)
        chunks = last_logits(headinfer_attn="chunked", headinfer_attn_chunk=256)
    assert np.array_equal(one_chunk, joined)
    assert np.isfinite(chunks).all() and not np.array_equal(chunks, joined)

