"""``plan``: the head fraction from a VRAM budget (issue 7), on the CPU.

What is proven here, and how:

* The KV bytes are exact.  For the synthetic models (llama GQA, qwen2,
  gemma3 iSWA, a one-KV-head llama) under several cache settings (quantized
  and mixed K/V types, n_seq_max > 1 with and without kv_unified, iSWA with
  and without swa_full, small n_ubatch, n_ctx = 0, flash attention off) and
  every g, the plan's per-layer head split and its K/V bytes in the layers'
  own buffers and in the host halves equal what llama.cpp allocated, as its
  residency report says, byte for byte; the context sizes too.

  The honest way to do that without a GPU: the plan is made for "every
  layer offloaded" (n_gpu_layers = -1) and compared with a CPU context under
  LLAMA_HEADINFER_FORCE_SPLIT=1, which makes llama.cpp take the split
  decision for every layer as it does for offloaded layers.  Tensor sizes do
  not depend on the buffer type, so "device buffer" (plan) and "the layer's
  own CPU buffer" (report) hold the same bytes; what differs on a GPU is only
  the buffers' names.  The plan's force_split option (host layers split, the
  same knob) is checked to give the same bytes with n_gpu_layers = 0.

* The layer placement rule for n_gpu_layers (i_gpu_start = n_layer + 1 -
  ngl), the fraction <-> g mapping (lround on a C float), per-layer head
  counts, the weight bytes (all tensors once, against llama_model_size), the
  choice (the largest fitting g) and the advice when nothing fits.

* Bad inputs (missing file, directory, not a GGUF, truncated, unsupported
  architecture, budget below the weights, nothing fits, bad sizes) give
  clear errors; the CLI prints the table and the choice; the Context option
  headinfer_vram_budget and generate --vram-budget use the plan.

Not proven here: the compute-buffer estimate and the device total against a
real GPU allocation (docs/PLAN.md says how to measure that on the H200).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import numpy as np
import pytest

from pyllama_headinfer.errors import BudgetTooSmallError, NothingFitsError
from pyllama_headinfer.params import KV_CACHE_TYPES, ContextParams, parse_size
from pyllama_headinfer.vram import plan as vram_plan
from pyllama_headinfer.vram.memory import KVLayer, gpu_layer_start, n_resident, weights
from pyllama_headinfer.vram.model import gguf_index, read_model_info
from pyllama_headinfer.vram.plan import force_split_from_env, frac_for_g
from testing_models import FORCE_SPLIT, SPECS, ensure_extra_models


@pytest.fixture(scope="module")
def extra_models(test_models_dir):
    return ensure_extra_models(test_models_dir, ["llama-mqa", "mamba"])


@pytest.fixture(scope="module")
def all_models(gguf_models, extra_models):
    return {**gguf_models, "llama-mqa": extra_models["llama-mqa"]}


def plan_kv(model, n_ctx, vram_budget=None, *, n_gpu_layers=-1, force_split=False, margin=0, **context):
    """This file's shorthand: vram.plan.plan_kv with the context's parameters as keywords."""
    params = ContextParams(n_ctx=n_ctx, headinfer_vram_budget=vram_budget, **context)
    return vram_plan.plan_kv(model, params, n_gpu_layers=n_gpu_layers, force_split=force_split, margin=margin)


def frac_for_budget(model, n_ctx, vram_budget, **context):
    return vram_plan.frac_for_budget(model, ContextParams(n_ctx=n_ctx, headinfer_vram_budget=vram_budget, **context))


def main(*args) -> int:
    from pyllama_headinfer.cli import main as cli

    return cli.main(["plan", *map(str, args)])


# --------------------------------------------------------------------------
# pure rules (no llama.cpp build needed)


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("24 GB", 24 * 10**9), ("512M", 512 * 2**20), ("1.5KiB", 1536), ("100", 100),
    (4096, 4096), ("2tib", 2 * 2**40), ("0.5G", 2**29),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "-1GiB", "24 parsecs", "1e9", "0", 0, -5, True, None, float("nan")])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_frac_for_g_round_trips_through_a_c_float():
    """f = g/n, stored in a C float and rounded with lround, gives g back (the C++ rule)."""
    for n in range(2, 129):
        for g in range(1, n):
            f = frac_for_g(g, n)
            layer = KVLayer(il=0, is_swa=False, n_head_kv=n, head_k=64, head_v=64, row_v=64 * n, cells=256,
                                 n_stream=1, on_device=True, why_whole=None)
            assert n_resident(layer, f) == g, (g, n, f)
        assert frac_for_g(n, n) == 1.0


def test_lround_is_half_away_from_zero():
    layer = KVLayer(il=0, is_swa=False, n_head_kv=4, head_k=64, head_v=64, row_v=256, cells=256, n_stream=1,
                         on_device=True, why_whole=None)
    assert n_resident(layer, 0.125) == 1  # 0.5 -> 1 (Python's round() would give 0, clamped to 1 anyway)
    assert n_resident(layer, 0.375) == 2  # 1.5 -> 2
    assert n_resident(layer, 0.625) == 3  # 2.5 -> 3 (round() would give 2)
    assert n_resident(layer, 0.0) == 1 and n_resident(layer, 0.99) == 3 and n_resident(layer, 1.0) == 4


def test_read_model_info(all_models):
    for name in ("llama-gqa", "qwen2", "gemma3-iswa"):
        spec, info = SPECS[name], read_model_info(all_models[name])
        assert (info.arch, info.n_layer, info.n_embd, info.n_vocab) == (spec.arch, spec.n_layer, spec.n_embd,
                                                                       spec.n_vocab)
        assert info.n_head_kv == (spec.n_head_kv,) * spec.n_layer
        assert (info.head_k, info.head_v) == (spec.head_dim, spec.head_dim)
        assert info.n_swa == spec.sliding_window
    # gemma3, pattern 2, dense_first = false: il % 2 < 1 is SWA
    assert read_model_info(all_models["gemma3-iswa"]).is_swa == (True, False, True, False)
    assert not read_model_info(all_models["llama-gqa"]).iswa


def test_gpu_layer_placement(all_models):
    """src/llama-model.cpp: i_gpu_start = max(n_layer + 1 - ngl, 0); the output layer counts as one."""
    info = read_model_info(all_models["llama-gqa"])  # 3 layers
    assert [gpu_layer_start(info, ngl) for ngl in (-1, 99, 4, 3, 2, 1, 0)] == [0, 0, 0, 1, 2, 3, 4]
    w = {ngl: weights(info, ngl) for ngl in (-1, 3, 1, 0)}
    assert (w[-1].n_layer_gpu, w[-1].output_on_gpu) == (3, True)
    assert (w[3].n_layer_gpu, w[3].output_on_gpu) == (2, True)  # ngl = n_layer leaves layer 0 on the CPU
    assert (w[1].n_layer_gpu, w[1].output_on_gpu) == (0, True)
    assert (w[0].n_layer_gpu, w[0].output_on_gpu, w[0].device) == (0, False, 0)
    total = sum(t.n_bytes for t in info.tensors)
    for x in w.values():
        assert x.device + x.host == total  # every tensor once (the model has its own output.weight)
    emb = next(t.n_bytes for t in info.tensors if t.name == "token_embd.weight")
    assert w[-1].host == emb  # token_embd stays on the CPU
    p = plan_kv(info, 1024, n_gpu_layers=3)
    assert [x.on_device for x in p.layers] == [False, True, True]
    assert p.layers[0].why_whole.startswith("the layer's KV is in host memory already")


def test_tied_output_is_duplicated_onto_the_output_device(all_models):
    info = read_model_info(all_models["llama-gqa"])
    tied = dataclasses.replace(info, tensors=tuple(t for t in info.tensors if t.name != "output.weight"))
    emb = next(t.n_bytes for t in info.tensors if t.name == "token_embd.weight")
    on, off = weights(tied, -1), weights(tied, 0)
    assert on.host == emb and on.device == weights(info, -1).device - next(
        t.n_bytes for t in info.tensors if t.name == "output.weight") + emb
    assert off.host == sum(t.n_bytes for t in tied.tensors) + emb  # llama.cpp loads it twice


def test_per_layer_head_counts(all_models):
    """KV heads given per layer: each layer keeps clamp(lround(f * n), 1, n - 1)."""
    info = read_model_info(all_models["llama-gqa"])
    info = dataclasses.replace(info, n_head_kv=(4, 2, 8), n_head=(8, 8, 8))
    p = plan_kv(info, 512)
    assert p.n_head_kv == 8
    for row in p.rows:
        expect = [n if row.frac >= 1 else max(1, min(math.floor(float(np.float32(row.frac)) * n + 0.5), n - 1))
                  for n in (4, 2, 8)]
        assert [r for _, _, r, _ in row.layers] == expect
    assert any("KV heads differ per layer" in n for n in p.notes)


def test_choice_is_the_largest_g_that_fits(all_models):
    info = read_model_info(all_models["qwen2"])
    base = plan_kv(info, 8192, type_k="q8_0", type_v="q8_0")
    for budget in sorted({r.device_total for r in base.rows}):
        p = plan_kv(info, 8192, budget, type_k="q8_0", type_v="q8_0")
        assert p.chosen.g == max(r.g for r in p.rows if r.device_total <= budget)
        assert p.frac == frac_for_g(p.chosen.g, 4)
        assert frac_for_budget(info, 8192, budget, type_k="q8_0", type_v="q8_0") == p.frac
        with_margin = plan_kv(info, 8192, budget + 1000, type_k="q8_0", type_v="q8_0", margin=1000)
        assert with_margin.chosen == p.chosen


def test_rows_scale_with_g(all_models):
    """Device KV grows by one head's bytes per layer for every g; device + host KV is constant."""
    p = plan_kv(all_models["gemma3-iswa"], 2048, swa_full=False)
    totals = {r.device_kv + r.host_kv for r in p.rows}
    assert len(totals) == 1
    steps = {b.device_kv - a.device_kv for a, b in zip(p.rows, p.rows[1:])}
    assert len(steps) == 1 and steps.pop() > 0
    assert p.rows[-1].n_split == 0 and all(r.n_split == 4 for r in p.rows[:-1])


