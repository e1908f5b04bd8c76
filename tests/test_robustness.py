"""What a new user hit (issue 16): a Context shared by threads, failed state
loads, state files on a full disk; and (issue 26) a GGUF whose tensors have a
type llama.cpp loads but cannot compute with.

The thread and full-disk cases run in a child interpreter: before the fixes
the first one aborted the process (``GGML_ASSERT(!sched->is_alloc)``), which
would take pytest down with it; the second needs a file-size limit that must
not apply to pytest itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from testing_models import CORPUS, FORCE_SPLIT


@pytest.fixture(scope="module")
def model(llama, gguf_models):
    with llama.Model(gguf_models["llama-gqa"]) as m:
        yield m


def run_child(code: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + sys.path)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


# --------------------------------------------------------------------------
# 16.1: one Context, several threads

THREADS_CHILD = """
    import sys, threading
    from pyllama_headinfer.llama import Model, Context
    from testing_models import CORPUS

    model = Model(sys.argv[1])
    prompt = model.tokenize(CORPUS)[:24]
    with Context(model, n_ctx=256, n_threads=1) as ctx:
        reference = list(ctx.generate(prompt, 48, stop_at_eog=False))
        for round_ in range(4):
            barrier = threading.Barrier(3)
            results = [None] * 3

            def work(i):
                barrier.wait()
                if i == 2:  # a third thread pokes at the context meanwhile
                    for _ in range(20):
                        ctx.n_tokens(), ctx.kv_residency()
                    results[i] = "poked"
                else:
                    results[i] = list(ctx.generate(prompt, 48, stop_at_eog=False))

            threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert results[0] == reference and results[1] == reference, (round_, results)
            assert results[2] == "poked"
    print("threads ok")
"""


def test_one_context_two_threads_generate_as_if_sequential(built, gguf_models):
    proc = run_child(THREADS_CHILD, str(gguf_models["llama-gqa"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "threads ok" in proc.stdout


CLOSE_CHILD = """
    import sys, threading
    from pyllama_headinfer.llama import Model, Context, ClosedError
    from testing_models import CORPUS

    model = Model(sys.argv[1])
    prompt = model.tokenize(CORPUS)[:24]
    ctx = Context(model, n_ctx=256, n_threads=1)
    started = threading.Event()
    outcome = []

    def work():
        try:
            for i, _ in enumerate(ctx.generate(prompt, 200, stop_at_eog=False)):
                started.set()
            outcome.append("finished")
        except ClosedError:
            outcome.append("closed")

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    ctx.close()  # waits for the generation holding the context
    t.join()
    assert ctx.closed and outcome == ["finished"], outcome
    print("close ok")
