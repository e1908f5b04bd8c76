"""HeadInfer on the CPU: greedy decoding with a fraction of each layer's KV
heads moved to the separately allocated host half must give bit-identical
tokens and logits to the unsplit cache, and the residency report must show
that the split was really active.  Plus the ``generate`` CLI.

CPU-only builds split layers only with ``LLAMA_HEADINFER_FORCE_SPLIT=1`` (read
when the KV cache is built), which these tests set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, describe_choice, find_manifest
from testing_models import CORPUS, FORCE_SPLIT, SPECS, SPLIT_TEST_MODELS

ROOT = Path(__file__).resolve().parents[1]
SPLIT_FRACS = (0.75, 0.5, 0.25, 0.0)
N_PROMPT = 40  # >= 32
N_GEN = 64
THREADS = 1  # the test machines are small and shared; threads only slow tiny models down


@pytest.fixture(scope="module")
def force_split():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FORCE_SPLIT, "1")
        yield


def expected_resident(frac: float, n_head_kv: int) -> int:
    """Heads kept in the layer's own buffer: round(frac * n), at least one on
    each side of the split (the rule of the C++ side)."""
    return min(max(round(frac * n_head_kv), 1), n_head_kv - 1)


@dataclass
class Trace:
    tokens: list = field(default_factory=list)
    logits: list = field(default_factory=list)  # float32 arrays, one per step
    report: dict | None = None


def prompt_of(model) -> list:
    toks = model.tokenize(CORPUS)
    assert len(toks) >= N_PROMPT
    return toks[:N_PROMPT]


def context(llama, model, frac, **kw):
    params = dict(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=THREADS, flash_attn=True)
    params.update(kw)
    return llama.Context(model, headinfer_gpu_heads_frac=frac, **params)


def greedy_trace(llama, model, frac, n_gen=N_GEN, **kw) -> Trace:
    """Decode the prompt, then greedily n_gen tokens; logits at every step."""
    t = Trace()
    with context(llama, model, frac, **kw) as ctx, llama.Sampler.greedy() as greedy:
        t.report = ctx.kv_residency()
        ctx.decode(prompt_of(model))
        for step in range(n_gen):
            t.logits.append(ctx.logits())
            tok = greedy.sample(ctx)
            t.tokens.append(tok)
            if step + 1 < n_gen:
                ctx.decode([tok])
    return t


def assert_bit_identical(a: Trace, b: Trace, what: str) -> None:
    assert a.tokens == b.tokens, f"{what}: token streams differ"
    assert len(a.logits) == len(b.logits)
    for step, (x, y) in enumerate(zip(a.logits, b.logits)):
        if not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
            diff = np.abs(x - y).max()
            raise AssertionError(f"{what}: logits differ at step {step} (max |diff| {diff:g})")


def kv_totals(report: dict, host: bool | None = None) -> tuple[int, int]:
    bufs = [b for b in report["buffers"].values() if host is None or b["headinfer_host"] == host]
    return sum(b["k"] for b in bufs), sum(b["v"] for b in bufs)


def assert_split_active(report: dict, baseline: dict, frac: float, n_head_kv: int, n_layer: int) -> None:
    """The report shows a separate host half holding the non-resident heads."""
    assert report is not None
    hosts = [name for name, b in report["buffers"].items() if b["headinfer_host"]]
    assert hosts, f"no headinfer host buffer in {report['buffers']}"
    host_k, host_v = kv_totals(report, host=True)
    assert host_k > 0 and host_v > 0
    layers = report["layers"]
    assert len(layers) == n_layer
    resident = expected_resident(frac, n_head_kv)
    for x in layers:
        assert x["n_head_kv"] == n_head_kv
        assert x["n_head_resident"] == resident, x
    # bytes: the host half holds exactly the moved heads, nothing is duplicated
    base_k, base_v = kv_totals(baseline)
    res_k, res_v = kv_totals(report, host=False)
    moved = n_head_kv - resident
    assert host_k * n_head_kv == base_k * moved and host_v * n_head_kv == base_v * moved, (report, baseline)
    assert res_k + host_k == base_k and res_v + host_v == base_v


# --------------------------------------------------------------------------
# the core test: bit-identical greedy decoding under every split


@pytest.fixture(scope="module")
def baselines(llama, models, residency_llama, force_split):
    return {name: greedy_trace(llama, models[name], 1.0) for name in SPLIT_TEST_MODELS}


@pytest.mark.parametrize("frac", SPLIT_FRACS)
@pytest.mark.parametrize("name", SPLIT_TEST_MODELS)
def test_split_is_bit_identical(llama, models, baselines, force_split, name, frac):
    base = baselines[name]
    assert not any(b["headinfer_host"] for b in base.report["buffers"].values())
    assert all(x["n_head_resident"] == x["n_head_kv"] for x in base.report["layers"])
    split = greedy_trace(llama, models[name], frac)
    spec = SPECS[name]
    assert_split_active(split.report, base.report, frac, spec.n_head_kv, spec.n_layer)
    assert len(split.tokens) == N_GEN and len(set(split.tokens)) > 4, "degenerate token stream"
    assert_bit_identical(base, split, f"{name} frac={frac}")


@pytest.mark.parametrize("name", SPLIT_TEST_MODELS)
def test_generate_api_under_split(llama, models, baselines, force_split, name):
    model = models[name]
    with context(llama, model, 0.5) as ctx:
        out = list(ctx.generate(prompt_of(model), N_GEN, stop_at_eog=False))
        assert ctx.kv_residency()["layers"][0]["n_head_resident"] == 2
    assert out == baselines[name].tokens


def test_split_iswa_gemma3(llama, models, residency_llama, force_split):
    """gemma3: sliding-window and global layers, both split."""
    model = models["gemma3-iswa"]
    base = greedy_trace(llama, model, 1.0, n_gen=32)
    split = greedy_trace(llama, model, 0.5, n_gen=32)
    layers = split.report["layers"]
    assert {x["is_swa"] for x in layers} == {True, False}
    assert all(x["n_head_resident"] == 2 for x in layers), layers
    assert any(b["headinfer_host"] for b in split.report["buffers"].values())
    assert_bit_identical(base, split, "gemma3 frac=0.5")


# --------------------------------------------------------------------------
# the split under other operations: same procedure at frac 1.0 and 0.5


def _multi_ubatch(llama, model, frac):
    return greedy_trace(llama, model, frac, n_gen=16, n_batch=64, n_ubatch=16)


def _seq_rm_redecode(llama, model, frac):
    t = Trace()
    prompt = prompt_of(model)
    with context(llama, model, frac) as ctx, llama.Sampler.greedy() as greedy:
        ctx.decode(prompt)
        assert ctx.seq_rm(0, 30, -1)
        ctx.decode(prompt[30:])
        for _ in range(16):
            t.logits.append(ctx.logits())
            t.tokens.append(greedy.sample(ctx))
            ctx.decode(t.tokens[-1:])
    return t


def _seq_cp_streams(llama, model, frac):
    """Non-unified cache: seq_cp copies K/V (both halves) between streams."""
    t = Trace()
    prompt = prompt_of(model)
    with context(llama, model, frac, n_ctx=512, n_seq_max=2, kv_unified=False) as ctx, \
            llama.Sampler.greedy() as greedy:
        ctx.decode(prompt[:-1], seq_id=0)
        ctx.seq_cp(0, 1)
        ctx.seq_rm(0)
        ctx.decode(prompt[-1:], seq_id=1)
        for _ in range(16):
            t.logits.append(ctx.logits())
            t.tokens.append(greedy.sample(ctx))
            ctx.decode(t.tokens[-1:], seq_id=1)
    return t


def _state_roundtrip(llama, model, frac):
    """Save after the prompt (minus its last token), restore into a fresh context."""
    t = Trace()
    prompt = prompt_of(model)
    with context(llama, model, frac) as ctx:
        ctx.decode(prompt[:-1])
        state = ctx.save_state()
    with context(llama, model, frac) as ctx, llama.Sampler.greedy() as greedy:
        ctx.load_state(state)
        ctx.decode(prompt[-1:])
        for _ in range(16):
            t.logits.append(ctx.logits())
            t.tokens.append(greedy.sample(ctx))
            ctx.decode(t.tokens[-1:])
    return t


@pytest.mark.parametrize("scenario", [_multi_ubatch, _seq_rm_redecode, _seq_cp_streams, _state_roundtrip],
                         ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("name", SPLIT_TEST_MODELS)
def test_split_scenarios(llama, models, residency_llama, force_split, name, scenario):
    model = models[name]
    assert_bit_identical(scenario(llama, model, 1.0), scenario(llama, model, 0.5), f"{name} {scenario.__name__}")


@pytest.mark.parametrize("save_frac, load_frac", [(1.0, 0.5), (0.5, 1.0), (0.25, 0.75)])
def test_state_across_fracs(llama, models, residency_llama, force_split, save_frac, load_frac):
    """A state saved with one split loads into a context with another."""
    model = models["llama-gqa"]
    prompt = prompt_of(model)
    with context(llama, model, save_frac) as ctx:
        ctx.decode(prompt[:-1])
        state = ctx.save_state()
    runs = []
    for frac, restore in ((load_frac, True), (load_frac, False)):
        with context(llama, model, frac) as ctx:
            if restore:
                ctx.load_state(state)
            else:
                ctx.decode(prompt[:-1])
            ctx.decode(prompt[-1:])
            runs.append(ctx.logits())
    np.testing.assert_array_equal(runs[0], runs[1])


# --------------------------------------------------------------------------
# when the split does not apply


def test_no_split_without_force_on_cpu(llama, models, residency_llama, monkeypatch):
    """CPU-only: the KV is in host memory already, nothing is split unless forced."""
    monkeypatch.delenv(FORCE_SPLIT, raising=False)
    model = models["llama-gqa"]
    with context(llama, model, 0.5) as ctx:
        report = ctx.kv_residency()
    assert not any(b["headinfer_host"] for b in report["buffers"].values())
    assert all(x["n_head_resident"] == x["n_head_kv"] for x in report["layers"])


def test_no_split_without_flash_attention(llama, models, residency_llama, force_split):
    """A transposed V cache (flash attention off) is not split; results unchanged."""
    model = models["qwen2"]
    base = greedy_trace(llama, model, 1.0, n_gen=8, flash_attn=False)
    other = greedy_trace(llama, model, 0.5, n_gen=8, flash_attn=False)
    assert not any(b["headinfer_host"] for b in other.report["buffers"].values())
    assert all(x["n_head_resident"] == x["n_head_kv"] for x in other.report["layers"])
    assert_bit_identical(base, other, "qwen2 without flash attention")


# --------------------------------------------------------------------------
# the generate CLI


def _cli(*args: str) -> int:
    from pyllama_headinfer.cli import main as cli

    return cli.main(["generate", *args])


def test_cli_generate(llama, gguf_models, capsys):
    rc = _cli("--model", str(gguf_models["llama-gqa"]), "--prompt", "Once upon a time", "-n", "12",
              "--temp", "0", "--ctx", "256", "--threads", "1")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.strip()
    assert "tokens/s" in err
    assert "KV residency" in err
    assert "llama_model_loader" not in err  # llama.cpp's INFO chatter stays out without -v


def test_cli_output_matches_api(llama, gguf_models, models, capsys):
    model = models["qwen2"]
    with llama.Context(model, n_ctx=256, n_threads=THREADS) as ctx:
        expected = ctx.complete("Once upon a time", max_tokens=10)
    rc = _cli("--model", str(gguf_models["qwen2"]), "--prompt", "Once upon a time", "-n", "10",
              "--temp", "0", "--ctx", "256", "--threads", "1", "--no-stream")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == expected + "\n"


def test_cli_split_report(llama, gguf_models, residency_llama, force_split, capsys):
    rc = _cli("--model", str(gguf_models["llama-gqa"]), "--prompt", "Once upon a time", "-n", "8",
              "--frac", "0.5", "--seed", "3", "--ctx", "256", "--threads", "1")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "headinfer host" in err
    assert "2/4 heads resident" in err
    # the split decision, read from the residency report (not from llama.cpp's log text)
    assert "3 of 3 layers split (2/4 KV heads in the layer's own buffer)" in err


def test_cli_says_why_nothing_was_split(llama, gguf_models, residency_llama, capsys, monkeypatch):
    monkeypatch.delenv(FORCE_SPLIT, raising=False)
    rc = _cli("--model", str(gguf_models["llama-gqa"]), "--prompt", "Once upon a time", "-n", "2",
              "--frac", "0.5", "--ctx", "256", "--threads", "1")
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "0 of 3 layers split" in err
    # why, from llama.cpp's log, in the one-line HeadInferWarning the context gives
    assert "warning: headinfer_gpu_heads_frac = 0.5 is ignored" in err
    assert "the layer's KV is in host memory already" in err


@pytest.mark.parametrize("args, message", [
    (["--frac", "1.5"], "headinfer_gpu_heads_frac"),
    (["--frac", "nan"], "headinfer_gpu_heads_frac"),
    (["--frac", "1.0", "--vram-budget", "1GiB"], "not allowed with argument"),  # both: refused, whatever the values
    (["--vram-budget", "a lot"], "cannot read 'a lot' as a size"),
    (["--cache-type-k", "f8"], "type_k must be one of"),
    (["-n", "-1"], "-n must be >= 0"),
])
def test_cli_bad_input_exits_2(gguf_models, capsys, args, message):
    rc = _cli("--model", str(gguf_models["llama-gqa"]), "--prompt", "x", "-n", "2", *args)
    out, err = capsys.readouterr()
    assert rc == 2 and message in err and "Traceback" not in err


def test_cli_missing_model(tmp_path, capsys):
    rc = _cli("--model", str(tmp_path / "missing.gguf"), "--prompt", "x")
    out, err = capsys.readouterr()
    assert rc == 2 and "not found" in err


def test_cli_subprocess(llama, gguf_models, monkeypatch):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.setdefault(BUILD_DIR_ENV, str(find_manifest().build_dir))
    res = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "generate", "--model",
                          str(gguf_models["qwen2"]), "--prompt", "The baker", "-n", "6", "--temp", "0",
                          "--ctx", "128", "--threads", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() and "tokens/s" in res.stderr
    # which build, and why (issue 26): one line
    monkeypatch.setenv(BUILD_DIR_ENV, env[BUILD_DIR_ENV])
    expected = describe_choice(find_manifest())  # "using build/cpu (from $PYLLAMA_HEADINFER_BUILD_DIR)"
    assert expected.endswith(f" (from ${BUILD_DIR_ENV})")
    assert [line for line in res.stderr.splitlines() if line.startswith("using ")] == [expected], res.stderr