def test_budget_smaller_than_weights(all_models):
    with pytest.raises(BudgetTooSmallError, match="smaller than the weights"):
        frac_for_budget(all_models["llama-gqa"], 4096, "1MiB")
    p = plan_kv(all_models["llama-gqa"], 4096, "1MiB")
    assert p.chosen is None
    with pytest.raises(BudgetTooSmallError):
        p.frac


def test_nothing_fits_says_what_would(all_models):
    info = read_model_info(all_models["qwen2"])
    full = plan_kv(info, 32768, n_gpu_layers=-1)
    budget = min(r.device_total for r in full.rows) - 1  # more than the weights, less than any row
    assert budget > full.weights.device_alloc
    p = plan_kv(info, 32768, budget)
    assert p.chosen is None and p.suggestions
    with pytest.raises(NothingFitsError, match="What would fit") as exc:
        frac_for_budget(info, 32768, budget)
    assert "fewer GPU layers" in str(exc.value) and "a shorter context" in str(exc.value)
    assert "a quantized KV cache" in str(exc.value)
    # each suggestion is a real fit: check the shorter context one
    n_ctx = int(next(s for s in p.suggestions if s.startswith("a shorter context")).split("n_ctx ")[1].split(" ")[0])
    assert plan_kv(info, n_ctx, budget).chosen is not None
    assert plan_kv(info, n_ctx + 256, budget).chosen is None


