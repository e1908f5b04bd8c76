"""The cffi bindings: declarations checked against llama.h at compile time,
stale builds refused, llama.cpp's log routed to Python logging."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_headinfer import pin
from pyllama_headinfer.build import extension
from pyllama_headinfer.errors import StaleBuildError
from pyllama_headinfer.runtime import bindings
from pyllama_headinfer.runtime.manifest import find_manifest
from pyllama_headinfer.series import build_stamp, series_hash

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def build_info(built):
    manifest = find_manifest()
    return manifest.source_tree, manifest.lib_dir


def compile_with(cdef: str, tmp_path: Path, build_info) -> Path:
    source, lib_dir = build_info
    return extension.compile_extension(tmp_path, source, lib_dir, cdef=cdef, stamp="test")


# --------------------------------------------------------------------------
# declarations


def test_cdef_parses():
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(extension.cdef_source())


def test_type_checks_cover_every_declaration():
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(extension.cdef_source())
    checks = extension.type_checks(ffi)
    for name in ("llama_decode", "llama_tokenize", "llama_memory_get_kv_buffers", "llama_memory_seq_rm",
                 "llama_state_seq_load_file", "llama_sampler_sample"):
        assert f"__typeof__(&{name})" in checks
    for struct, field in (("llama_context_params", "headinfer_gpu_heads_frac"), ("llama_batch", "seq_id"),
                          ("llama_memory_kv_layer", "n_head_resident")):
        assert f"((struct {struct} *)0)->{field})" in checks


def test_partial_structs():
    """Every struct we name is partial, so the compiler lays it out."""
    text = (extension.DECL_DIR / "llama_decl.h").read_text()
    bodies = re.findall(r"struct\s+(\w+)\s*\{(.*?)\}", text, re.S)
    assert bodies
    for name, body in bodies:
        assert body.rstrip().endswith("...;"), f"struct {name} is not partial"


def test_compiled_against_real_header(built):
    ffi, lib = built
    assert ffi.sizeof("struct llama_context_params") == lib.pyllama_sizeof_context_params()
    assert ffi.offsetof("struct llama_context_params", "headinfer_gpu_heads_frac") > ffi.offsetof(
        "struct llama_context_params", "n_ctx")
    p = lib.llama_context_default_params()
    assert p.headinfer_gpu_heads_frac == 1.0
    assert p.type_k == lib.GGML_TYPE_F16


@pytest.mark.parametrize("wrong, old, message", [
    ("field type", "uint32_t n_ctx;", "int64_t n_ctx;"),
    ("field name", "uint32_t n_ubatch;", "uint32_t n_ubatches;"),
    ("function prototype", "int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);",
     "int32_t llama_decode(struct llama_context * ctx, int32_t batch);"),
    ("const", "int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);",
     "int32_t llama_vocab_n_tokens(struct llama_vocab * vocab);"),
    ("return type", "uint32_t llama_n_ctx    (const struct llama_context * ctx);",
     "int32_t llama_n_ctx    (const struct llama_context * ctx);"),
])
def test_misdeclaration_is_a_compile_error(tmp_path, build_info, wrong, old, message):
    from pyllama_headinfer.errors import BuildError

    cdef = extension.cdef_source()
    assert old in cdef, old
    with pytest.raises(BuildError, match="does not match llama.h"):
        compile_with(cdef.replace(old, message, 1), tmp_path, build_info)


def test_compile_extension_roundtrip(tmp_path, build_info):
    """compile_extension's contract: returns the module path inside build_dir."""
    path = compile_with(extension.cdef_source(), tmp_path, build_info)
    assert path.is_file() and path.parent == extension.extension_dir(tmp_path.resolve())
    assert path.name.startswith(bindings.MODULE_NAME)


# --------------------------------------------------------------------------
# stamp and finding the build


def test_stamp_matches_checkout(built):
    ffi, lib = built
    assert bindings.check_stamp(ffi, lib) == build_stamp()
    assert build_stamp() == f"{pin.active().commit}+{series_hash()}"


