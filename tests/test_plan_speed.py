"""KV type x fraction ranked by the decode-speed model (issue 17): the model's
arithmetic, its calibration, and the choices plan/generate/serve make with it."""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from pyllama_headinfer.cli import main as cli
from pyllama_headinfer.cli import serve as serve_cli
from pyllama_headinfer.cli import generate as generate_cli
from pyllama_headinfer.cli.generate import kv_type_for_budget
from pyllama_headinfer.params import ContextParams
from pyllama_headinfer.vram import speed as plan_speed
from pyllama_headinfer.vram.gguf import read_gguf
from pyllama_headinfer.vram.plan import plan_kv
from pyllama_headinfer.vram.speed import H200_DEFAULTS, calibrate, predict_step_s, rank_options

GIB = 2**30


def test_prediction_matches_the_h200_measurements_it_was_fitted_to():
    """The defaults reproduce the H200 figures (8B shape, f16 split rows with the host heads streamed, patch 0018;
    docs/BENCHMARKS.md) within 5 %."""
    c, weights = H200_DEFAULTS, 4.58 * GIB
    kv_per_token = 128 * 1024  # f16 K+V of the 8B shape

    def tok_s(depth, frac, t="f16", per_token=kv_per_token):
        kv = depth * per_token
        host = kv * (1 - frac)
        return 1 / predict_step_s(c, weights_bytes=weights, type_k=t, type_v=t, kv_bytes_k=kv / 2,
                                  kv_bytes_v=kv / 2, host_kv_bytes=host, n_split_layers=32 if host else 0,
                                  split_kv_bytes=kv if host else 0)

    measured = {  # tok/s, llama-bench tg32 (tg16 at 128K) at that depth
        "f16 1.0 32K": (tok_s(32768, 1.0), 180.7),
        "q8_0 1.0 32K": (tok_s(32768, 1.0, "q8_0", 68 * 1024), 122.7),
        "q4_0 1.0 32K": (tok_s(32768, 1.0, "q4_0", 36 * 1024), 119.3),
        "f16 0.75 8K": (tok_s(8192, 0.75), 153.15), "f16 0.5 8K": (tok_s(8192, 0.5), 87.21),
        "f16 0.25 8K": (tok_s(8192, 0.25), 60.52), "f16 0.75 32K": (tok_s(32768, 0.75), 47.39),
        "f16 0.5 32K": (tok_s(32768, 0.5), 24.61), "f16 0.25 32K": (tok_s(32768, 0.25), 16.20),
        "f16 0.5 128K": (tok_s(131072, 0.5), 6.31), "f16 0.25 128K": (tok_s(131072, 0.25), 4.04)}
    for name, (predicted, seen) in measured.items():
        assert abs(predicted / seen - 1) < 0.05, (name, predicted, seen)


def test_overlapped_constants_take_the_max_of_copy_and_compute():
    c = replace(H200_DEFAULTS, split_layer_s=0.0, reassembly_s_per_byte=0.0, overlapped=False)
    kw = dict(weights_bytes=GIB, type_k="f16", type_v="f16", kv_bytes_k=GIB, kv_bytes_v=GIB,
              host_kv_bytes=GIB, n_split_layers=1, split_kv_bytes=0)
    serial = predict_step_s(c, **kw)
    overlapped = predict_step_s(replace(c, overlapped=True), **kw)
    t_link = GIB / c.link_rate
    t_gpu = GIB / c.weights_rate + 2 * GIB / c.kv_rate["f16"]
    assert t_link > t_gpu  # the link is the bottleneck here
    assert serial == pytest.approx(t_gpu + t_link) and overlapped == pytest.approx(t_link)