@pytest.mark.parametrize("make, error", [
    (lambda tmp, models: tmp / "missing.gguf", FileNotFoundError),
    (lambda tmp, models: tmp, IsADirectoryError),
    (lambda tmp, models: (tmp / "x.gguf").write_bytes(b"not a gguf at all, just text" * 4) and tmp / "x.gguf",
     "not a GGUF model"),
    (lambda tmp, models: _truncated(models["llama-gqa"], tmp / "t.gguf"), "truncated"),
    (lambda tmp, models: models["mamba"], "architecture 'mamba' is not supported"),
])
def test_bad_model_files(tmp_path, gguf_models, extra_models, make, error):
    path = make(tmp_path, {**gguf_models, **extra_models})
    if isinstance(error, str):
        with pytest.raises(Exception, match=error) as exc:
            plan_kv(path, 512)
        from pyllama_headinfer.errors import HeadInferError

        assert isinstance(exc.value, HeadInferError)
    else:
        with pytest.raises(error):
            plan_kv(path, 512)


def _truncated(src, dst):
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


@pytest.mark.parametrize("kw", [dict(type_k="q3_k"), dict(n_seq_max=0), dict(n_seq_max=300), dict(n_ctx=-1),
                                dict(n_batch=0), dict(n_gpu_layers=1.5)])
def test_bad_settings(all_models, kw):
    args = dict(n_ctx=512)
    args.update(kw)
    with pytest.raises(ValueError):
        plan_kv(all_models["llama-gqa"], **args)


def test_one_kv_type_table():
    """The planner and the API read the KV types from one table (params.KV_CACHE_TYPES): each is a
    ggml type gguf knows, so the planner can size it."""
    from gguf import GGMLQuantizationType

    from pyllama_headinfer.vram.memory import ggml_type

    assert [ggml_type(t) for t in KV_CACHE_TYPES] == [GGMLQuantizationType[t.upper()] for t in KV_CACHE_TYPES]
    with pytest.raises(ValueError):
        ggml_type("q3_k")


