"""``scripts/server_bench.py`` (issue 14, item 6) on the real llama-server: the load mode on one
and two slots (per-slot and unified KV), the speculative mode with a model drafting for itself, and
the memory mode (two KV streams and a context shift).

CPU, ``LLAMA_HEADINFER_FORCE_SPLIT=1`` (so the frac 0.5 servers split), the synthetic llama-gqa
model, 48-token prompts and a few generated tokens: five short-lived servers, ~20 s on 2 cores.
Speed figures are only checked to exist (> 0); what is checked exactly is what the server says
it did: the prompt lengths, the tokens generated, the cached prompt reused by the decode phase,
and the draft tokens accepted.
"""

from __future__ import annotations

import json

import pytest

from testing_models import FORCE_SPLIT
from testing_scripts import load_script

PROMPT_TOKENS = 48


@pytest.fixture(scope="module")
def bench():
    return load_script("server_bench")


def run_bench(bench, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    out = tmp_path / "rows.json"
    rc = bench.main([*argv, "--prompt-tokens", str(PROMPT_TOKENS), "-t", "1", "--json", str(out),
                     "--server-log", str(tmp_path / "server.log"), "--", "--no-warmup"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    return json.loads(out.read_text())["rows"], captured.out


def test_load_mode_one_and_two_slots(bench, server_binary, gguf_models, tmp_path, monkeypatch, capsys):
    max_tokens = 6
    rows, table = run_bench(bench, ["load", "--model", str(gguf_models["llama-gqa"]), "--server", str(server_binary),
                                    "--frac", "0.5", "--slots", "1,2", "--per-slot", "--unified", "--client", "openai",
                                    "--max-tokens", str(max_tokens)], tmp_path, monkeypatch, capsys)
    # one slot: both layouts are the same single stream, so one server
    assert [(r["slots"], r["kv"]) for r in rows] == [(1, "1 stream"), (2, "per-slot"), (2, "unified")]
    for r in rows:
        n = r["slots"]
        assert r["client"] == "openai" and r["timings_found"] and len(r["timings_decode"]) == n
        assert "3 of 3 layers split" in r["split"], r["split"]  # the server logged the split
        assert r["prompt_tokens"] == [PROMPT_TOKENS] * n
        # fill phase: the server evaluated every prompt whole, nothing cached before
        assert r["fill_prompt_n"] == [PROMPT_TOKENS] * n and r["fill_cache_n"] == [0] * n
        # decode phase: every slot found its prompt in its cache (all but the one token re-evaluated)
        assert r["decode_cache_n"] == [PROMPT_TOKENS - 1] * n and r["cache_reused"]
        assert r["predicted_n"] == [max_tokens] * n and r["completion_tokens"] == [max_tokens] * n
        assert r["agg_tok_s"] > 0 and r["agg_wall_tok_s"] > 0 and r["per_slot_tok_s"] > 0
        assert r["fill_s"] > 0 and r["fill_tok_s"] > 0
        assert all(t["predicted_ms"] > 0 for t in r["timings_decode"])
    two = rows[1]
    assert two["texts"][0] != two["texts"][1]  # distinct prompts, distinct continuations
    assert table.count("\n| 2 |") == 2 and "| 1 | 1 stream | 0.5 |" in table


def test_spec_mode_model_drafting_for_itself(bench, server_binary, gguf_models, tmp_path, monkeypatch, capsys):
    """A model drafting for itself at temperature 0: (almost) every draft token is accepted, and the
    text is the text without a draft. Through the stdlib client (the H200 has no openai package)."""
    model = str(gguf_models["llama-gqa"])
    max_tokens = 16
    rows, table = run_bench(bench, ["spec", "--model", model, "--draft", model, "--server", str(server_binary),
                                    "--frac", "0.5", "--draft-max", "4", "--client", "http",
                                    "--max-tokens", str(max_tokens)], tmp_path, monkeypatch, capsys)
    plain, spec = rows
    assert (plain["draft_max"], spec["draft_max"]) == (0, 4) and all(r["client"] == "http" for r in rows)
    assert plain["draft_n"] == 0 and plain["acceptance"] is None and plain["speedup"] == 1.0
    assert spec["draft_n"] >= 4 and spec["acceptance"] > 0.9, (spec["draft_n"], spec["draft_n_accepted"])
    assert spec["timings_decode"][0]["draft_n"] == spec["draft_n"]  # straight from the server's timings
    for r in rows:
        assert r["predicted_n"] == [max_tokens] and r["completion_tokens"] == [max_tokens] and r["tok_s"] > 0
        assert "split" in r["split"]
    assert spec["texts"] == plain["texts"]  # greedy speculative decoding changes no token
    assert "| 0.5 | 4 |" in table and "| 0.5 | none |" in table


def test_memory_mode_two_streams_and_a_context_shift(bench, server_binary, gguf_models, tmp_path, monkeypatch,
                                                     capsys):
    """memory: two slots with one KV stream each, attending in chunks, then slot 0 generating past the end of its
    context: the server shifts it (its log says so) and each row has plan's estimate for the same context. A CPU
    build has no device buffers to report (the GPU's are docs/BENCHMARKS.md's)."""
    monkeypatch.setenv(FORCE_SPLIT, "1")
    out = tmp_path / "rows.json"
    rc = bench.main(["memory", "--model", str(gguf_models["llama-gqa"]), "--server", str(server_binary), "--frac",
                     "1,0.5", "--slots", "2", "--ctx", "512", "--prompt-tokens", "300", "--max-tokens", "4", "-t",
                     "1", "--json", str(out), "--server-log", str(tmp_path / "server.log"), "--", "--no-warmup",
                     "--headinfer-attn", "chunked", "--headinfer-attn-chunk", "256"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["frac"], r["slots"], r["ctx_per_slot"]) for r in rows] == [(1.0, 2, 512), (0.5, 2, 512)]
    assert all(r["shifts"] >= 1 and r["compute_mib"] == {} and not r["staging_grew"] for r in rows), rows
    assert rows[0]["plan_arena_mib"] == 0 < rows[1]["plan_arena_mib"], rows
    assert "| 0.5 | 2 x 512 |" in captured.out


def test_memory_figures_read_the_buffers_before_and_what_grew_after(bench):
    log = ("sched_reserve:      CUDA0 compute buffer size =   812.50 MiB\n"
           "sched_reserve:        CPU compute buffer size =    20.00 MiB\n"
           "sched_reserve:  CUDA_Host compute buffer size =    80.01 MiB\n"
           "ggml_backend_sched_alloc_streams: CUDA0 staging buffer from 0.00 MiB to 24.02 MiB: 3 slots of 8396800 "
           "bytes (group #2 of 40, graph of 900 nodes)\n")
    mark = len(log)
    log += ("slot context shift, n_keep = 0, n_left = 32766, n_discard = 16383\n"
            "ggml_backend_sched_alloc_streams: CUDA0 staging buffer from 24.02 MiB to 48.00 MiB: 3 slots of 16777216 "
            "bytes (group #1 of 9, graph of 29 nodes)\n"
            "ggml_gallocr_reserve_n: reallocating CUDA0 buffer from size 812.50 MiB to 900.00 MiB\n")
    figures = bench.memory_figures(log, mark)
    assert figures["compute_mib"] == {"CUDA0": 812.5} and figures["staging_mib"] == {"CUDA0": 24.02}
    assert figures["shifts"] == 1 and len(figures["staging_grew"]) == 1 and len(figures["compute_grew"]) == 1


def test_usage_errors_are_one_line(bench, gguf_models, tmp_path, capsys):
    model = str(gguf_models["llama-gqa"])
    assert bench.main(["spec", "--model", model]) == 2
    assert capsys.readouterr().err.strip() == "server_bench: error: spec needs --draft (the draft model)"
    assert bench.main(["load", "--model", model, "--prompt-tokens", "100", "--ctx", "64"]) == 2
    assert "--ctx 64 is too small" in capsys.readouterr().err
    assert bench.main(["load", "--model", str(tmp_path / "missing.gguf"), "--slots", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model not found" in err
    assert bench.main(["load", "--model", model, "--frac", "1.5"]) == 2  # argparse
    assert "fractions must be in [0, 1]" in capsys.readouterr().err
    out = tmp_path / "failed.json"
    assert bench.main(["load", "--model", model, "--slots", "1", "--server", str(tmp_path / "no-server"),
                       "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.err.startswith("server_bench: error: cannot run ") and captured.err.count("\n") == 1
    assert captured.out == "" and not out.exists()  # nothing measured, nothing written
