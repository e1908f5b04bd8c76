"""``serve``: the patched llama-server under the split, driven by the official
``openai`` client (issue 14).

The real server runs twice on this machine's loopback, at frac 1.0 and 0.5
with ``LLAMA_HEADINFER_FORCE_SPLIT=1`` (so the CPU build splits), on a
synthetic model with four KV heads; every answer -- text, token ids, logprobs,
saved slot files -- must be identical between the two. Requests are few and
short; each server is stopped by the test that started it.

llama-server comes from ``build --tools`` in the checkout's ``build/cpu``
(conftest's ``server_binary`` builds the tools when they are missing: ~7 min on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from pyllama_headinfer.cli import serve as serve_cli
from pyllama_headinfer.errors import ServeError
from pyllama_headinfer.runtime.manifest import describe_choice, find_manifest
from testing_models import CORPUS, FORCE_SPLIT

N_CTX = 512  # two slots of 256 cells
PROMPT = CORPUS[:160]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One llama-server started through serve_cli (the code `serve` runs)."""

    def __init__(self, binary, model, frac, tmp_path, extra=()):
        self.slots = tmp_path / f"slots-{frac}"
        self.slots.mkdir(exist_ok=True)
        self.command = serve_cli.server_command(
            model, frac=frac, vram_budget=None, margin="0", host="127.0.0.1", port=free_port(),
            extra=["-c", str(N_CTX), "-np", "2", "-t", "2", "--slot-save-path", str(self.slots), "--context-shift",
                   "--no-warmup", *extra], server=binary)
        env = dict(os.environ, **{FORCE_SPLIT: "1"})
        self.proc, self.pump = serve_cli.start_server(self.command, echo=None, timeout=120, env=env)
        self.client = openai.OpenAI(base_url=self.command.url + "/v1", api_key="none", timeout=120, max_retries=0)

    def post(self, path, body):
        request = urllib.request.Request(self.command.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.loads(response.read())

    def stop(self):
        return serve_cli.stop_server(self.proc)


def scenario(server: Server) -> dict:
    """Everything a client sees, in a comparable form."""
    c, out = server.client, {}
    common = dict(model="test", temperature=0, seed=1)
    r = c.completions.create(prompt=PROMPT, max_tokens=24, logprobs=2, **common)
    # llama-server gives the logprobs of /v1/completions in the chat form: token ids, logprobs, top-2
    out["completion"] = (r.choices[0].text, [(d["id"], d["logprob"], [(t["id"], t["logprob"])
                                                                       for t in d["top_logprobs"]])
                                             for d in r.choices[0].logprobs.content], r.usage.completion_tokens)
    out["completion_stream"] = "".join(ch.choices[0].text for ch in
                                       c.completions.create(prompt=PROMPT, max_tokens=24, stream=True, **common))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": CORPUS[:80]}]
    r = c.chat.completions.create(messages=messages, max_tokens=20, logprobs=True, top_logprobs=2, **common)
    out["chat"] = r.choices[0].message.content
    out["chat_logprobs"] = [(t.token, t.logprob, [(u.token, u.logprob) for u in t.top_logprobs])
                            for t in r.choices[0].logprobs.content]
    out["chat_stream"] = "".join(ch.choices[0].delta.content or "" for ch in
                                 c.chat.completions.create(messages=messages, max_tokens=20, stream=True, **common))
    # token ids: llama-server's own endpoint
    native = server.post("/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "return_tokens": True,
                                         "cache_prompt": True})
    out["native"] = (native["content"], native["tokens"])
    # a prompt that extends the cached one: the server reuses the prefix's cells
    longer = server.post("/completion", {"prompt": PROMPT + CORPUS[160:200], "n_predict": 16, "temperature": 0,
                                         "return_tokens": True, "cache_prompt": True, "id_slot": native["id_slot"]})
    out["cached_prefix"] = (longer["content"], longer["tokens"], longer["timings"]["cache_n"] > 0)
    # two slots at once
    results = [None, None]

    def ask(i):
        results[i] = c.completions.create(prompt=CORPUS[40 * i:40 * i + 120], max_tokens=20, **common).choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["parallel"] = results
    # slot save / restore
    server.post("/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0, "id_slot": 0,
                                "cache_prompt": True})
    saved = server.post("/slots/0?action=save", {"filename": "slot0.bin"})
    out["slot_file"] = (server.slots / "slot0.bin").read_bytes()
    server.post("/slots/0?action=erase", {})
    restored = server.post("/slots/0?action=restore", {"filename": "slot0.bin"})
    after = server.post("/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "id_slot": 0,
                                        "cache_prompt": True, "return_tokens": True})
    out["restored"] = (saved["n_saved"], restored["n_restored"], after["content"], after["tokens"],
                       after["timings"]["cache_n"] > 0)
    # a generation longer than the slot's context: the context shift
    long = server.post("/completion", {"prompt": CORPUS[:100], "n_predict": 400, "temperature": 0,
                                       "return_tokens": True, "id_slot": 1, "ignore_eos": True})
    out["context_shift"] = (long["content"], long["tokens"], long["tokens_predicted"])
    return out