def test_force_split_env(monkeypatch):
    for value, expected in (("1", True), ("0", False), ("", False), ("2x", True), ("no", False)):
        assert force_split_from_env({FORCE_SPLIT: value}) is expected
    assert force_split_from_env({}) is False


# --------------------------------------------------------------------------
# the CLI


def test_cli_table_and_choice(gguf_models, capsys):
    info = read_model_info(gguf_models["gemma3-iswa"])
    p = plan_kv(info, 4096, swa_full=False)
    budget = p.row(1).device_total  # g = 1 fits; more heads cost more (the split rows) or as much (unsplit)
    chosen = plan_kv(info, 4096, budget, swa_full=False).chosen
    assert main("--model", gguf_models["gemma3-iswa"], "--ctx", 4096, "--vram", budget, "--no-swa-full",
                "--layers") == 0
    out, err = capsys.readouterr()
    assert "model: gemma3-iswa.gguf (gemma3, 4 layers, 4 KV heads per layer" in out
    assert "sliding window: 16 tokens on 2 of 4 layers" in out
    lines = [line for line in out.splitlines() if line.strip()[:1].isdigit() and "frac" not in line]
    assert [int(line.split()[0]) for line in lines[:4]] == [1, 2, 3, 4]
    assert f"choice: g = {chosen.g} of 4" in out
    assert sum("<- chosen" in line for line in out.splitlines()) == 1
    assert f"layers at g = {chosen.g}:" in out
    assert err == ""


def test_cli_exact_bytes_and_json(gguf_models, capsys):
    assert main("-m", gguf_models["qwen2"], "-c", 2048, "--bytes") == 0
    out = capsys.readouterr().out
    p = plan_kv(gguf_models["qwen2"], 2048)
    assert f" {p.row(2).device_kv} " in out and "no budget given" in out
    assert main("-m", gguf_models["qwen2"], "-c", 2048, "--json", "--vram", "1GiB", "--n-seq", 2) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["chosen"] == {"g": 4, "frac": 1.0} and d["geometry"]["n_stream"] == 2 and len(d["rows"]) == 4


def test_cli_nothing_fits(gguf_models, capsys):
    assert main("-m", gguf_models["llama-gqa"], "-c", 4096, "--vram", "1MiB") == 1
    out, err = capsys.readouterr()
    assert "device total" in out  # the table is still there
    assert err.startswith("error: the budget (1.00 MiB) is smaller than the weights")


@pytest.mark.parametrize("args, status, message", [
    (["-m", "/nonexistent/model.gguf", "-c", 512], 2, "model file not found"),
    (["-m", "{mamba}", "-c", 512], 1, "architecture 'mamba' is not supported"),  # a plan that cannot be made
    (["-m", "{llama-gqa}", "-c", 512, "--vram", "lots"], 2, "cannot read 'lots' as a size"),
    (["-m", "{llama-gqa}", "-c", 512, "--margin", "x"], 2, "cannot read 'x' as a size"),
])
def test_cli_bad_input(gguf_models, extra_models, capsys, args, status, message):
    paths = {**gguf_models, **extra_models}
    args = [a.format(**{k: str(v) for k, v in paths.items()}) if isinstance(a, str) else a for a in args]
    assert main(*args) == status
    assert message in capsys.readouterr().err


def test_cli_usage_error(capsys):
    assert main("--ctx", 512) == 2  # no --model
    assert main("-m", "x.gguf", "-c", 512, "--type-k", "q3_k") == 2


# --------------------------------------------------------------------------
# against llama.cpp's allocation (the CPU build, LLAMA_HEADINFER_FORCE_SPLIT=1)


@pytest.fixture(scope="module")
def opened(residency_llama, all_models):
    models = {name: residency_llama.Model(path) for name, path in all_models.items()}
    yield models
    for m in models.values():
        m.close()


