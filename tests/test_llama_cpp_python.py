"""``build --llama-cpp-python`` (issue 28): llama-cpp-python's ``Llama`` and
``llama_cpp.server`` with the HeadInfer split, in a separate environment.

Once per session the fixture ``lcp`` (in conftest.py, shared with
``tests/test_real_gqa_model.py``) runs ``build --llama-cpp-python --python
VENV`` for a venv kept in ``<cache>/test-venvs/llama-cpp-python`` (created the
first time; its dependencies stay installed between runs, the wheel is built
and installed again every session). Everything that imports ``llama_cpp``
runs in that venv's Python, never in the test process. The split runs on the
CPU with ``LLAMA_HEADINFER_FORCE_SPLIT=1``, where frac 0.5 must give the same
text and logits as 1.0, bit for bit.

``test_upstream_suite`` runs llama-cpp-python 0.3.36's own tests against the
patched install, offline (docs/LLAMA_CPP_PYTHON.md lists what it skips and why).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pyllama_headinfer import paths, pin
from pyllama_headinfer.series import read_series_names

import testing_models
from conftest import build_dir, run_py
from test_serve import free_port

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama-gqa", "gemma3-iswa")


# --------------------------------------------------------------------------
# the install itself


def test_installed_package_is_patched_and_uses_the_build(lcp, built):
    ffi, _lib = built
    out = run_py(lcp, r"""
import ctypes, json, llama_cpp
p = llama_cpp.llama_context_default_params()
maps = [l.split()[-1] for l in open("/proc/self/maps") if "libllama" in l or "libggml" in l]
print(json.dumps({"version": llama_cpp.__version__, "available": llama_cpp.HEADINFER_AVAILABLE,
                  "default": p.headinfer_gpu_heads_frac, "size": ctypes.sizeof(llama_cpp.llama_context_params),
                  "offset": llama_cpp.llama_context_params.headinfer_gpu_heads_frac.offset,
                  "attn": [p.headinfer_attn, llama_cpp.llama_context_params.headinfer_attn.offset],
                  "chunk": [p.headinfer_attn_chunk, llama_cpp.llama_context_params.headinfer_attn_chunk.offset,
                            llama_cpp.LLAMA_HEADINFER_ATTN_CHUNKED],
                  "fields": [f[0] for f in llama_cpp.llama_context_params._fields_],
                  "removed": [n for n in ("LLAMA_HEADINFER_ATTN_PARTS", "LLAMA_HEADINFER_STREAM_OFF",
                                          "LLAMA_HEADINFER_STREAM_GPU", "LLAMA_HEADINFER_STREAM_ANY")
                              if hasattr(llama_cpp, n)],
                  "file": llama_cpp.__file__, "maps": sorted(set(maps))}))