"""


def test_close_from_another_thread_waits_for_the_running_generation(built, gguf_models):
    proc = run_child(CLOSE_CHILD, str(gguf_models["llama-gqa"]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "close ok" in proc.stdout


# --------------------------------------------------------------------------
# 16.2: a failed state load leaves a cleared context / sequence


def _clean_logits(llama, model, frac, next_tokens, seq_ids=(0,), n_seq_max=1, prefix=None):
    """Logits of decoding next_tokens into a context that never saw a load."""
    with llama.Context(model, n_ctx=256, n_seq_max=n_seq_max, kv_unified=n_seq_max == 1 or None,
                       n_threads=1, headinfer_gpu_heads_frac=frac) as c:
        if prefix is not None:
            c.decode(prefix, seq_id=0)
        out = {}
        for s in seq_ids:
            c.decode(next_tokens, seq_id=s)
            out[s] = c.logits()
        return out


@pytest.fixture(params=[1.0, 0.5], ids=["whole", "split"])
def frac(request, monkeypatch):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    return request.param


def _cuts(n: int):
    return sorted({16, 40, 100, n // 3, n // 2, n - 64, n - 1})


def test_failed_state_load_leaves_a_cleared_context(llama, model, frac, tmp_path):
    toks = model.tokenize(CORPUS)[:16]
    probe = model.tokenize(CORPUS)[16:24]
    with llama.Context(model, n_ctx=256, n_threads=1, headinfer_gpu_heads_frac=frac) as c:
        c.decode(toks)
        state = c.save_state()
        c.save_state_file(tmp_path / "s.bin", toks)
    whole_file = (tmp_path / "s.bin").read_bytes()
    clean = _clean_logits(llama, model, frac, probe)[0]
    for cut in _cuts(len(state)):
        with llama.Context(model, n_ctx=256, n_threads=1, headinfer_gpu_heads_frac=frac) as c:
            c.decode(toks[:5])  # something to lose
            with pytest.raises(llama.StateError):
                c.load_state(state[:cut])
            assert c.n_tokens() == 0, f"bytes cut at {cut}"
            c.decode(probe)
            np.testing.assert_array_equal(c.logits(), clean, err_msg=f"bytes cut at {cut}")
    for cut in _cuts(len(whole_file)):
        (tmp_path / "cut.bin").write_bytes(whole_file[:cut])
        with llama.Context(model, n_ctx=256, n_threads=1, headinfer_gpu_heads_frac=frac) as c:
            with pytest.raises(llama.StateError):
                c.load_state_file(tmp_path / "cut.bin")
            assert c.n_tokens() == 0, f"file cut at {cut}"
            c.decode(probe)
            np.testing.assert_array_equal(c.logits(), clean, err_msg=f"file cut at {cut}")


def test_failed_seq_state_load_leaves_that_sequence_empty(llama, model, frac, tmp_path):
    toks = model.tokenize(CORPUS)[:16]
    probe = model.tokenize(CORPUS)[16:24]
    kw = dict(n_ctx=256, n_seq_max=2, n_threads=1, headinfer_gpu_heads_frac=frac)
    with llama.Context(model, **kw) as c:
        c.decode(toks, seq_id=0)
        state = c.save_seq_state(0)
        c.save_seq_state_file(tmp_path / "seq.bin", 0, toks)
    whole_file = (tmp_path / "seq.bin").read_bytes()
    clean = _clean_logits(llama, model, frac, probe, seq_ids=(1, 0), n_seq_max=2, prefix=toks)
    for what, data in (("bytes", state), ("file", whole_file)):
        for cut in _cuts(len(data)):
            with llama.Context(model, **kw) as c:
                c.decode(toks, seq_id=0)  # the other sequence must survive
                c.decode(toks[:5], seq_id=1)  # and this one's old content must go
                with pytest.raises(llama.StateError):
                    if what == "bytes":
                        c.load_seq_state(data[:cut], 1)
                    else:
                        (tmp_path / "cut.bin").write_bytes(data[:cut])
                        c.load_seq_state_file(tmp_path / "cut.bin", 1)
                assert c.n_tokens(1) == 0 and c.n_tokens(0) == 16, f"{what} cut at {cut}"
                c.decode(probe, seq_id=1)
                np.testing.assert_array_equal(c.logits(), clean[1], err_msg=f"{what} cut at {cut}, seq 1")
                c.decode(probe, seq_id=0)
                np.testing.assert_array_equal(c.logits(), clean[0], err_msg=f"{what} cut at {cut}, seq 0")


# --------------------------------------------------------------------------
# 16.3: saving to a full disk leaves no partial file

FULL_DISK_CHILD = """
    import os, resource, signal, sys
    from pyllama_headinfer.llama import Model, Context, StateError
    from testing_models import CORPUS

    model_path, directory = sys.argv[1], sys.argv[2]
    model = Model(model_path)
    toks = model.tokenize(CORPUS)[:32]
    with Context(model, n_ctx=256, n_threads=1) as ctx:
        ctx.decode(toks)
        size = len(ctx.save_state())
        target = os.path.join(directory, "state.bin")
        with open(target, "wb") as f:
            f.write(b"previous good file")
        # a "full disk": writes past 4 KiB fail with EFBIG (SIGXFSZ ignored, as a full disk sends none)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        for save in (lambda: ctx.save_state_file(target, toks), lambda: ctx.save_seq_state_file(target, 0, toks)):
            try:
                save()
            except StateError as e:
                print("refused:", str(e).splitlines()[0][:80])
            else:
                raise SystemExit(f"a {size}-byte state was saved under a 4 KiB limit")
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("left:", sorted(os.listdir(directory)))
        with open(target, "rb") as f:
            print("target:", f.read())
        ctx.save_state_file(target, toks)  # with room again: the real file
        with Context(model, n_ctx=256, n_threads=1) as other:
            print("loaded", len(other.load_state_file(target)))