@pytest.fixture
def force_split(monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")


# (context kwargs, plan kwargs): n_batch = n_ubatch unless given
CONFIGS = {
    "f16": dict(n_ctx=300),
    "q8_0 streams": dict(n_ctx=1000, n_seq_max=3, kv_unified=False, swa_full=False, type_k="q8_0", type_v="q8_0",
                         n_batch=64),
    "mixed unified": dict(n_ctx=1000, n_seq_max=3, kv_unified=True, swa_full=False, type_k="f16", type_v="q4_0",
                          n_batch=100),
    "bf16 two streams swa_full": dict(n_ctx=513, n_seq_max=2, swa_full=True, type_k="bf16"),
    "f32 n_ctx 0": dict(n_ctx=0, swa_full=False, type_k="f32", type_v="f32"),
    "q8_0 window": dict(n_ctx=2048, swa_full=False, type_k="q8_0", type_v="q8_0", n_batch=512),
}


def _report_totals(report):
    res = [b for b in report["buffers"].values() if not b["headinfer_host"]]
    host = [b for b in report["buffers"].values() if b["headinfer_host"]]
    return ({"k": sum(b["k"] for b in res), "v": sum(b["v"] for b in res)},
            {"k": sum(b["k"] for b in host), "v": sum(b["v"] for b in host)})


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "gemma3-iswa", "llama-mqa"])
def test_kv_bytes_match_llama_cpp(residency_llama, opened, all_models, force_split, name, config):
    cfg = dict(CONFIGS[config])
    n_batch = cfg.pop("n_batch", 512)
    kw = dict(n_seq_max=1, kv_unified=False, swa_full=True, type_k="f16", type_v="f16")
    kw.update(cfg)
    n_ctx = kw.pop("n_ctx")
    info = read_model_info(all_models[name])
    p_dev = plan_kv(info, n_ctx, n_gpu_layers=-1, n_batch=n_batch, n_ubatch=n_batch, **kw)
    p_host = plan_kv(info, n_ctx, n_gpu_layers=0, force_split=True, n_batch=n_batch, n_ubatch=n_batch, **kw)
    assert p_dev.geometry == p_host.geometry
    n_split_seen = 0
    for g in range(1, p_dev.n_head_kv + 1):
        row = p_dev.row(g)
        with residency_llama.Context(opened[name], n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=1,
                                     headinfer_gpu_heads_frac=row.frac, **kw) as ctx:
            report = ctx.kv_residency()
            assert (ctx.n_ctx, ctx.n_ctx_seq) == (p_dev.geometry.n_ctx, p_dev.geometry.n_ctx_seq)
        predicted = p_dev.residency(g)
        resident, host_half = _report_totals(report)
        assert report["layers"] == predicted["layers"], (name, config, g)
        assert resident == predicted["resident"] and host_half == predicted["host_half"], (name, config, g)
        # on a GPU the resident bytes of offloaded layers are the device KV, the host halves are host KV
        assert row.device_kv == resident["k"] + resident["v"] and row.host_kv == host_half["k"] + host_half["v"]
        # force_split with every layer in host memory: the same split, no device bytes
        other = p_host.row(g)
        assert (other.layers, other.resident_k, other.resident_v, other.host_half_k, other.host_half_v) == \
            (row.layers, row.resident_k, row.resident_v, row.host_half_k, row.host_half_v)
        assert other.device_kv == 0 and other.host_kv == row.device_kv + row.host_kv
        n_split_seen += row.n_split
    assert (n_split_seen > 0) == (name != "llama-mqa")  # one KV head: never split


def test_no_flash_attention_means_no_split(residency_llama, opened, all_models, force_split):
    p = plan_kv(all_models["gemma3-iswa"], 512, flash_attn=False, swa_full=False)
    assert all(r.n_split == 0 for r in p.rows)
    with residency_llama.Context(opened["gemma3-iswa"], n_ctx=512, flash_attn=False, swa_full=False, n_threads=1,
                                 headinfer_gpu_heads_frac=0.5) as ctx:
        report = ctx.kv_residency()
    resident, host_half = _report_totals(report)
    assert resident == p.residency(2)["resident"] and host_half == {"k": 0, "v": 0}


def test_weights_match_llama_model_size(residency_llama, opened, all_models):
    for name, model in opened.items():
        w = weights(read_model_info(all_models[name]), 0)
        assert w.host == model.size, name  # untied outputs: every tensor once


# --------------------------------------------------------------------------
# Context(headinfer_vram_budget=...) and generate --vram-budget


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


@pytest.fixture
def api_log():
    logger = logging.getLogger("pyllama_headinfer.llama")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


# attention in chunks of 256 cells: the device holds one chunk of a split layer's host heads, so fewer resident heads
# need less device memory (with one attention per layer, the staged host heads of these small models outweigh the
# heads they move out, and no budget picks g = 1)
CHUNKED = dict(headinfer_attn="chunked", headinfer_attn_chunk=256)


def _budget_for_g1(path, n_ctx, **kw):
    """A budget whose choice is g = 1: the g = 1 row's total, which every other row exceeds."""
    p = plan_kv(path, n_ctx, n_gpu_layers=-1, force_split=True, **kw)
    budget = p.row(1).device_total
    assert all(r.device_total > budget for r in p.rows[1:]), [(r.g, r.device_total) for r in p.rows]
    return budget


