"""The ``bench`` command and :mod:`pyllama_headinfer.api.bench` on the CPU.

The timings themselves are not asserted (benchmarks, not tests); what is: the
sweep covers every point in order, the KV bytes come from llama.cpp's
residency report and move between the device and the host columns as the
fraction says, and bad input is a one-line error that loads nothing.
"""

from __future__ import annotations

import json

import pytest

from pyllama_headinfer.api import bench
from pyllama_headinfer.cli import bench as bench_cli, main as cli

from testing_models import FORCE_SPLIT


@pytest.fixture
def force_split(monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")


def test_sweep_points_order_and_budget():
    points = bench.sweep_points([1.0, 0.5], [0, 64], [("f16", "f16"), ("q8_0", "f16")])
    assert [(p.type_k, p.type_v, p.depth, p.frac) for p in points] == [
        ("f16", "f16", 0, 1.0), ("f16", "f16", 0, 0.5), ("f16", "f16", 64, 1.0), ("f16", "f16", 64, 0.5),
        ("q8_0", "f16", 0, 1.0), ("q8_0", "f16", 0, 0.5), ("q8_0", "f16", 64, 1.0), ("q8_0", "f16", 64, 0.5)]
    assert points[4].kv == "q8_0/f16" and points[0].kv == "f16"
    budget = bench.sweep_points([1.0, 0.5], [128], [("f16", "f16")], vram_budget="1GiB")
    assert [(p.frac, p.vram_budget) for p in budget] == [(None, "1GiB")]


def test_parse_kv_types():
    assert bench_cli.parse_kv_types("f16, Q8_0,q8_0:f16") == [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16")]


def test_filler_tokens_are_plain_and_exact_length(models):
    model = models["llama-gqa"]
    toks = bench.filler_tokens(model, 300)
    assert len(toks) == 300 and bench.filler_tokens(model, 0) == []
    assert not any(model.is_eog(t) for t in toks)


def test_run_point_measures_and_reports_residency(models, force_split):
    model = models["llama-gqa"]
    whole = bench.run_point(model, bench.BenchPoint(depth=64, frac=1.0), n_gen=4, n_batch=32)
    split = bench.run_point(model, bench.BenchPoint(depth=64, frac=0.5), n_gen=4, n_batch=32, repeat=2)
    assert whole.prompt_tps > 0 and whole.decode_tps > 0 and len(split.decode_tps_runs) == 2
    assert whole.host_kv_bytes == 0 and whole.n_layers_split == 0
    assert split.n_layers_split == split.n_layers == 3
    # half of the heads moved: the bytes are split evenly and nothing is lost
    assert split.device_kv_bytes == split.host_kv_bytes
    assert whole.device_kv_bytes == split.device_kv_bytes + split.host_kv_bytes
    depth0 = bench.run_point(model, bench.BenchPoint(depth=0, frac=0.5), n_gen=2)
    assert depth0.prompt_tps is None


def test_bench_cli_table_and_json(models, gguf_models, force_split, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "-m", str(gguf_models["llama-gqa"]), "--fracs", "1,0.25", "--depths", "0,32",
                   "--types", "f16,q8_0", "-n", "2", "--batch", "16", "--json", str(out), "--no-plot"])
    assert rc == 0
    text = capsys.readouterr().out
    table = text.split("\n\n")[0].splitlines()  # then the same points by device KV (the equal-VRAM view)
    assert table[0].split()[:3] == ["frac", "depth", "KV"]
    assert len(table) == 2 + 8  # header, rule, 2 fracs x 2 depths x 2 types
    assert "at depth 32, by device KV" in text
    rows = json.loads(out.read_text())
    assert [(r["frac"], r["depth"], r["type_k"]) for r in rows][:4] == [
        (1.0, 0, "f16"), (0.25, 0, "f16"), (1.0, 32, "f16"), (0.25, 32, "f16")]
    quarter = [r for r in rows if r["frac"] == 0.25]
    assert all(r["host_kv_bytes"] == 3 * r["device_kv_bytes"] for r in quarter)  # 1 of 4 heads resident


def test_bench_cli_measures_attention_in_chunks(gguf_models, force_split, tmp_path, capsys):
    """--headinfer-attn chunked: every point's context attends in chunks (the JSON says so), at every fraction."""
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "-m", str(gguf_models["llama-gqa"]), "--fracs", "1,0.5", "--depths", "600", "-n", "2",
                   "--batch", "256", "--headinfer-attn", "chunked", "--headinfer-attn-chunk", "256",
                   "--json", str(out), "--no-plot"])
    assert rc == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert [(r["frac"], r["headinfer_attn"], r["headinfer_attn_chunk"]) for r in rows] == [
        (1.0, "chunked", 256), (0.5, "chunked", 256)]
    assert all(r["error"] is None and r["decode_tps"] > 0 and r["prompt_tps"] > 0 for r in rows)
    assert rows[1]["n_layers_split"] == 3