""", split=False)
    assert out["version"].startswith(f"{pin.PYTHON_LAYER_SDIST.version}+headinfer.")
    assert out["available"] is True and out["default"] == 1.0
    # the ctypes mirror has the C layout (the cffi module is compiled against the patched llama.h)
    assert out["size"] == ffi.sizeof("struct llama_context_params")
    assert out["offset"] == ffi.offsetof("struct llama_context_params", "headinfer_gpu_heads_frac")
    assert out["attn"] == [0, ffi.offsetof("struct llama_context_params", "headinfer_attn")]  # joined
    assert out["chunk"] == [0, ffi.offsetof("struct llama_context_params", "headinfer_attn_chunk"),
                            _lib.LLAMA_HEADINFER_ATTN_CHUNKED]
    assert out["chunk"][2] == 1  # JOINED = 0, CHUNKED = 1: there is no mode between them any more
    # the struct ends with the three HeadInfer fields, in llama.h's order; the streaming switch is gone from both
    assert out["fields"][-3:] == ["headinfer_gpu_heads_frac", "headinfer_attn", "headinfer_attn_chunk"]
    assert "headinfer_stream" not in out["fields"] and out["removed"] == []
    assert "headinfer_stream" not in _struct_fields(ffi, "struct llama_context_params")
    # the libraries come from the wheel (relocatable: $ORIGIN), not from the build directory
    site = str(Path(out["file"]).parent)
    assert out["maps"] and all(m.startswith(site + "/lib/") for m in out["maps"]), out["maps"]


def _struct_fields(ffi, name: str) -> list:
    return [field for field, _ in ffi.typeof(name).fields]


def test_wheel_libraries_find_each_other_by_origin(lcp):
    import zipfile

    names = set(zipfile.ZipFile(lcp["wheel"]).namelist())
    assert {"llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml.so", "llama_cpp/lib/libggml-base.so.0"} <= names
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    readelf = subprocess.run(["readelf", "-d", str(build_dir() / "bin" / "libllama.so")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert readelf.returncode == 0, readelf.stdout
    runpath = [line for line in readelf.stdout.splitlines() if "RUNPATH" in line or "RPATH" in line]
    assert runpath and all("$ORIGIN" in line and str(ROOT) not in line for line in runpath), runpath


def test_install_brings_the_server_dependencies(monkeypatch, tmp_path):
    """Step 5 installs the wheel with its `server` extra: README's `python -m llama_cpp.server`
    command needs uvicorn & co. (no network here: the wheel build and pip are stand-ins)."""
    from pyllama_headinfer.build import llama_cpp_python as lcp_build

    wheel = tmp_path / "llama_cpp_python-0.3.36+headinfer.0123456789ab-py3-none-linux_x86_64.whl"
    monkeypatch.setattr(lcp_build, "build_wheel", lambda *a: (wheel, "0.3.36+headinfer.0123456789ab", {}))
    calls = []
    monkeypatch.setattr(lcp_build, "_run_pip", lambda python, args, what, env=None: calls.append((python, args)))
    lcp_build.install_llama_cpp_python(tmp_path, {"pin": {"build": pin.PYTHON_LAYER_PIN}}, python="/venv/python",
                                       say=lambda _: None)
    assert [python for python, _ in calls] == ["/venv/python", "/venv/python"]
    (_, first), (_, second) = calls
    assert first[:3] == ["install", "--force-reinstall", "--no-deps"] and first[-1] == str(wheel)
    assert second[0] == "install" and "--no-deps" not in second and second[-1] == f"{wheel}[server]"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "python -m llama_cpp.server" in readme and "with its `server` extra" in readme


def test_a_failed_add_libraries_leaves_no_partial_wheel(tmp_path):
    import zipfile

    from pyllama_headinfer.build.llama_cpp_python import add_libraries
    from pyllama_headinfer.errors import BuildError

    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("llama_cpp/__init__.py", "")  # no .dist-info/RECORD
    out = tmp_path / "dist"
    with pytest.raises(BuildError, match="has no RECORD"):
        add_libraries(wheel, {}, out)
    assert list(out.iterdir()) == []


def test_only_a_build_of_the_binding_s_pin_is_packed():
    """llama-cpp-python 0.3.36 declares b11312's structs in ctypes: a b11549 library (which appended
    moe_cache_size to llama_context_params) would shift headinfer_gpu_heads_frac under it."""
    from pyllama_headinfer.build.llama_cpp_python import check_build
    from pyllama_headinfer.errors import UsageError

    check_build({"pin": {"build": "b11312"}})
    with pytest.raises(UsageError, match="needs a build of llama.cpp b11312.*this build is of b11549"):
        check_build({"pin": {"build": "b11549"}})


def test_python_series_is_separate_and_applied(lcp):
    names = read_series_names(paths.python_patches_dir())
    assert len(names) == 11 and all(n.endswith(".patch") for n in names)
    assert not set(names) & set(read_series_names())  # the C series does not list them
    tree = build_dir() / "llama-cpp-python" / "src"
    result = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "patch", "status", "--series",
                             "llama-cpp-python", "--llama-src", str(tree)], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, text=True)
    assert result.returncode == 0 and "APPLIED: all 11 patches" in result.stdout, result.stdout


# --------------------------------------------------------------------------
# Llama: split vs whole, bit for bit

SAME_CODE = r"""
import hashlib, json, sys
import llama_cpp
from llama_cpp import Llama
model = sys.argv[1]
kw = dict(n_ctx=256, n_batch=64, seed=7, flash_attn=True, verbose=False, logits_all=True)
prompt = "Once upon a time there was a little town by the sea"
out = {}
llms = {}
for frac in (1.0, 0.5):
    llm = Llama(model, headinfer_gpu_heads_frac=frac, **kw)
    llms[frac] = llm
    r = llm.create_completion(prompt, max_tokens=16, temperature=0.0)
    scores = llm.scores[: llm.n_tokens].copy()
    chat = llm.create_chat_completion([{"role": "user", "content": "Tell me a story."}], max_tokens=12,
                                      temperature=0.0)
    res = llm.kv_residency()
    out[str(frac)] = {"text": r["choices"][0]["text"], "tokens": r["usage"]["completion_tokens"],
                      "logits": hashlib.sha256(scores.tobytes()).hexdigest(),
                      "chat": chat["choices"][0]["message"]["content"],
                      "split": sum(l["n_head_resident"] < l["n_head_kv"] for l in res["layers"]),
                      "layers": len(res["layers"]),
                      "host": sum(b["k"] + b["v"] for b in res["buffers"].values() if b["headinfer_host"]),
                      "getstate": llm.__getstate__()["headinfer_gpu_heads_frac"]}
