"""scripts/log_step_times.py: step times from the stamps of a verbose llama.cpp log (the log itself comes from the GPU
machine; this checks the reading on lines written by hand)."""

from __future__ import annotations

import pytest

from testing_scripts import load_script


@pytest.fixture(scope="module")
def steps():
    return load_script("log_step_times")


def test_a_graph_id_not_larger_than_the_last_starts_a_step(steps, tmp_path, capsys):
    log = tmp_path / "bb.err"
    log.write_text("\n".join([
        "0.04.000.000 I llama_context: constructing",
        "4.26.855.481 D CUDA Graph id 10 reused",          # step 1: ids 10, 11, 12
        "4.26.900.000 D CUDA Graph id 11 reused",
        "4.26.950.000 D ggml_backend_cuda_graph_compute: CUDA graph warmup complete",
        "4.27.000.000 D CUDA Graph id 12 reused",
        "4.27.172.181 D CUDA Graph id 10 reused",          # step 2, 316.7 ms after step 1
        "4.27.300.000 D CUDA Graph id 12 reused",
        "4.27.475.381 D CUDA Graph id 10 reused",          # step 3, 303.2 ms after step 2
    ]) + "\n")
    assert steps.main([str(log)]) == 0
    out = capsys.readouterr().out
    assert "2 steps (ms): 316.7 303.2" in out
    assert "median 310.0 ms, mean 310.0 ms, min 303.2, max 316.7" in out


def test_a_log_without_reused_graphs_is_an_error(steps, tmp_path, capsys):
    log = tmp_path / "quiet.err"
    log.write_text("0.00.281.154 I llama_model_loader: loaded\n")
    assert steps.main([str(log)]) == 1
    assert "was the log written with -v?" in capsys.readouterr().err


def test_a_missing_log_is_a_one_line_error(steps, tmp_path, capsys):
    assert steps.main([str(tmp_path / "missing.err")]) == 2
    assert capsys.readouterr().err.strip() == f"{tmp_path / 'missing.err'}: No such file or directory"