def test_run_point_attends_in_the_points_mode(models, force_split):
    from pyllama_headinfer.runtime.log import capture_log

    point = bench.BenchPoint(depth=300, frac=0.5, headinfer_attn="chunked", headinfer_attn_chunk=256)
    with capture_log() as log:
        bench.run_point(models["llama-gqa"], point, n_gen=1, n_batch=128)
    assert any("every layer attends in chunks of 256 KV cells" in text for _, text in log)


def test_bench_cli_a_failing_point_is_reported_and_the_rest_measured(gguf_models, force_split, tmp_path, capsys):
    """A budget too small for the model fails every point at context creation: each is a 'failed' row
    with its reason, the JSON is still written, and the exit status says so."""
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "-m", str(gguf_models["llama-gqa"]), "--vram-budget", "1KiB", "--depths", "0,16",
                   "-n", "1", "--json", str(out), "--no-plot"])
    captured = capsys.readouterr()
    assert rc == 1 and "Traceback" not in captured.err
    assert captured.out.count("failed") == 2 and "not measured: depth 16" in captured.err
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(r["error"] for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["--types", "f16,q9_9"], "unknown KV type 'q9_9'"),
    (["--fracs", "1,abc"], "cannot read fractions"),
    (["--fracs", "1.5"], "headinfer_gpu_heads_frac"),
    (["--depths", "-4"], "cannot read depths"),
    (["--vram-budget", "8GiB", "--fracs", "0.5"], "not allowed with argument"),
    (["--vram-budget", "lots"], "cannot read 'lots' as a size"),
    (["-n", "0"], "must be >= 1"),
    (["--headinfer-attn", "chunked", "--headinfer-attn-chunk", "300"], "multiple of 256"),
    (["--headinfer-attn-chunk", "512"], "applies to headinfer_attn='chunked' only"),
    (["--headinfer-attn", "sideways"], "invalid choice"),
    (["--headinfer-attn", "parts"], "invalid choice"),
    (["--headinfer-stream", "off"], "unrecognized arguments"),
])
def test_bench_cli_bad_input_is_a_usage_error(argv, message, gguf_models, capsys):
    rc = cli.main(["bench", "-m", str(gguf_models["llama-gqa"]), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err


def test_bench_cli_missing_model(tmp_path, capsys):
    rc = cli.main(["bench", "-m", str(tmp_path / "nope.gguf"), "--depths", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "model file not found" in err and "Traceback" not in err


def test_kv_types_sweep_prints_the_equal_vram_table_and_calibrates(built, gguf_models, force_split, capsys,
                                                                    isolated_cache, tmp_path):
    """bench --kv-types f16,q8_0 (issue 17.4): the points again, ordered by device KV with exactness;
    --calibrate stores speed constants that plan then uses instead of the H200 defaults."""
    from pyllama_headinfer.vram import speed as plan_speed

    rc = cli.main(["bench", "--model", str(gguf_models["llama-gqa"]), "--kv-types", "f16,q8_0", "--fracs", "1,0.5",
                   "--depths", "0,64", "-n", "4", "--no-plot", "--calibrate", "--threads", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    table = out[out.index("at depth 64, by device KV"):]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip() and not line.startswith("at depth")]
    rows = rows[:4]
    assert [(r[0], r[1]) for r in rows] == [("q8_0", "0.5"), ("f16", "0.5"), ("q8_0", "1"), ("f16", "1")]
    assert [r[4] for r in rows] == ["no", "yes", "no", "yes"] and rows[3][3] == "1.00x"
    stored = plan_speed.load_calibration()
    assert stored is not plan_speed.H200_DEFAULTS and stored.source.startswith("calibrated with bench on")
    assert stored.kv_rate["f16"] > 0 and stored.kv_rate["q8_0"] > 0