def test_calibration_recovers_the_constants_of_a_machine():
    truth = replace(H200_DEFAULTS, device="Fake GPU", weights_rate=0.9e12,
                    kv_rate={**H200_DEFAULTS.kv_rate, "f16": 1.5e12, "q8_0": 0.4e12},
                    kv_fixed={**H200_DEFAULTS.kv_fixed, "q8_0": 0.5e-3}, link_rate=24e9)
    weights, per_token = 4 * GIB, {"f16": 128 * 1024, "q8_0": 68 * 1024}
    points = []
    for t in ("f16", "q8_0"):
        for depth in (0, 8192, 32768):
            kv = depth * per_token[t]
            step = predict_step_s(truth, weights_bytes=weights, type_k=t, type_v=t, kv_bytes_k=kv / 2,
                                  kv_bytes_v=kv / 2, host_kv_bytes=0, n_split_layers=0, split_kv_bytes=0)
            points.append(dict(type_k=t, type_v=t, frac=1.0, depth=depth, decode_tok_s=1 / step,
                               weights_bytes=weights, kv_bytes_per_token=per_token[t], host_kv_bytes_per_token=0,
                               n_split_layers=0))
    kv, host = 32768 * per_token["f16"], 32768 * per_token["f16"] / 2
    step = predict_step_s(truth, weights_bytes=weights, type_k="f16", type_v="f16", kv_bytes_k=kv / 2,
                          kv_bytes_v=kv / 2, host_kv_bytes=host, n_split_layers=32, split_kv_bytes=kv)
    points.append(dict(type_k="f16", type_v="f16", frac=0.5, depth=32768, decode_tok_s=1 / step,
                       weights_bytes=weights, kv_bytes_per_token=per_token["f16"],
                       host_kv_bytes_per_token=per_token["f16"] / 2, n_split_layers=32))
    got = calibrate(points, "Fake GPU")
    assert got.weights_rate == pytest.approx(truth.weights_rate, rel=1e-6)
    assert got.kv_rate["f16"] == pytest.approx(1.5e12, rel=1e-6)
    assert got.kv_rate["q8_0"] == pytest.approx(0.4e12, rel=1e-6)
    assert got.kv_fixed["q8_0"] == pytest.approx(0.5e-3, rel=1e-6)
    assert got.link_rate == pytest.approx(24e9, rel=1e-6)
    assert got.source == "calibrated with bench on Fake GPU"


def test_calibration_files_per_device(isolated_cache):
    assert plan_speed.load_calibration() is H200_DEFAULTS  # nothing stored
    mine = replace(H200_DEFAULTS, device="My GPU 24GB", link_rate=20e9, source="calibrated with bench on My GPU")
    path = plan_speed.save_calibration(mine)
    assert path.parent == plan_speed.calibration_dir() and path.name == "My_GPU_24GB.json"
    assert plan_speed.load_calibration() == mine  # the only one stored
    assert plan_speed.load_calibration("My GPU 24GB") == mine
    assert plan_speed.load_calibration("Other") is H200_DEFAULTS


@pytest.fixture(scope="module")
def budget_between(tmp_path_factory):
    """A budget where the whole f16 cache does not fit but the whole q8_0 cache does. The model has 12 layers:
    a split keeps two layers' host halves in the scheduler's staging buffer, which on a 3-layer model would cost
    more than the split saves (on the 8B shape: 2 of 32 layers)."""
    from testing_models import SPECS, with_layers, write_model

    spec = with_layers(SPECS["llama-gqa"], 12)
    model = write_model(spec, tmp_path_factory.mktemp("models") / spec.filename)
    f16 = plan_kv(model, ContextParams(n_ctx=32768), n_gpu_layers=-1).rows[-1].device_total
    q8 = plan_kv(model, ContextParams(n_ctx=32768, type_k="q8_0", type_v="q8_0"),
                 n_gpu_layers=-1).rows[-1].device_total
    assert q8 < f16
    return model, (q8 + f16) // 2