def test_context_vram_budget(residency_llama, opened, all_models, force_split, api_log):
    budget = _budget_for_g1(all_models["llama-gqa"], 1024, n_batch=64, n_ubatch=64, **CHUNKED)
    with residency_llama.Context(opened["llama-gqa"], n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1,
                                 headinfer_vram_budget=budget, **CHUNKED) as ctx:
        assert ctx.headinfer_gpu_heads_frac == 0.25
        assert ctx.headinfer_plan.chosen.g == 1
        report = ctx.kv_residency()
        assert [x["n_head_resident"] for x in report["layers"]] == [1, 1, 1]
        assert _report_totals(report) == (ctx.headinfer_plan.residency()["resident"],
                                          ctx.headinfer_plan.residency()["host_half"])
    assert any("headinfer_vram_budget" in m and "g = 1 of 4" in m for m in api_log), api_log


def test_context_vram_budget_as_string(residency_llama, opened, force_split):
    with residency_llama.Context(opened["qwen2"], n_ctx=512, n_threads=1, headinfer_vram_budget="1GiB") as ctx:
        assert ctx.headinfer_gpu_heads_frac == 1.0 and ctx.headinfer_plan.chosen.g == 4  # everything fits


def test_context_vram_budget_errors(residency_llama, opened, force_split):
    with pytest.raises(ValueError, match="not both"):
        residency_llama.Context(opened["llama-gqa"], n_ctx=512, headinfer_gpu_heads_frac=0.5,
                                headinfer_vram_budget="1GiB")
    with pytest.raises(BudgetTooSmallError, match="smaller than the weights") as exc:
        residency_llama.Context(opened["llama-gqa"], n_ctx=512, headinfer_vram_budget="1MiB")
    assert isinstance(exc.value, ValueError)
    with pytest.raises(ValueError, match="as a size"):
        residency_llama.Context(opened["llama-gqa"], n_ctx=512, headinfer_vram_budget="a lot")


def test_context_vram_budget_auto_is_the_free_device_memory(residency_llama, opened, all_models, force_split,
                                                            monkeypatch, api_log):
    """"auto": the free memory of the model's devices (here the CPU, FORCE_SPLIT's stand-in for a GPU) less llama.cpp's
    1 GiB --fit margin, plus the weights already there: a device that leaves the g = 1 total picks what that
    budget picks."""
    from pyllama_headinfer.api import devices
    from pyllama_headinfer.vram.memory import weights
    from pyllama_headinfer.vram.model import read_model_info
    from pyllama_headinfer.vram.plan import AUTO_VRAM_BUDGET_MARGIN, auto_vram_budget

    budget = _budget_for_g1(all_models["llama-gqa"], 1024, n_batch=64, n_ubatch=64, **CHUNKED)
    on_device = weights(read_model_info(all_models["llama-gqa"]), -1).device_alloc
    asked = []

    def free(names):
        asked.append(list(names))
        return budget - on_device + AUTO_VRAM_BUDGET_MARGIN

    monkeypatch.setattr(devices, "device_free_bytes", free)
    with residency_llama.Context(opened["llama-gqa"], n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1,
                                 headinfer_vram_budget="auto", **CHUNKED) as ctx:
        assert ctx.headinfer_gpu_heads_frac == 0.25 and ctx.headinfer_plan.chosen.g == 1
        assert ctx.params.headinfer_vram_budget == budget
    assert asked == [["CPU"]]  # a CPU build: no GPU, the CPU stands for it
    assert any("'auto'" in m and "margin" in m for m in api_log), api_log
    assert auto_vram_budget(all_models["llama-gqa"], 0, free(["CPU"]), 1, gpu_offload=False) == budget

    monkeypatch.setattr(devices, "device_free_bytes", lambda names: 10 << 30)  # plenty: nothing to split
    with residency_llama.Context(opened["llama-gqa"], n_ctx=1024, n_batch=64, n_ubatch=64, n_threads=1,
                                 headinfer_vram_budget="auto", **CHUNKED) as ctx:
        assert ctx.headinfer_gpu_heads_frac == 1.0


def test_vram_budget_auto_is_not_a_size_for_the_planner():
    params = ContextParams(n_ctx=512, headinfer_vram_budget="auto")
    with pytest.raises(ValueError, match="known once a model is loaded"):
        params.vram_budget_bytes


def test_device_free_bytes_of_an_unknown_device_is_an_error(llama):
    from pyllama_headinfer.api.devices import device_free_bytes
    from pyllama_headinfer.errors import HeadInferError

    with pytest.raises(HeadInferError, match="unknown device"):
        device_free_bytes(["NOPE0"])
    assert device_free_bytes(["CPU"]) > 0


