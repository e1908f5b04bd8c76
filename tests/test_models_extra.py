"""The extra synthetic models (``testing_models.EXTRA_SPECS``: single-KV-head
llama, hybrid Jamba, recurrent Mamba): deterministic, well-formed, loaded and
run by llama.cpp -- and the original specs' cache keys are untouched."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

import testing_models as tm


@pytest.fixture(scope="module")
def extra_paths(test_models_dir):
    return tm.ensure_extra_models(test_models_dir)



def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_original_specs_unchanged():
    """The extra models are appended: the original specs (and so their cached
    files) keep their cache keys."""
    assert {n: s.cache_key() for n, s in tm.SPECS.items()} == {
        "llama-gqa": "2c55e2f4bcaf5505", "qwen2": "3950a36569ddbd3a", "gemma3-iswa": "c83868d4a4d0b3de"}
    assert not set(tm.SPECS) & set(tm.EXTRA_SPECS)
    assert len({s.cache_key() for s in tm.EXTRA_SPECS.values()}) == len(tm.EXTRA_SPECS)


@pytest.mark.parametrize("name", sorted(tm.EXTRA_SPECS))
def test_generator_is_deterministic(tmp_path, extra_paths, name):
    again = tm.write_extra_model(tm.EXTRA_SPECS[name], tmp_path / "again.gguf")
    assert sha256(again) == sha256(extra_paths[name])
    assert extra_paths[name].stat().st_size < 32 * 2**20, "test models must stay small"


def test_unknown_extra_model(tmp_path):
    with pytest.raises(ValueError, match="unknown extra test model"):
        tm.ensure_extra_models(tmp_path, ["nope"])


@pytest.mark.parametrize("name", sorted(tm.EXTRA_SPECS))
def test_metadata(extra_paths, name):
    import gguf

    spec = tm.EXTRA_SPECS[name]
    reader = gguf.GGUFReader(str(extra_paths[name]))

    def field(key):
        return reader.fields[key].contents()

    arch = spec.arch
    assert field("general.architecture") == arch
    assert field(f"{arch}.block_count") == spec.n_layer
    names = {t.name for t in reader.tensors}
    if isinstance(spec, tm.RecurrentSpec):
        assert field(f"{arch}.ssm.inner_size") == 2 * spec.n_embd
        assert field(f"{arch}.ssm.state_size") == spec.d_state
        kv = field(f"{arch}.attention.head_count_kv")
        if spec.attn_layers:
            assert kv == [spec.n_head_kv if i in spec.attn_layers else 0 for i in range(spec.n_layer)]
        else:
            assert kv == 0
        for i in range(spec.n_layer):
            attn = i in spec.attn_layers
            assert (f"blk.{i}.attn_k.weight" in names) == attn
            assert (f"blk.{i}.ssm_in.weight" in names) == (not attn)
            assert (f"blk.{i}.ssm_a" in names) == (not attn)
    else:
        assert field(f"{arch}.attention.head_count_kv") == spec.n_head_kv == 1


@pytest.mark.parametrize("name", sorted(tm.EXTRA_SPECS))
def test_llama_cpp_runs_them(llama, extra_paths, name):
    spec = tm.EXTRA_SPECS[name]
    with llama.Model(extra_paths[name]) as model, \
            llama.Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1) as ctx:
        assert model.n_layer == spec.n_layer and model.n_vocab == spec.n_vocab
        assert model.description.startswith(spec.arch)
        out = list(ctx.generate(model.tokenize(tm.CORPUS)[:40], 24, stop_at_eog=False))
        assert len(set(out)) > 5, f"degenerate output {out}"
        report = ctx.kv_residency()
        if isinstance(spec, tm.RecurrentSpec):
            assert report is None  # hybrid / recurrent memory: not a plain attention KV cache
        else:
            assert [x["n_head_kv"] for x in report["layers"]] == [1] * spec.n_layer


def test_the_draft_models_are_deterministic_and_small(tmp_path):
    """The gemma4 target and its assistant (test_serve.py's shared-cache drafts): the same bytes from every writer,
    the assistant sized to read the target's KV heads."""
    import gguf

    paths = tm.ensure_draft_models(tmp_path / "cache")
    for name, spec in tm.DRAFT_SPECS.items():
        again = tm.write_extra_model(spec, tmp_path / f"{name}-again.gguf")
        assert sha256(again) == sha256(paths[name]) and paths[name].stat().st_size < 32 * 2**20
    assistant = gguf.GGUFReader(str(paths["gemma4-assistant"])).fields
    target = tm.DRAFT_SPECS["gemma4-iswa"]
    assert assistant["gemma4-assistant.attention.head_count_kv"].contents() == target.n_head_kv
    assert assistant["gemma4-assistant.embedding_length_out"].contents() == target.n_embd