"""


def test_state_save_on_a_full_disk_keeps_the_old_file(built, gguf_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    proc = run_child(FULL_DISK_CHILD, str(gguf_models["llama-gqa"]), str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("refused:") for line in lines) == 2, proc.stdout
    assert "left: ['state.bin']" in lines, proc.stdout  # no temporary left behind
    assert "target: b'previous good file'" in lines, proc.stdout
    assert "loaded 32" in lines, proc.stdout
    assert oct(os.stat(out / "state.bin").st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode


# --------------------------------------------------------------------------
# 16.5: the split decision is visible by default


def test_an_ignored_fraction_is_a_warning(llama, model, monkeypatch, recwarn):
    monkeypatch.delenv(FORCE_SPLIT, raising=False)
    with pytest.warns(llama.HeadInferWarning, match=r"0\.5 is ignored: .*KV is in host memory already"):
        llama.Context(model, n_ctx=256, n_threads=1, headinfer_gpu_heads_frac=0.5).close()
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with pytest.warns(llama.HeadInferWarning, match=r"ignored: .*flash attention is off"):
        llama.Context(model, n_ctx=256, n_threads=1, headinfer_gpu_heads_frac=0.5, flash_attn=False).close()


def test_a_split_is_logged_at_info_and_warns_nothing(llama, model, monkeypatch, caplog, recwarn):
    monkeypatch.setenv(FORCE_SPLIT, "1")
    with caplog.at_level("INFO", logger="pyllama_headinfer.llama"):
        llama.Context(model, n_ctx=256, n_threads=1, headinfer_gpu_heads_frac=0.5).close()
        llama.Context(model, n_ctx=256, n_threads=1).close()  # frac 1.0: nothing to say
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("headinfer_gpu_heads_frac")]
    assert len(said) == 1 and "3 of 3 KV layers split" in said[0], said
    assert not [w for w in recwarn if issubclass(w.category, llama.HeadInferWarning)]


# --------------------------------------------------------------------------
# 16.7: smaller things


def test_overflow_message_says_why_n_ctx_differs(llama, model):
    with llama.Context(model, n_ctx=16, n_threads=1) as c:
        with pytest.raises(llama.ContextOverflowError, match=r"n_ctx=256: llama.cpp rounds the requested 16 up"):
            c.decode(list(range(1, 300)))


def test_sampling_parameters_out_of_range_are_refused(llama):
    for kwargs in ({"top_p": 7}, {"top_p": 0}, {"top_k": -1}, {"min_p": 2}, {"temperature": float("nan")}):
        for temperature in (0.0, 0.7):
            with pytest.raises(ValueError):
                llama.Sampler.from_params(**{"temperature": temperature, **kwargs})


def test_a_context_larger_than_the_machine_is_refused_at_once(llama, model):
    with pytest.raises(llama.ContextError, match=r"n_ctx=2147483647 needs .* GiB of KV cache .* more than all the "
                                                 r"memory of this machine"):
        llama.Context(model, n_ctx=2**31 - 1, n_threads=1)
    alive = llama.Context(model, n_ctx=256, n_threads=1)
    alive.close()


def test_cli_prints_a_llama_cpp_error_once(built, gguf_models, capsys):
    from pyllama_headinfer.cli import main as cli

    rc = cli.main(["generate", "--model", str(gguf_models["llama-gqa"]), "--prompt", "hi", "-n", "1",
                   "--cache-type-v", "q4_0", "--no-flash-attn"])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("quantized V cache requires flash_attn") == 1, err


NOT_BUILT_CHILD = """
    from pyllama_headinfer.llama import Model, HeadInferError
    import sys
    try:
        Model(sys.argv[1])
    except HeadInferError as e:
        print(e)