# state saved under one fraction, loaded under another: the continuation is the one of 1.0 -> 1.0. (Each pair is
# fresh with the same history: after load_state, llama-cpp-python's sample() depends on what the loading Llama
# decoded before, so only equal histories compare; and a Llama that never decoded aborts in sample() after
# load_state, upstream's behaviour at 1.0 too.)
def greedy(b, n=8):
    toks = []
    for _ in range(n):
        t = b.sample(temp=0.0)
        toks.append(int(t)); b.eval([t])
    return toks
cont = {}
for src, dst in ((1.0, 1.0), (1.0, 0.5), (0.5, 1.0)):
    a, b = (Llama(model, headinfer_gpu_heads_frac=f, **kw) for f in (src, dst))
    for x in (a, b):
        x.create_completion("Hello", max_tokens=4, temperature=0.0)
    a.reset(); a.eval(a.tokenize(prompt.encode()))
    state = a.save_state()
    b.reset(); b.load_state(state)
    cont[f"{src}->{dst}"] = greedy(b)
out["cont"] = cont
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", MODELS)
def test_split_matches_whole(lcp, gguf_models, name):
    out = run_py(lcp, SAME_CODE, str(gguf_models[name]))
    whole, split = out["1.0"], out["0.5"]
    assert split["split"] == split["layers"] > 0 and split["host"] > 0  # the split really ran
    assert whole["split"] == 0 and whole["host"] == 0
    assert split["tokens"] == whole["tokens"] > 0
    assert split["text"] == whole["text"]
    assert split["logits"] == whole["logits"]  # sha256 of every prompt+generated row's logits
    assert split["chat"] == whole["chat"]
    assert (whole["getstate"], split["getstate"]) == (1.0, 0.5)
    assert out["cont"]["1.0->0.5"] == out["cont"]["0.5->1.0"] == out["cont"]["1.0->1.0"]
    assert len(out["cont"]["1.0->1.0"]) == 8