def test_context_vram_budget_without_gpu_or_force(residency_llama, opened, monkeypatch, api_log):
    lib = opened["qwen2"]._lib
    if lib.llama_supports_gpu_offload():
        pytest.skip("a GPU build: the budget is planned for the GPU")
    monkeypatch.delenv(FORCE_SPLIT, raising=False)
    with residency_llama.Context(opened["qwen2"], n_ctx=512, n_threads=1, headinfer_vram_budget="1MiB") as ctx:
        assert ctx.headinfer_gpu_heads_frac == 1.0 and ctx.headinfer_plan is None
    assert any("ignored: this build has no GPU offload" in m for m in api_log)


def test_generate_vram_budget(residency_llama, all_models, force_split, capsys):
    from pyllama_headinfer.cli import main as cli

    budget = _budget_for_g1(all_models["llama-gqa"], 1024, n_batch=512, n_ubatch=512, **CHUNKED)
    args = ["generate", "-m", str(all_models["llama-gqa"]), "-p", "Once upon a time", "-n", "3", "--ctx", "1024",
            "--temp", "0", "--threads", "1", "--no-stream", "--headinfer-attn", "chunked", "--headinfer-attn-chunk",
            "256"]
    assert cli.main(args + ["--vram-budget", str(budget)]) == 0
    err = capsys.readouterr().err
    assert "headinfer_gpu_heads_frac: 0.25" in err and "choice: g = 1 of 4" in err
    assert "layer   0: 1/4 heads resident" in err
    for frac in ("0.5", "1.0"):  # both given: refused whatever the fraction (usage error)
        assert cli.main(args + ["--vram-budget", "1GiB", "--frac", frac]) == 2
        assert "not allowed with argument" in capsys.readouterr().err
    assert cli.main(args + ["--vram-budget", "1MiB"]) == 1
    assert "smaller than the weights" in capsys.readouterr().err


def test_shared_fixture_models_unchanged(gguf_models):
    """The plan reads the shared cached models; it must never write to them."""
    before = {n: p.stat().st_mtime_ns for n, p in gguf_models.items()}
    for p in gguf_models.values():
        plan_kv(p, 512, "1GiB")
    assert before == {n: p.stat().st_mtime_ns for n, p in gguf_models.items()}


