"""The attention per part of a split layer (patch 0020, ``headinfer_attn="parts"``).

The resident heads are attended where they live and the host heads where
they were copied, and the two outputs joined. On the CPU every row of the
flash attention is computed on its own, so the parts give the joined heads'
bits exactly: ``scripts/attn_parts_compare.py`` (the GPU's measurement of
the difference) must report none here. (The same with RPC devices and the
scheduler's streaming: tests/test_multi_device.py.)
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testing_models import FORCE_SPLIT

ROOT = Path(__file__).resolve().parents[1]


def test_parts_give_the_joined_heads_bits_on_the_cpu(built):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "attn_parts_compare.py"), "--no-8b-heads",
                          "--fracs", "0.75,0.5,0.25", "--types", "f16,q8_0", "--steps", "8"],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, **{FORCE_SPLIT: "1"}), timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 3 * 2 * 3, run.stdout  # models x KV types x fractions
    for row in rows:
        assert row.count("identical max|d| 0 greedy agreement 100.0%") == 2, row


@pytest.mark.parametrize("value", ["part", "PARTS", 1, None])
def test_an_unknown_mode_is_a_value_error(llama, gguf_models, value):
    with llama.Model(gguf_models["llama-gqa"]) as model:
        with pytest.raises(ValueError, match="headinfer_attn must be one of 'joined', 'parts'"):
            llama.Context(model, n_ctx=256, headinfer_gpu_heads_frac=0.5, headinfer_attn=value)
        with pytest.raises(ValueError, match="headinfer_stream must be one of 'gpu', 'off', 'any'"):
            llama.Context(model, n_ctx=256, headinfer_gpu_heads_frac=0.5, headinfer_stream=value)


def test_parts_are_a_context_parameter(llama, gguf_models, monkeypatch):
    """headinfer_attn (llama_context_params, no environment variable) reaches the KV cache: its log says so."""
    from pyllama_headinfer.runtime.log import capture_log

    monkeypatch.setenv(FORCE_SPLIT, "1")
    logger = logging.getLogger("pyllama_headinfer.llama")
    monkeypatch.setattr(logger, "level", logging.INFO)  # the split's INFO lines reach the capture
    texts = {}
    for attn in ("joined", "parts"):
        with llama.Model(gguf_models["llama-gqa"]) as model, capture_log() as log, \
                llama.Context(model, n_ctx=256, flash_attn=True, headinfer_gpu_heads_frac=0.5, headinfer_attn=attn) as ctx:
            ctx.decode(model.tokenize("The split reads its heads."))
        texts[attn] = [text for _, text in log]
    assert any("attend to their resident and host heads separately" in t for t in texts["parts"]), texts["parts"]
    assert not any("separately" in t for t in texts["joined"]), texts["joined"]