BUDGET_CODE = r"""
import json, sys
root, gguf_home, model, budget = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
from llama_cpp import Llama
kw = dict(n_ctx=1024, n_batch=64, n_ubatch=64, flash_attn=True, verbose=False, headinfer_attn="chunked",
          headinfer_attn_chunk=256)
out = {}
try:  # the venv has no pyllama-headinfer: the budget cannot be planned
    Llama(model, headinfer_vram_budget=budget, **kw)
except RuntimeError as e:
    out["without_planner"] = str(e)
sys.path[:0] = [root, gguf_home]  # now it has, with its dependency gguf (as `pip install pyllama-headinfer` gives)
llm = Llama(model, headinfer_vram_budget=budget, **kw)
state = llm.__getstate__()
out.update(frac=llm.headinfer_gpu_heads_frac, resident=[l["n_head_resident"] for l in llm.kv_residency()["layers"]],
           state=[state["headinfer_gpu_heads_frac"], "headinfer_vram_budget" in state])
out["auto"] = Llama(model, headinfer_vram_budget="auto", **kw).headinfer_gpu_heads_frac
for label, extra in (("both", dict(headinfer_vram_budget="1GiB", headinfer_gpu_heads_frac=0.5)),
                     ("small", dict(headinfer_vram_budget="1MiB")), ("unreadable", dict(headinfer_vram_budget="lots"))):
    try:
        Llama(model, **kw, **extra)
    except ValueError as e:
        out[label] = str(e)
print(json.dumps(out))
"""


def test_vram_budget_plans_the_fraction(lcp, gguf_models):
    """headinfer_vram_budget: a budget that fits one of four KV heads per layer gives frac 0.25 (the planner's
    choice, the same as the API's); "auto" (the CPU's free memory here, LLAMA_HEADINFER_FORCE_SPLIT=1) fits whole;
    bad combinations are ValueErrors; without pyllama-headinfer importable, a RuntimeError that says so."""
    from pyllama_headinfer.params import ContextParams
    from pyllama_headinfer.vram.plan import plan_kv

    model = gguf_models["llama-gqa"]
    # in chunks of 256 cells: fewer resident heads then need less device memory (tests/test_plan.py, CHUNKED)
    plan = plan_kv(model, ContextParams(n_ctx=1024, n_batch=64, n_ubatch=64, headinfer_attn="chunked",
                                        headinfer_attn_chunk=256), n_gpu_layers=-1, force_split=True)
    budget = plan.row(1).device_total
    assert all(r.device_total > budget for r in plan.rows[1:])  # only g = 1 fits
    import gguf

    out = run_py(lcp, BUDGET_CODE, str(ROOT), str(Path(gguf.__file__).parents[1]), str(model), str(budget))
    assert "pyllama-headinfer" in out["without_planner"] and "headinfer_gpu_heads_frac" in out["without_planner"]
    assert out["frac"] == 0.25 and out["resident"] == [1, 1, 1]
    assert out["state"] == [0.25, False]  # the planned fraction is kept, not the budget
    assert out["auto"] == 1.0
    assert "not both" in out["both"]
    assert "smaller than the weights" in out["small"]
    assert "as a size" in out["unreadable"]


def test_real_models_same_at_any_fraction(lcp, gemma, tmp_path, built):
    """Real weights through llama-cpp-python: the real Gemma-3-270M Q4_K_M (one KV head per layer,
    so no layer can split: the fraction must change nothing) and a GQA model quantized to Q4_K_M by
    llama.cpp's own quantizer (its quantized weights reach the CPU's quantized kernels, AMX where
    the CPU has it, and every layer splits): text, logits, chat and state loads identical."""
    from pyllama_headinfer.llama import quantize_model

    quantized = quantize_model(testing_models.ensure_test_models(tmp_path / "models")["llama-gqa"],
                               tmp_path / "llama-gqa-q4_k_m.gguf", "q4_k_m", n_threads=2)
    for path, splits in ((gemma, False), (quantized, True)):
        out = run_py(lcp, SAME_CODE, str(path))
        whole, split = out["1.0"], out["0.5"]
        assert (split["split"] == split["layers"] > 0) if splits else (split["split"] == 0 == split["host"])
        assert (split["text"], split["tokens"], split["logits"], split["chat"]) == \
            (whole["text"], whole["tokens"], whole["logits"], whole["chat"]), path
        assert out["cont"]["1.0->0.5"] == out["cont"]["0.5->1.0"] == out["cont"]["1.0->1.0"]