def test_metadata_arrays_and_tied_output(tmp_path):
    """A gemma3-style file with per-layer KV heads, an SWA pattern array, a
    separate SWA head size and tied embeddings (metadata and tiny tensors
    only: the plan never loads it)."""
    import gguf

    path = tmp_path / "arrays.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(8192)
    w.add_embedding_length(64)
    w.add_block_count(4)
    w.add_feed_forward_length(128)
    w.add_head_count(8)
    w.add_head_count_kv([4, 2, 4, 8])
    w.add_key_length(32)
    w.add_value_length(32)
    w.add_key_length_swa(64)
    w.add_value_length_swa(64)
    w.add_sliding_window(100)
    w.add_sliding_window_pattern([True, True, False, True])
    w.add_token_list([f"t{i}" for i in range(100)])
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float16))
    w.add_tensor("output_norm.weight", np.zeros(64, dtype=np.float32))
    for il in range(4):
        w.add_tensor(f"blk.{il}.attn_k.weight", np.zeros((64, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    info = read_model_info(path)
    assert info.n_head_kv == (4, 2, 4, 8) and info.is_swa == (True, True, False, True) and info.tied_output
    assert [info.head_k_of(il) for il in range(4)] == [64, 64, 32, 64]
    p = plan_kv(info, 1024, n_ubatch=256, n_batch=256, swa_full=False)
    assert p.geometry.cells_base == 1024 and p.geometry.cells_swa == 512  # pad(min(1024, 100 + 256), 256)
    assert [(x.il, x.is_swa, x.cells, x.head_k) for x in p.layers] == \
        [(0, True, 512, 64), (1, True, 512, 64), (2, False, 1024, 32), (3, True, 512, 64)]
    row = p.row(4)  # g = 4 of 8: f = 0.5
    assert [r for _, _, r, _ in row.layers] == [2, 1, 2, 4]
    f16 = 2
    assert row.resident_k == f16 * (2 * 64 * 512 + 1 * 64 * 512 + 2 * 32 * 1024 + 4 * 64 * 512)
    assert row.host_half_k == f16 * (2 * 64 * 512 + 1 * 64 * 512 + 2 * 32 * 1024 + 4 * 64 * 512)
    emb = 100 * 64 * 2
    assert p.weights.host == emb and p.weights.device == emb + 64 * 4 + 4 * 64 * 64 * 2  # output = token_embd


def test_fast_reader_agrees_with_gguf_reader(all_models, tmp_path):
    """plan reads the metadata with its own walk (GGUFReader needs seconds for
    a 128k vocabulary); both must see the same keys, values and tensors."""
    from gguf import GGUFReader, GGUFValueType

    for path in all_models.values():
        kv, tensors = gguf_index(path)
        r = GGUFReader(path)
        fields = {k: f for k, f in r.fields.items() if not k.startswith("GGUF.")}
        assert set(kv) == set(fields)
        for key, f in fields.items():
            if f.types[0] == GGUFValueType.ARRAY:
                assert kv[key].count == len(f.data)
                if f.types[-1] != GGUFValueType.STRING:
                    assert list(kv[key].values) == [f.parts[i].tolist()[0] for i in f.data]
            elif f.types[0] == GGUFValueType.STRING:
                assert kv[key] == bytes(f.parts[-1]).decode()
            else:
                assert kv[key] == pytest.approx(f.parts[-1].tolist()[0])
        assert [(n, t, ne, b) for n, t, ne, b in tensors] == \
            [(t.name, int(t.tensor_type), [int(x) for x in t.shape], int(t.n_bytes)) for t in r.tensors]


# --------------------------------------------------------------------------
# chunked attention (headinfer_attn = "chunked"): the arena


def test_chunked_arena_is_fixed_by_the_chunk(all_models):
    # one attention per layer: the staging slots and the joined K/V of a split layer grow with the context; in
    # chunks of cells they are one chunk's, whatever the context
    m = all_models["llama-gqa"]
    joined = [plan_kv(m, n).row(2).arena for n in (32768, 131072)]
    chunked = [plan_kv(m, n, headinfer_attn="chunked").row(2).arena for n in (65536, 262144)]
    assert joined[1] == 4 * joined[0] > 0
    # chunks of 32768 cells (the model's default: 32 MiB of 4 KV heads of 64 in F16), as joined at 32768
    assert chunked[0] == chunked[1] == joined[0]
    assert plan_kv(m, 65536, headinfer_attn="chunked", headinfer_attn_chunk=4096).row(2).arena == chunked[0] // 8
    assert plan_kv(m, 65536, headinfer_attn="chunked").row(4).arena == 0  # frac 1.0: nothing streams
    # the compute estimate carries the arena: smaller than one attention per layer's at long context
    assert plan_kv(m, 65536, headinfer_attn="chunked").row(2).compute < plan_kv(m, 65536).row(2).compute


def test_a_third_staging_slot_while_slots_are_small(all_models):
    # patch 0042: the scheduler stages the host heads in three slots while one holds at most 128 MiB, in two above
    m = all_models["llama-gqa"]  # 4 KV heads of 64, f16: at g = 1, 3 heads (768 bytes a cell) in host memory
    host, joined = 3 * 64 * 2 * 2, 4 * 64 * 2 * 2
    for n_ctx, slots in ((131072, 3), (262144, 2)):  # slots of 96 and 192 MiB
        assert plan_kv(m, n_ctx).row(1).arena == (slots * host + joined) * n_ctx, n_ctx


def test_cli_chunked_json_and_bad_chunk(gguf_models, capsys):
    m = gguf_models["llama-gqa"]
    assert main("-m", m, "-c", 65536, "--headinfer-attn", "chunked", "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["settings"]["attn_chunk"] == 32768  # the model's default
    assert [r["arena"] for r in d["rows"]] == \
        [plan_kv(m, 65536, headinfer_attn="chunked").row(g).arena for g in range(1, 5)]
    assert main("-m", m, "-c", 65536, "--headinfer-attn", "chunked", "--headinfer-attn-chunk", 100) == 2
    assert "multiple of 256" in capsys.readouterr().err


def test_nothing_fits_suggests_chunks(all_models):
    # a budget between the chunked total of g = 1 and the smallest joined total (on this 3-layer model frac 1.0's:
    # a split layer's staging slots and joined heads cost more than its host heads save): only chunks fit
    m = all_models["llama-gqa"]
    joined = min(r.device_total for r in plan_kv(m, 65536).rows)
    chunked = plan_kv(m, 65536, headinfer_attn="chunked").row(1).device_total
    assert chunked < joined
    budget = (chunked + joined) // 2
    p = plan_kv(m, 65536, budget)
    assert p.chosen is None
    g = plan_kv(m, 65536, budget, headinfer_attn="chunked").chosen.g
    assert p.suggestions[0].startswith(f"attention in chunks: headinfer_attn = 'chunked' (g = {g} of 4")