def test_plan_names_q8_0_fastest_and_an_f16_split_fastest_exact(budget_between, capsys):
    model, budget = budget_between
    assert cli.main(["plan", "--model", str(model), "--ctx", "32768", "--vram", str(budget), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"type_k", "type_v", "frac", "device_bytes", "exact", "predicted_decode_tok_s"}
    assert out["options"] and all(keys <= set(o) for o in out["options"])
    assert out["fastest"]["type_k"] == "q8_0" and out["fastest"]["frac"] == 1.0 and not out["fastest"]["exact"]
    assert out["fastest_exact"]["type_k"] == "f16" and out["fastest_exact"]["frac"] < 1.0
    assert out["fastest_exact"]["device_bytes"] <= budget and out["fastest"]["device_bytes"] <= budget
    assert out["fastest"] in out["options"] and out["fastest_exact"] in out["options"]
    # the text form names both, with the command lines
    assert cli.main(["plan", "--model", str(model), "--ctx", "32768", "--vram", str(budget)]) == 0
    text = capsys.readouterr().out
    assert "fastest overall: K q8_0 / V q8_0, frac 1" in text and "fastest exact: K f16 / V f16" in text
    assert "--cache-type-k q8_0" in text


def test_the_printed_generate_commands_run_the_planned_context(budget_between, capsys):
    """Each command line plan prints gives generate the context it planned: the mode of attention, the chunk and
    the batch too (without them a plan that fits only in chunks would print a command that attends in one piece)."""
    model, budget = budget_between
    assert cli.main(["plan", "--model", str(model), "--ctx", "32768", "--vram", str(budget), "--batch", "256",
                     "--headinfer-attn", "chunked", "--headinfer-attn-chunk", "1024"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines()
             if line.strip().startswith("python -m pyllama_headinfer generate ")]
    assert len(lines) == 2, lines  # the fastest and the fastest exact
    for line in lines:
        parser = argparse.ArgumentParser()
        generate_cli.add_arguments(parser)
        params = generate_cli.context_params(parser.parse_args(shlex.split(line)[4:]))
        assert (params.n_ctx, params.n_batch, params.n_ubatch, params.flash_attn) == (32768, 256, 256, True), line
        assert (params.headinfer_attn, params.headinfer_attn_chunk) == ("chunked", 1024), line
        assert params.headinfer_gpu_heads_frac is not None and params.type_k in ("f16", "q8_0", "q4_0"), line


def test_generate_and_serve_pick_exact_unless_told(budget_between, tmp_path):
    model, budget = budget_between
    args = argparse.Namespace(ngl=-1, allow_quantized_kv=False)
    params = ContextParams(n_ctx=32768, headinfer_vram_budget=str(budget))
    opened = argparse.Namespace(gguf=read_gguf(model))  # what generate's Model read: no llama.cpp needed
    assert kv_type_for_budget(opened, params, args) == "f16"
    args.allow_quantized_kv = True
    assert kv_type_for_budget(opened, params, args) == "q8_0"
    for allow, want in ((False, "f16"), (True, "q8_0")):
        command = serve_cli.server_command(model, frac=None, vram_budget=str(budget), margin="0", host="127.0.0.1",
                                           port=8080, extra=["-c", "32768", "-np", "1"], server=Path("/bin/true"),
                                           allow_quantized_kv=allow)
        argv = command.argv
        assert argv[argv.index("-ctk") + 1] == want and argv[argv.index("-ctv") + 1] == want
        assert (command.frac < 1.0) == (want == "f16")
        assert "fastest overall" in command.notes[0] or allow


def test_serve_plans_the_attention_mode_it_passes_to_llama_server(budget_between):
    """serve --vram-budget -- --headinfer-attn chunked: the fraction is planned for attention in chunks (a split layer
    needs one chunk on the device, not its cells), not for one attention per layer, which needs more."""
    model, _ = budget_between
    chunked = ["--headinfer-attn", "chunked", "--headinfer-attn-chunk", "1024"]
    rows = {attn: plan_kv(model, ContextParams(n_ctx=32768, n_batch=2048, n_ubatch=512, headinfer_attn=attn,
                                               headinfer_attn_chunk=1024 if attn == "chunked" else 0),
                          n_gpu_layers=-1).rows for attn in ("joined", "chunked")}
    # a budget that fits g KV heads on the device in chunks but not one attention per layer
    g = next(i for i in range(len(rows["joined"]) - 2, -1, -1)
             if rows["chunked"][i].device_total < rows["joined"][i].device_total)
    budget = (rows["chunked"][g].device_total + rows["joined"][g].device_total) // 2
    fracs = {}
    for attn, extra in (("joined", []), ("chunked", chunked)):
        command = serve_cli.server_command(model, frac=None, vram_budget=str(budget), margin="0", host="127.0.0.1",
                                           port=8080, extra=["-c", "32768", "-ctk", "f16", "-ctv", "f16", *extra],
                                           server=Path("/bin/true"))
        fracs[attn] = command.frac
    assert fracs["chunked"] == rows["chunked"][g].frac, (fracs, g)
    assert fracs["joined"] < fracs["chunked"], fracs


def test_rank_options_without_budget_lists_everything(gguf_models):
    ranking = rank_options(gguf_models["llama-gqa"], ContextParams(n_ctx=4096), n_gpu_layers=-1)
    assert ranking.budget is None and all(o.fits for o in ranking.options)
    speeds = [o.predicted_decode_tok_s for o in ranking.options]
    assert speeds == sorted(speeds, reverse=True)
    assert {o.type_k for o in ranking.options} == {"f16", "q8_0", "q4_0"}