def test_stale_stamp_is_refused(built, monkeypatch):
    ffi, lib = built
    monkeypatch.setattr(bindings, "build_stamp", lambda chosen=None: "0" * 40 + "+other-series")
    with pytest.raises(StaleBuildError, match=r"stale build.*python -m pyllama_headinfer build"):
        bindings.check_stamp(ffi, lib)


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=120)


def test_missing_build_is_a_clear_error(tmp_path):
    res = _run_python(
        "from pyllama_headinfer.runtime import bindings\n"
        "from pyllama_headinfer.errors import NotBuiltError\n"
        "try:\n    bindings.load()\n"
        "except NotBuiltError as e:\n    print('NOTBUILT', e)\n",
        PYLLAMA_HEADINFER_BUILD_DIR=str(tmp_path / "nothing"))
    assert res.returncode == 0, res.stderr
    assert "NOTBUILT" in res.stdout and "python -m pyllama_headinfer build" in res.stdout


def test_stale_module_is_refused_at_load(built, tmp_path, build_info):
    """A build dir whose module carries another stamp: load() refuses it."""
    import json

    manifest = find_manifest().data
    stale = tmp_path / "stale"
    source, lib_dir = build_info
    module = extension.compile_extension(stale, source, lib_dir, stamp="0" * 40 + "+old-series")
    manifest = dict(manifest, build_dir=str(stale), bindings=str(module))
    (stale / "manifest.json").write_text(json.dumps(manifest))
    res = _run_python(
        "from pyllama_headinfer.runtime import bindings\n"
        "from pyllama_headinfer.errors import StaleBuildError\n"
        "try:\n    bindings.load()\n"
        "except StaleBuildError as e:\n    print('STALE', e)\n",
        PYLLAMA_HEADINFER_BUILD_DIR=str(stale))
    assert res.returncode == 0, res.stderr
    assert "STALE" in res.stdout and "python -m pyllama_headinfer build" in res.stdout


def test_every_build_of_the_series_has_the_residency_api(built):
    assert bindings.has_kv_residency() is True


# --------------------------------------------------------------------------
# logging


def test_llama_log_goes_to_python_logging(built, gguf_models, caplog, capfd):
    from pyllama_headinfer.llama import Model

    caplog.set_level(logging.DEBUG, logger="pyllama_headinfer.llama")
    with Model(gguf_models["llama-gqa"]):
        pass
    records = [r for r in caplog.records if r.name == "pyllama_headinfer.llama"]
    assert records, "llama.cpp logged nothing through the callback"
    assert any("llama_model_loader" in r.getMessage() for r in records)
    assert {r.levelno for r in records} <= {logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR}
    assert all(not r.getMessage().endswith("\n") for r in records)
    err = capfd.readouterr().err
    assert "llama_model_loader" not in err, "llama.cpp wrote to stderr directly"


def test_no_stderr_by_default(built, gguf_models):
    """With logging unconfigured, loading a model prints nothing."""
    res = _run_python(
        "from pyllama_headinfer.llama import Model, Context\n"
        f"m = Model({str(gguf_models['llama-gqa'])!r})\n"
        "c = Context(m, n_ctx=64, n_threads=1)\n"
        "c.decode(m.tokenize('hello'))\n"
        "print('done')\n",
        PYLLAMA_HEADINFER_BUILD_DIR=str(find_manifest().build_dir))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "done"
    assert res.stderr == ""


def test_log_errors_reach_exceptions(built, tmp_path):
    """An error llama.cpp logs while failing ends up in the exception message."""
    from pyllama_headinfer.llama import Model, ModelError
    import testing_models as tm

    # a valid GGUF with a missing tensor: passes the pre-flight check, llama.cpp rejects it
    import gguf
    import numpy as np

    path = tmp_path / "incomplete.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_layer_norm_rms_eps(1e-5)
    v = tm.spm_vocab(300)
    w.add_tokenizer_model("llama")
    w.add_token_list(v.tokens)
    w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    w.add_tensor("token_embd.weight", np.zeros((300, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelError, match=r"could not load .*(tensor|missing|error)"):
        Model(path)