"""


def test_not_built_message_names_the_build_dir_in_use(built, gguf_models, tmp_path):
    env_dir = tmp_path / "elsewhere"
    env = dict(os.environ, PYLLAMA_HEADINFER_BUILD_DIR=str(env_dir),
               PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(NOT_BUILT_CHILD), str(gguf_models["llama-gqa"])],
                          capture_output=True, text=True, env=env, timeout=120)
    message = proc.stdout.strip()
    assert f"build --build-dir {env_dir}`" in message, message
    assert message.count("python -m pyllama_headinfer build") == 1, message


# --------------------------------------------------------------------------
# issue 26: tensor types llama.cpp loads but cannot compute with


def write_retyped(path, tensor: str, dtype) -> "Path":
    """llama-gqa with one tensor stored as ``dtype``: a numpy type (F64, I8, I16, I32) or a
    gguf.GGMLQuantizationType (written as zero bytes of that type's size)."""
    import gguf
    import testing_models as tm
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    add_tensor = gguf.GGUFWriter.add_tensor

    def retyped(self, name, data, *args, **kwargs):
        if name != tensor:
            return add_tensor(self, name, data, *args, **kwargs)
        if isinstance(dtype, GGMLQuantizationType):
            block, size = GGML_QUANT_SIZES[dtype]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), dtype=np.uint8)
            return add_tensor(self, name, raw, raw_dtype=dtype)
        return add_tensor(self, name, (data * 100).astype(dtype))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", retyped)
        return tm.write_model(tm.SPECS["llama-gqa"], path)


def _unrunnable_models(tmp_path):
    from gguf import GGMLQuantizationType

    return {
        "F64": write_retyped(tmp_path / "q-f64.gguf", "blk.0.attn_q.weight", np.float64),  # segfault in decode
        "I32": write_retyped(tmp_path / "emb-i32.gguf", "token_embd.weight", np.int32),  # GGML_ASSERT in Context()
        "I8": write_retyped(tmp_path / "out-i8.gguf", "output.weight", np.int8),
        "Q8_K": write_retyped(tmp_path / "q-q8k.gguf", "blk.1.attn_q.weight", GGMLQuantizationType.Q8_K),
    }


def test_check_gguf_refuses_tensor_types_llama_cpp_cannot_compute_with(tmp_path):
    from pyllama_headinfer.errors import ModelError
    from pyllama_headinfer.llama import check_gguf

    for typ, path in _unrunnable_models(tmp_path).items():
        with pytest.raises(ModelError, match=rf"cannot compute with tensors of type {typ}: \S+\.weight; "):
            check_gguf(path)


UNRUNNABLE_CHILD = """
    import sys
    from pyllama_headinfer.llama import Model, Context, ModelError
    for path in sys.argv[1:]:
        try:
            with Model(path) as model, Context(model, n_ctx=64, n_threads=1) as ctx:
                ctx.decode(model.tokenize("hi"))
            print("ran", path)
        except ModelError as exc:
            print("ModelError", exc)
    with Model(sys.argv[1], vocab_only=True) as model:  # the tokenizer alone computes nothing: allowed
        print("vocab", len(model.tokenize("hi")) > 0)
"""


def test_unrunnable_tensor_types_are_an_error_not_a_crash(built, tmp_path):
    """Before the check, llama.cpp loaded these files and then aborted (GGML_ASSERT) or segfaulted
    in Context() or the first decode, taking the interpreter with it; `generate` died the same way."""
    models = _unrunnable_models(tmp_path)
    child = run_child(UNRUNNABLE_CHILD, *map(str, models.values()))
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [f"ModelError {p}" for p in models.values()], lines
    assert lines[-1] == "vocab True"
    for typ, path in models.items():
        cli = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "generate", "--model", str(path),
                              "--prompt", "hi", "-n", "2"], capture_output=True, text=True, timeout=240,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path)))
        assert cli.returncode == 1, cli.stderr[-3000:]
        assert cli.stderr.strip().splitlines()[-1].startswith(f"error: {path}: llama.cpp cannot compute with "
                                                              f"tensors of type {typ}")