@pytest.fixture(scope="module")
def answers(server_binary, gguf_models, tmp_path_factory):
    model = gguf_models["llama-gqa"]
    got, logs = {}, {}
    for frac in (1.0, 0.5):
        server = Server(server_binary, model, frac, tmp_path_factory.mktemp("serve"))
        try:
            got[frac] = scenario(server)
            logs[frac] = list(server.pump.headinfer)
        finally:
            assert server.stop() == 0
    return got, logs


def test_every_answer_is_identical_between_fractions(answers):
    got, _ = answers
    assert got[1.0].keys() == got[0.5].keys()
    for key in got[1.0]:
        assert got[1.0][key] == got[0.5][key], key


def test_the_scenario_exercised_what_it_claims(answers):
    got, logs = answers
    a = got[0.5]
    assert a["completion"][0] and 0 < len(a["completion"][1]) <= a["completion"][2]
    assert a["completion"][0] == a["completion_stream"] and a["chat"] == a["chat_stream"]
    assert len(a["native"][1]) == 16
    assert a["cached_prefix"][2], "the longer prompt did not reuse the cached prefix"
    assert all(a["parallel"]) and a["parallel"][0] != a["parallel"][1]
    assert a["restored"][0] > 0 and a["restored"][0] == a["restored"][1] and a["restored"][4]
    assert a["context_shift"][2] == 400  # more than the slot's 256 cells
    assert any("split" in line for line in logs[0.5]), logs[0.5]  # the server says the split is on
    assert not any("split" in line and "0.5" in line for line in logs[1.0])


def test_chunked_attention_answers_identically_between_fractions(server_binary, gguf_models, tmp_path_factory):
    """The attention in chunks (issue 30) through llama-server's flags (patch 0033), with slots of 512 cells
    in chunks of 256: every answer of the scenario -- parallel slots, cached prefixes, slot save/restore --
    is the same at frac 0.5 as at 1.0, and the server says the mode is on."""
    chunked = ("-c", "1024", "--headinfer-attn", "chunked", "--headinfer-attn-chunk", "256", "-lv", "4")
    got, lines = {}, {}
    for frac in (1.0, 0.5):
        server = Server(server_binary, gguf_models["llama-gqa"], frac, tmp_path_factory.mktemp("chunked"), extra=chunked)
        try:
            got[frac] = scenario(server)
            lines[frac] = list(server.pump.headinfer)
        finally:
            assert server.stop() == 0
    for key in got[1.0]:
        assert got[1.0][key] == got[0.5][key], key
    for frac in (1.0, 0.5):
        assert any("every layer attends in chunks of 256 KV cells" in line for line in lines[frac]), lines[frac]


@pytest.mark.parametrize("extra, frac, noted", [
    (["-np", "4"], 0.5, True),              # one KV stream per slot, split: n_kv cells of every slot cross the link
    (["--parallel", "2", "-c", "4096"], 0.25, True),
    (["-np", "4", "-kvu"], 0.5, False),     # one unified cache
    (["-np", "4"], 1.0, False),             # nothing split
    ([], 0.5, False),                       # llama-server's auto: unified
    (["-np", "1"], 0.5, False),
])
def test_serve_notes_the_per_slot_upload(gguf_models, tmp_path, extra, frac, noted):
    command = serve_cli.server_command(gguf_models["llama-gqa"], frac=frac, vram_budget=None, margin="0",
                                       host="127.0.0.1", port=8080, extra=extra, server=tmp_path / "llama-server")
    assert any("-kvu" in note and "one KV stream per slot" in note for note in command.notes) == noted, command.notes