CHUNKED_CODE = r"""
import hashlib, json, sys
import llama_cpp
from llama_cpp import Llama
model = sys.argv[1]
kw = dict(n_ctx=1024, n_batch=256, seed=7, flash_attn=True, verbose=False, logits_all=True)
prompt = " ".join(["Once upon a time there was a little town by the sea."] * 20)  # ~580 tokens: 3 chunks of 256
out = {}
for attn, frac in (("chunked", 1.0), ("chunked", 0.5), ("joined", 1.0)):
    extra = dict(headinfer_attn_chunk=256) if attn == "chunked" else {}
    llm = Llama(model, headinfer_gpu_heads_frac=frac, headinfer_attn=attn, **extra, **kw)
    r = llm.create_completion(prompt, max_tokens=8, temperature=0.0)
    scores = llm.scores[: llm.n_tokens].copy()
    state = llm.__getstate__()
    out["default chunk"] = llama_cpp.llama_model_headinfer_attn_chunk(llm.model)
    out[f"{attn} {frac}"] = {"text": r["choices"][0]["text"], "n_tokens": llm.n_tokens,
                             "logits": hashlib.sha256(scores.tobytes()).hexdigest(),
                             "getstate": [state["headinfer_attn"], state["headinfer_attn_chunk"]],
                             "stream in getstate": "headinfer_stream" in state}
bad = {}
for label, kwargs in (("mode", dict(headinfer_attn="sideways")),
                      ("parts", dict(headinfer_attn="parts")),
                      ("chunk", dict(headinfer_attn="chunked", headinfer_attn_chunk=300)),
                      ("chunk without chunks", dict(headinfer_attn_chunk=512)),
                      ("no flash", dict(headinfer_attn="chunked", flash_attn=False))):
    try:
        Llama(model, verbose=False, **{"flash_attn": True, **kwargs})
        bad[label] = "accepted"
    except ValueError as exc:
        bad[label] = "ValueError: " + str(exc)
out["bad"] = bad
# the streaming switch is gone from llama.h: no keyword of Llama (whose **kwargs swallows unknown ones, upstream's
# behaviour) and no setting of the server
import inspect, typing
from llama_cpp.server.settings import ModelSettings
out["stream keyword"] = [k for k in inspect.signature(Llama.__init__).parameters if "stream" in k] + \
    [k for k in ModelSettings.model_fields if "stream" in k]
out["server modes"] = list(typing.get_args(ModelSettings.model_fields["headinfer_attn"].annotation))
print(json.dumps(out))
"""


def test_attention_in_chunks_is_the_same_at_any_fraction(lcp, gguf_models):
    """Llama(headinfer_attn="chunked", headinfer_attn_chunk=256): the prompt spans several chunks; the split (0.5)
    gives frac 1.0's text and logits within the mode, another float order than one attention per layer; the keywords
    survive __getstate__ and bad values are ValueErrors before the model loads ("parts", a mode llama.h no longer
    has, among them); headinfer_stream is neither a keyword nor a server setting."""
    out = run_py(lcp, CHUNKED_CODE, str(gguf_models["llama-gqa"]))
    whole, split, joined = out["chunked 1.0"], out["chunked 0.5"], out["joined 1.0"]
    assert whole["n_tokens"] > 2 * 256, whole
    assert (split["text"], split["logits"]) == (whole["text"], whole["logits"])
    assert joined["logits"] != whole["logits"]  # the chunks are really there
    assert whole["getstate"] == split["getstate"] == ["chunked", 256] and joined["getstate"] == ["joined", 0]
    assert not any(r["stream in getstate"] for r in (whole, split, joined))
    assert out["default chunk"] == 32768  # llama_model_headinfer_attn_chunk: 32 MiB of 4 KV heads of 64 in F16
    for label, value in (("mode", "'sideways'"), ("parts", "'parts'")):
        assert out["bad"][label] == f"ValueError: headinfer_attn must be one of 'joined', 'chunked', got {value}", \
            out["bad"]
    assert "multiple of 256" in out["bad"]["chunk"], out["bad"]
    assert "applies to headinfer_attn='chunked' only" in out["bad"]["chunk without chunks"], out["bad"]
    assert "needs flash attention" in out["bad"]["no flash"], out["bad"]
    assert out["stream keyword"] == [] and out["server modes"] == ["joined", "chunked"], out


