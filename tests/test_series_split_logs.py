"""What the split did is visible at llama.cpp's default verbosity (issue 16.5,
C side) and the split is taken only where it can help (issue 13.3).

libllama logs, when a context is created with headinfer_gpu_heads_frac < 1:

* one INFO line per KV cache: how many layers were split and the KV bytes of
  the split layers in their own buffers and in host memory (matching the
  residency report byte for byte, to the printed precision);
* a WARNING for each reason the fraction was ignored for some layers (host
  memory, flash attention off, a single KV head, ...), or for the whole
  memory (recurrent models).

(For llama.cpp's CLI tools, whose default log shows libllama's warnings but
not its info lines, common/ repeats the outcome in one line of its own;
``test-arg-parser`` and the GPU script cover that side.)

Records are caught on the ``pyllama_headinfer.llama`` logger, where
libllama's log arrives with its levels.
"""

from __future__ import annotations

import logging
import re

import pytest
from conftest import capture_llama_log

from testing_models import CORPUS, FORCE_SPLIT, ensure_extra_models


pytestmark = pytest.mark.usefixtures("residency_llama")


@pytest.fixture
def records(llama):
    with capture_llama_log(logging.DEBUG) as caught:
        yield caught


def headinfer(records, level=None):
    """(level, text) of libllama's HeadInfer lines at INFO and above (the per-layer details are DEBUG)."""
    return [(r.levelno, r.getMessage()) for r in records
            if " headinfer: " in r.getMessage() and r.levelno >= logging.INFO
            and (level is None or r.levelno == level)]


def open_ctx(llama, model, frac, **kw):
    params = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, flash_attn=True)
    params.update(kw)
    return llama.Context(model, headinfer_gpu_heads_frac=frac, **params)


INFO_LINE = re.compile(r"llama_kv_cache: headinfer: gpu_heads_frac = (\d\.\d{3}), (\d+) of (\d+) layers split"
                       r"( \(SWA cache\))?; their KV: (\d+\.\d\d) MiB in the layers' buffers, "
                       r"(\d+\.\d\d) MiB in host memory$")


def test_split_is_one_info_line_with_the_bytes(llama, models, records, monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with open_ctx(llama, models["llama-gqa"], 0.25) as ctx:
        report = ctx.kv_residency()
    lines = headinfer(records)
    assert len(lines) == 1, lines
    level, text = lines[0]
    assert level == logging.INFO
    m = INFO_LINE.match(text)
    assert m, text
    assert m.group(1, 2, 3) == ("0.250", "3", "3") and m.group(4) is None
    own = sum(b["k"] + b["v"] for b in report["buffers"].values() if not b["headinfer_host"])
    host = sum(b["k"] + b["v"] for b in report["buffers"].values() if b["headinfer_host"])
    assert host == 3 * own  # 1 of 4 heads stays
    assert (m.group(5), m.group(6)) == (f"{own / 2**20:.2f}", f"{host / 2**20:.2f}")


def test_iswa_says_which_cache(llama, models, records, monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with open_ctx(llama, models["gemma3-iswa"], 0.5):
        pass
    lines = [INFO_LINE.match(t) for lvl, t in headinfer(records, logging.INFO)]
    assert len(lines) == 2 and all(lines), headinfer(records)
    assert [m.group(4) for m in lines] == [None, " (SWA cache)"]
    assert not headinfer(records, logging.WARNING)


def test_ignored_fraction_is_a_warning(llama, models, records, monkeypatch):
    """A CPU build without the testing knob: the KV is in host memory, nothing to split."""
    monkeypatch.delenv(FORCE_SPLIT, raising=False)
    with open_ctx(llama, models["llama-gqa"], 0.5) as ctx:
        assert all(x["n_head_resident"] == x["n_head_kv"] for x in ctx.kv_residency()["layers"])
    assert headinfer(records, logging.WARNING) == [
        (logging.WARNING, "llama_kv_cache: headinfer: 3 layers not split: the layer's KV is in host memory already "
                          "(gpu_heads_frac = 0.500 ignored for them)")]
    info = [INFO_LINE.match(t) for _, t in headinfer(records, logging.INFO)]
    assert len(info) == 1 and info[0].group(2, 3) == ("0", "3")


def test_flash_attention_off_is_a_warning(llama, models, records, monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")  # even the testing knob cannot split a transposed V cache
    with open_ctx(llama, models["qwen2"], 0.5, flash_attn=False):
        pass
    assert headinfer(records, logging.WARNING) == [
        (logging.WARNING, "llama_kv_cache: headinfer: 2 layers not split: the V cache is transposed (flash attention "
                          "is off) (gpu_heads_frac = 0.500 ignored for them)")]


def test_memory_without_attention_kv_is_a_warning(llama, records, test_models_dir):
    path = ensure_extra_models(test_models_dir, ["mamba"])["mamba"]
    with llama.Model(str(path)) as model, open_ctx(llama, model, 0.5) as ctx:
        assert ctx.kv_residency() is None
    assert headinfer(records) == [
        (logging.WARNING, "create_memory: headinfer: gpu_heads_frac = 0.500 ignored: the memory of this model "
                          "(mamba) is not a plain attention KV cache")]


def test_no_fraction_no_headinfer_lines(llama, models, records, monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with open_ctx(llama, models["llama-gqa"], 1.0) as ctx:
        ctx.decode(ctx.model.tokenize(CORPUS)[:8])
    assert headinfer(records) == []
