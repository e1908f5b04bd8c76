"""ContextParams: one checked record of a context's parameters, shared by the
API, the planner and the commands (no llama.cpp needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from pyllama_headinfer.errors import UsageError
from pyllama_headinfer.params import KV_CACHE_TYPES, ContextParams, default_n_threads, parse_size
from pyllama_headinfer.vram.memory import Settings


def test_defaults():
    p = ContextParams()
    assert (p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max, p.type_k, p.type_v, p.flash_attn) == \
        (512, 512, 512, 1, "f16", "f16", True)
    assert p.headinfer_gpu_heads_frac is None and p.headinfer_vram_budget is None and p.frac == 1.0


@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_frac_and_budget_exclude_each_other_whatever_the_values(frac):
    with pytest.raises(UsageError, match="not both"):
        ContextParams(headinfer_gpu_heads_frac=frac, headinfer_vram_budget="24GiB")
    assert ContextParams(headinfer_gpu_heads_frac=frac).frac == frac
    assert ContextParams(headinfer_vram_budget="24GiB").vram_budget_bytes == parse_size("24GiB")


@pytest.mark.parametrize("kw, message", [
    (dict(n_ctx=-1), "n_ctx"), (dict(n_batch=0), "n_batch"), (dict(n_seq_max=1.5), "n_seq_max"),
    (dict(n_threads=0), "n_threads"), (dict(n_ctx=2**31), "too large"), (dict(type_k="f8"), "type_k"),
    (dict(type_v=None), "type_v"), (dict(flash_attn="yes"), "flash_attn"), (dict(kv_unified=1), "kv_unified"),
    (dict(headinfer_gpu_heads_frac=1.5), "headinfer_gpu_heads_frac"),
    (dict(headinfer_vram_budget="a lot"), "as a size"),
])
def test_bad_values_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        ContextParams(**kw)


def test_replace_checks_again_and_normalises():
    p = ContextParams(type_k="Q8_0", headinfer_gpu_heads_frac=1)
    assert p.type_k == "q8_0" and isinstance(p.headinfer_gpu_heads_frac, float)
    with pytest.raises(UsageError):
        p.replace(headinfer_vram_budget="1GiB")
    assert p.replace(headinfer_gpu_heads_frac=None, headinfer_vram_budget="1GiB").frac == 1.0


def test_the_planner_resolves_none_to_llama_cpp_defaults(gguf_models):
    from pyllama_headinfer.vram.model import read_model_info

    info = read_model_info(gguf_models["llama-gqa"])
    s = Settings.from_params(ContextParams(n_ctx=4096, flash_attn=None), info, n_gpu_layers=7)
    assert (s.n_ctx, s.n_gpu_layers, s.kv_unified, s.swa_full, s.flash_attn) == (4096, 7, False, True, True)
    assert s.attn_chunk == 0  # one attention per layer
    s = Settings.from_params(ContextParams(kv_unified=True, swa_full=False, flash_attn=False), info)
    assert (s.kv_unified, s.swa_full, s.flash_attn) == (True, False, False)
    # chunked with headinfer_attn_chunk 0: the model's chunk (4 KV heads of 64: 1 KiB a cell, 32 MiB of them)
    assert Settings.from_params(ContextParams(headinfer_attn="chunked"), info).attn_chunk == 32768
    assert Settings.from_params(ContextParams(headinfer_attn="chunked", headinfer_attn_chunk=512), info).attn_chunk == 512


def test_one_kv_type_table_for_api_and_planner():
    import pyllama_headinfer.api.context as context
    import pyllama_headinfer.vram.memory as memory

    assert not hasattr(context, "KV_CACHE_TYPES") or context.KV_CACHE_TYPES is KV_CACHE_TYPES
    assert memory.KV_CACHE_TYPES is KV_CACHE_TYPES


@pytest.mark.parametrize("value", ["parts", "part", "JOINED", 1, None])
def test_an_unknown_attention_mode_is_a_value_error(value):
    """joined and chunked are the modes; the attention per part and the streaming switch are gone from llama.h."""
    with pytest.raises(ValueError, match="headinfer_attn must be one of 'joined', 'chunked'"):
        ContextParams(headinfer_attn=value)
    with pytest.raises(TypeError, match="headinfer_stream"):
        ContextParams(headinfer_stream="off")


# --------------------------------------------------------------------------
# threads: the CPUs this process may run on, not llama.cpp's 4


def _affinity_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def test_threads_default_to_the_cpus_this_process_may_run_on():
    n = _affinity_count()
    assert default_n_threads() == n
    assert ContextParams().threads() == (n, n)
    assert ContextParams(n_threads=3).threads() == (3, 3)
    assert ContextParams(n_threads_batch=5).threads() == (n, 5)
    assert ContextParams(n_threads=1, n_threads_batch=2).threads() == (1, 2)


def test_threads_without_an_affinity_call_count_the_cpus(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert default_n_threads() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # unknown: one thread
    assert default_n_threads() == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_threads_follow_the_affinity():
    """Pinned to one CPU (taskset, a cpuset), a process defaults to one thread."""
    code = ("import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}); "
            "from pyllama_headinfer.params import ContextParams, default_n_threads; "
            "print(default_n_threads(), ContextParams().threads())")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "1 (1, 1)"