@pytest.mark.parametrize("extra, env, threads", [
    ([], {}, "default"),                    # -t N: the CPUs this process may run on, not llama-server's cores
    (["-t", "3"], {}, None),                # given: left as given
    (["--threads=5"], {}, None),
    ([], {"LLAMA_ARG_THREADS": "6"}, None),  # llama-server's own variable: not overridden by a -t
])
def test_serve_passes_the_threads(gguf_models, tmp_path, monkeypatch, extra, env, threads):
    from pyllama_headinfer.params import default_n_threads

    monkeypatch.delenv("LLAMA_ARG_THREADS", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command = serve_cli.server_command(gguf_models["llama-gqa"], frac=1.0, vram_budget=None, margin="0",
                                       host="127.0.0.1", port=8080, extra=extra, server=tmp_path / "llama-server")
    given = [w for w in command.argv if w.split("=", 1)[0] in ("-t", "--threads")]
    if threads == "default":
        assert command.argv[command.argv.index("-t") + 1] == str(default_n_threads()) and given == ["-t"]
    else:
        assert given == [w for w in extra if w.split("=", 1)[0] in ("-t", "--threads")]


@pytest.mark.parametrize("backend, says", [
    ("cpu", "the whole KV cache in CPU memory (a CPU build: no device)"),
    ("cuda", "the whole KV cache in the layers' own buffers (on the GPU for the layers offloaded with -ngl)"),
    (None, "the whole KV cache in the layers' own buffers"),
])
def test_serve_says_where_an_unsplit_cache_is(gguf_models, tmp_path, backend, says):
    """At frac 1.0 serve says where the KV cache is as the build tells it: a CPU build has no device."""
    from types import SimpleNamespace

    command = serve_cli.server_command(gguf_models["llama-gqa"], frac=1.0, vram_budget=None, margin="0",
                                       host="127.0.0.1", port=8080, extra=[], server=tmp_path / "llama-server",
                                       backend=backend)
    assert command.backend == backend
    text = serve_cli.split_decision(SimpleNamespace(headinfer=[]), command.frac, command.backend)
    assert text == f"HeadInfer split off (frac 1.0): {says}"
    # the build the tests run on says what it is (what serve reads when it finds the server itself)
    assert find_manifest().data.get("backend") in ("cpu", "cuda")


def test_serve_refuses_a_port_in_use(server_binary, gguf_models):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        command = serve_cli.server_command(gguf_models["llama-gqa"], frac=0.5, vram_budget=None, margin="0",
                                           host="127.0.0.1", port=port, extra=[], server=server_binary)
        with pytest.raises(ServeError, match=f"port {port} on 127.0.0.1 is in use"):
            serve_cli.start_server(command, echo=None, timeout=30)


def test_serve_reports_a_server_that_dies_while_starting(server_binary, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    command = serve_cli.server_command(bad, frac=1.0, vram_budget=None, margin="0", host="127.0.0.1",
                                       port=free_port(), extra=[], server=server_binary)
    with pytest.raises(ServeError, match="exited with status .* while starting"):
        serve_cli.start_server(command, echo=None, timeout=60)


def test_serve_usage_errors(gguf_models, tmp_path, capsys):
    from pyllama_headinfer.cli import main as cli

    model = str(gguf_models["llama-gqa"])
    assert cli.main(["serve", "--model", str(tmp_path / "missing.gguf")]) == 2
    assert "model not found" in capsys.readouterr().err
    assert cli.main(["serve", "--model", model, "--frac", "1.5"]) == 2
    assert "must be in [0, 1]" in capsys.readouterr().err
    assert cli.main(["serve", "--model", model, "--", "-hgf", "0.5"]) == 2
    assert "as serve's own options" in capsys.readouterr().err
    assert cli.main(["serve", "--model", model, "--frac", "0.5", "--vram-budget", "1GiB"]) == 2  # argparse


def test_draft_model_keeps_its_kv_whole(server_binary, gguf_models, tmp_path):
    """Speculative decoding with a draft (issue 14.2): the target splits, the draft does not;
    greedy answers equal those without a draft."""
    model = gguf_models["llama-gqa"]
    texts, lines, timings = {}, {}, {}
    # -lv 4: llama.cpp's INFO lines, where each KV cache says how many of its layers it split;
    # --spec-type draft-simple: at the pin a plain draft model (-md) drafts only when asked to
    draft = ("-md", str(model), "--spec-type", "draft-simple", "--spec-draft-n-max", "4")
    for name, extra in (("plain", ("-lv", "4")), ("draft", ("-lv", "4", *draft))):
        (tmp_path / name).mkdir()
        server = Server(server_binary, model, 0.5, tmp_path / name, extra=extra)
        try:
            answer = server.post("/completion", {"prompt": PROMPT, "n_predict": 24, "temperature": 0,
                                                 "return_tokens": True})
            texts[name], timings[name] = answer["tokens"], answer["timings"]
            lines[name] = [line for line in server.pump.headinfer if "split" in line]
        finally:
            server.stop()
    assert texts["draft"] == texts["plain"]
    # the model drafts for itself: the server drafted, and the target accepted (almost) everything
    assert "draft_n" not in timings["plain"] and timings["draft"]["draft_n"] >= 4
    assert timings["draft"]["draft_n_accepted"] > 0.9 * timings["draft"]["draft_n"], timings["draft"]
    assert len(lines["draft"]) == len(lines["plain"]) >= 1, lines  # no second split line: the draft's context


def assistant_drafts(binary, models, frac, tmp_path, extra=(), env=None) -> dict:
    """One greedy completion of the gemma4 test model split at ``frac`` with its Gemma 4 assistant drafting from the
    target's KV cache (multi-token prediction, a draft context with ``ctx_other``): the tokens, the draft candidates
    the server logged at each draft step (token ids and probabilities: the draft model's output over the shared
    cache), the server's timings and the lines where the caches say what they split and share."""
    log = tmp_path / f"server-{frac}.log"
    command = serve_cli.server_command(
        models["gemma4-iswa"], frac=frac, vram_budget=None, margin="0", host="127.0.0.1", port=free_port(),
        extra=["-c", "512", "-np", "1", "-t", "2", "--no-warmup", "-md", str(models["gemma4-assistant"]),
               "--spec-type", "draft-mtp", "-v", *extra], server=binary)
    with open(log, "w", encoding="utf-8") as echo:
        proc, _ = serve_cli.start_server(command, echo=echo, timeout=120,
                                         env=dict(env or os.environ, **{FORCE_SPLIT: "1"}))
        try:
            request = urllib.request.Request(command.url + "/completion", headers={"Content-Type": "application/json"},
                                             data=json.dumps({"prompt": PROMPT, "n_predict": 24, "temperature": 0,
                                                              "return_tokens": True}).encode())
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.loads(response.read())
        finally:
            assert serve_cli.stop_server(proc) == 0
    lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    return {"tokens": answer["tokens"], "timings": answer["timings"],
            # "0.01.234.567 D spec        draft:  - seq_id 0, draft candidate   0, pos   0:  506 (0.229) ' ke'"
            "candidates": [line.split(" - ", 1)[1] for line in lines if "draft candidate" in line],
            "split": [line for line in lines if "headinfer: gpu_heads_frac" in line],
            "shared": [line for line in lines if "sharing with layer" in line]}


@pytest.fixture(scope="module")
def draft_models(test_models_dir) -> dict:
    import testing_models

    return testing_models.ensure_draft_models(test_models_dir)


def test_an_assistant_reading_the_targets_split_cache_drafts_as_over_a_whole_one(server_binary, draft_models,
                                                                                  tmp_path):
    """A draft context that shares the target's KV cache (Gemma 4's assistant: llama-server -md with draft-mtp) reads
    the target's host heads: every draft candidate, token and probability, is the one drafted over the whole cache."""
    got = {frac: assistant_drafts(server_binary, draft_models, frac, tmp_path) for frac in (1.0, 0.5)}
    split, whole = got[0.5], got[1.0]
    assert len(split["candidates"]) >= 24, split["candidates"]  # three candidates a draft step, a step a token
    assert split["candidates"] == whole["candidates"]
    assert split["tokens"] == whole["tokens"]
    assert split["timings"]["draft_n"] == whole["timings"]["draft_n"]
    # the target split every layer of both its caches; the assistant reads the target's layers 3 and 4
    assert any("5 of 5 layers split" in line for line in split["split"]), split["split"]
    assert not any("layers split" in line for line in whole["split"]), whole["split"]
    assert [line.split("sharing ", 1)[1].split(".")[0] for line in split["shared"]] == \
        ["with layer 4", "with layer 3"], split["shared"]


def test_an_assistant_reading_a_streamed_split_cache_drafts_as_over_a_whole_one(rpc_build, draft_models, tmp_path):
    """The same on an offload device (a local RPC server), where the target's host heads are streamed to the device:
    the assistant's context reads them when its layer starts and never before (no prefetch), so it sees every row the
    target just stored. With prefetch on in the assistant's context its draft candidates differ from the whole cache's
    (a probability of 0.342 against 0.340 at the first draft step, measured with the prefetch forced on)."""
    from testing_scripts import load_script

    env = dict(os.environ, PYLLAMA_HEADINFER_BUILD_DIR=str(rpc_build))
    with load_script("gpu_check").rpc_servers(1, env=env) as endpoints:
        on_device = ["--rpc", endpoints[0], "-ngl", "99", "-ngld", "99", "-dev", "RPC0", "-devd", "RPC0"]
        got = {frac: assistant_drafts(rpc_build / "bin" / serve_cli.SERVER, draft_models, frac, tmp_path,
                                      extra=on_device, env=env) for frac in (1.0, 0.5)}
    split, whole = got[0.5], got[1.0]
    assert len(split["candidates"]) >= 24 and split["timings"]["draft_n"] > 0, split["timings"]
    assert split["candidates"] == whole["candidates"]
    assert split["tokens"] == whole["tokens"]
    assert any("5 of 5 layers split" in line for line in split["split"]), split["split"]


def test_serve_says_which_build_it_runs(server_binary, gguf_models, capsys):
    """`serve` runs the llama-server of the most recently finished build: it says which one, and why (issue 26)."""
    from pyllama_headinfer.cli import main as cli

    with socket.socket() as busy:  # a port in use: serve stops right after choosing the build
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--model", str(gguf_models["llama-gqa"]), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err
    assert [line for line in err.splitlines() if line.startswith("using ")] == [describe_choice(find_manifest())]


# stands in for llama-server: answers /health, says its pid, never exits by itself
FAKE_SERVER = """
import http.server, os, sys
args = sys.argv[1:]
host, port = args[args.index("--host") + 1], int(args[args.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args):
        pass

with open(os.environ["FAKE_SERVER_PID"], "w") as f:
    f.write(str(os.getpid()))
http.server.HTTPServer((host, port), Health).serve_forever()
"""

# the `serve` wrapper, around the stand-in
WRAPPER = """
import sys
from pathlib import Path
from pyllama_headinfer.cli import serve as serve_cli
command = serve_cli.server_command(sys.argv[1], frac=1.0, vram_budget=None, margin="0", host="127.0.0.1",
                                   port=int(sys.argv[2]), extra=[], server=Path(sys.argv[3]))
sys.exit(serve_cli.serve(command))
"""


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_serve_takes_its_server_along(tmp_path):
    """`kill -9` of `serve` orphaned llama-server (in its own session), which kept the port (issue 26)."""
    server = tmp_path / "llama-server"
    server.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    server.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")  # never read: --frac is given and the stand-in ignores -m
    pid_file, port = tmp_path / "server.pid", free_port()
    root = str(Path(__file__).resolve().parents[1])
    wrapper = subprocess.Popen([sys.executable, "-c", WRAPPER, str(model), str(port), str(server)],
                               stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, FAKE_SERVER_PID=str(pid_file),
                                        PYTHONPATH=os.pathsep.join([root] + sys.path)))
    pid = None
    try:
        lines = []
        for line in wrapper.stderr:  # until the wrapper says the server is ready
            lines.append(line)
            if "ready at" in line:
                break
        assert pid_file.is_file(), "".join(lines)
        pid = int(pid_file.read_text())
        assert _running(pid) and serve_cli.port_in_use("127.0.0.1", port)
        wrapper.send_signal(signal.SIGKILL)
        wrapper.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(pid), "the server outlived the killed serve"
        assert not serve_cli.port_in_use("127.0.0.1", port)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
            wrapper.wait()
        if pid is not None and _running(pid):
            os.kill(pid, signal.SIGKILL)


def test_serve_vram_budget_auto_leaves_the_fraction_to_llama_servers_fit(gguf_models, tmp_path):
    """--vram-budget auto: no -hgf on the command line (llama-server's --fit, on by default, chooses it for the GPU's
    free memory) and a note that says so; a size still plans the fraction here."""
    command = serve_cli.server_command(gguf_models["llama-gqa"], frac=None, vram_budget="auto", margin="0",
                                       host="127.0.0.1", port=8080, extra=[], server=tmp_path / "llama-server")
    assert "-hgf" not in command.argv and "--fit" not in command.argv
    assert any("--vram-budget auto" in note and "--fit" in note for note in command.notes), command.notes
    sized = serve_cli.server_command(gguf_models["llama-gqa"], frac=None, vram_budget="1GiB", margin="0",
                                     host="127.0.0.1", port=8080, extra=["-c", "512"], server=tmp_path / "llama-server")
    assert "-hgf" in sized.argv