BAD_CODE = r"""
import json, math, sys, warnings
from llama_cpp import Llama
out = {}
for label, value in (("1.5", 1.5), ("-0.1", -0.1), ("nan", math.nan), ("inf", math.inf), ("str", "0.5"),
                     ("bool", True), ("none", None)):
    try:
        Llama(sys.argv[1], headinfer_gpu_heads_frac=value, flash_attn=True, verbose=False)
        out[label] = "accepted"
    except ValueError as exc:
        out[label] = "ValueError: " + str(exc)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    Llama(sys.argv[1], n_ctx=64, headinfer_gpu_heads_frac=0.5, verbose=False)
out["no_flash_warning"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
print(json.dumps(out))
"""


def test_bad_fraction_is_a_value_error(lcp, gguf_models):
    out = run_py(lcp, BAD_CODE, str(gguf_models["llama-gqa"]))
    for label in ("1.5", "-0.1", "nan", "inf", "str", "bool", "none"):
        assert out[label].startswith("ValueError: headinfer_gpu_heads_frac"), (label, out[label])
    assert any("flash_attn=True" in m for m in out["no_flash_warning"]), out


def test_unpatched_library_is_refused_clearly(lcp, gguf_models, tmp_path):
    """Our Python layer over a libllama without the split (simulated: a library dir whose libllama lacks the
    symbol is not at hand, so HEADINFER_AVAILABLE is forced off): frac < 1 is a RuntimeError, 1.0 works."""
    out = run_py(lcp, r"""
import json, sys
import llama_cpp, llama_cpp.llama_cpp as ll
ll.HEADINFER_AVAILABLE = False
out = {}
try:
    llama_cpp.Llama(sys.argv[1], headinfer_gpu_heads_frac=0.5, flash_attn=True, verbose=False)
except RuntimeError as exc:
    out["error"] = str(exc)
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False)
out["ok"] = llm.tokenize(b"hello") != []
print(json.dumps(out))
""", str(gguf_models["llama-gqa"]))
    assert "HeadInfer KV head split" in out["error"] and "--llama-cpp-python" in out["error"]
    assert out["ok"]


# --------------------------------------------------------------------------
# llama_cpp.server with the official openai client


def _start_server(lcp: dict, model: Path, frac: float, log: Path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env[testing_models.FORCE_SPLIT] = "1"
    handle = log.open("w")
    proc = subprocess.Popen([lcp["python"], "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port), "--n_ctx", "256", "--flash_attn", "true", "--seed", "7",
                             "--headinfer_gpu_heads_frac", str(frac)],
                            cwd=str(log.parent), env=env, stdout=handle, stderr=subprocess.STDOUT)
    return proc, port, handle


def _wait_ready(proc, port: int, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("server did not come up:\n" + log.read_text()[-3000:])


def test_server_split_answers_like_whole(lcp, gguf_models, tmp_path):
    openai = pytest.importorskip("openai")
    model = gguf_models["llama-gqa"]
    servers = []
    try:
        for frac in (1.0, 0.5):
            servers.append(_start_server(lcp, model, frac, tmp_path / f"server-{frac}.log"))
        answers = []
        for (proc, port, _), frac in zip(servers, (1.0, 0.5)):
            _wait_ready(proc, port, tmp_path / f"server-{frac}.log")
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)
            completion = client.completions.create(model="m", prompt="Once upon a time", max_tokens=16,
                                                   temperature=0.0)
            chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello there"}],
                                                  max_tokens=12, temperature=0.0)
            stream = client.completions.create(model="m", prompt="The baker opened", max_tokens=16,
                                               temperature=0.0, stream=True)
            streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            answers.append((completion.choices[0].text, chat.choices[0].message.content, streamed))
        assert answers[0] == answers[1]
        assert all(answers[0]), answers
        # llama.cpp's one line on the split (the server is verbose); none at 1.0, where nothing splits
        split_log = (tmp_path / "server-0.5.log").read_text()
        assert re.search(r"headinfer: gpu_heads_frac = 0\.500, [1-9]\d* of \d+ layers split", split_log), \
            split_log[-3000:]
        whole_log = (tmp_path / "server-1.0.log").read_text()
        assert "headinfer: gpu_heads_frac" not in whole_log, whole_log[-3000:]
    finally:
        for proc, _port, handle in servers:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            handle.close()


def test_server_refuses_a_bad_fraction(lcp, gguf_models, tmp_path):
    result = subprocess.run([lcp["python"], "-m", "llama_cpp.server", "--model", str(gguf_models["llama-gqa"]),
                             "--headinfer_gpu_heads_frac", "1.5"], cwd=str(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, timeout=60)
    assert result.returncode != 0 and "headinfer_gpu_heads_frac" in result.stdout, result.stdout[-2000:]


# --------------------------------------------------------------------------
# llama-cpp-python 0.3.36's own suite against the patched install, offline

UPSTREAM_CONFTEST = r'''
"""Offline stand-ins (pyllama-headinfer, docs/LLAMA_CPP_PYTHON.md): hf_hub_download returns a local model or skips."""
import os
import pytest
import huggingface_hub

LOCAL = {"lmstudio-community/Qwen3.5-0.8B-GGUF": os.environ.get("LCP_TEST_MODEL"),
         "ggml-org/models": os.environ.get("LCP_TEST_MODEL")}
MODEL_SPECIFIC = {
    "test_real_model": "asserts Qwen3.5-0.8B's token ids; the local stand-in has another vocabulary",
    "test_real_llama": "asserts that two seeds sample different answers from Qwen3.5-0.8B; the stand-in picks the same",
}


def offline_hf_hub_download(repo_id, filename, *args, **kwargs):
    path = LOCAL.get(repo_id)
    if not path:
        pytest.skip(f"offline: {repo_id}/{filename} has no local stand-in")
    return path


huggingface_hub.hf_hub_download = offline_hf_hub_download


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.name in MODEL_SPECIFIC:
            item.add_marker(pytest.mark.skip(reason=MODEL_SPECIFIC[item.name]))
'''
UPSTREAM_COUNTS = {"passed": 13, "skipped": 13}


def test_upstream_suite(lcp, gemma, tmp_path):
    """llama-cpp-python's tests/ (test_llama, _chat_format, _grammar, _speculative) pass against the patched
    install; what they skip is listed in docs/LLAMA_CPP_PYTHON.md."""
    from pyllama_headinfer.source.fetch import cached_tree_path

    model = gemma  # the real Gemma-3-270M Q4_K_M (conftest's fixture: fetched once)
    deps = subprocess.run([lcp["python"], "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           "pytest>=7.4.0", "scipy>=1.10", "huggingface-hub>=0.23.0"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert deps.returncode == 0, deps.stdout

    shutil.copytree(build_dir() / "llama-cpp-python" / "src" / "tests", tmp_path / "tests")
    (tmp_path / "tests" / "conftest.py").write_text(UPSTREAM_CONFTEST, encoding="utf-8")
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "llama.cpp").symlink_to(cached_tree_path())  # the vocab files of the tokenizer test
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_HUB_OFFLINE="1", LCP_TEST_MODEL=str(model))
    t0 = time.monotonic()
    result = subprocess.run([lcp["python"], "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=900)
    print(f"\nllama-cpp-python's suite: {time.monotonic() - t0:.1f} s")
    summary = result.stdout.strip().splitlines()[-1]
    counts = {k: int(n) for n, k in __import__("re").findall(r"(\d+) (passed|skipped|failed|error)", summary)}
    assert result.returncode == 0 and counts == UPSTREAM_COUNTS, result.stdout[-5000:]
