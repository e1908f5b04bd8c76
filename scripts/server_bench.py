#!/usr/bin/env python3
"""llama-server under the split: n slots under load, and speculative decoding (issue 14, item 6).

    python scripts/server_bench.py load --model M.gguf --frac 1,0.5 --slots 1,2,4 --per-slot --unified \\
        --prompt-tokens 8192 --max-tokens 64 --ngl 99 [--json OUT] [-- more llama-server arguments]
    python scripts/server_bench.py save --model M.gguf --frac 1,0.5,0.25 --prompt-tokens 32768 --ngl 99 [--repeat 5]
    python scripts/server_bench.py spec --model M.gguf --draft D.gguf --draft-max 4,8 --frac 1,0.5 \\
        --prompt-tokens 32768 --max-tokens 128 --ngl 99 [--synth-accept 0.8,0.6] [--json OUT]

Each configuration gets its own patched llama-server, started through the code of
``python -m pyllama_headinfer serve`` (``pyllama_headinfer.cli.serve``: the build's llama-server,
``-fa on``, ``-hgf F``), on a free port of 127.0.0.1; ``--url`` drives a server that is already
running instead. Requests go through the official ``openai`` client (``/v1/completions``) when
it is installed, else through the same HTTP requests made with the standard library
(``--client``); every figure comes from the server's own ``timings`` (llama.cpp's
``server_slot_stats::to_json``: prompt_n/prompt_ms, predicted_n/predicted_ms, draft_n and
draft_n_accepted when it drafted) and from the wall clock.

load: ``-np N`` slots, ``--per-slot`` (one KV stream per slot, ``--no-kv-unified``: the default)
and/or ``--unified`` (``-kvu``), ``-c`` = N x ``--ctx``. N requests on N distinct prompts of
exactly ``--prompt-tokens`` tokens (random words, cut to length with the server's /tokenize) run
in two phases: *fill* (all N at once, 1 token each: the prompt fill time) and *decode* (the same
N requests again, each pinned to its slot, so the prompt comes from the slot's cache and all N
slots decode together for ``--max-tokens`` tokens, ``ignore_eos``, temperature 0). Aggregate
tok/s = sum of predicted_n / the longest predicted_ms (server) and sum of completion tokens /
the decode phase's wall time (wall). The server runs with ``--no-cache-idle-slots``: otherwise a
unified cache would move the idle slots' prompts to RAM when the first decode request arrives and
restore them one by one, and the decode phase would measure that copying. With one slot the two
layouts are the same cache (one stream), so one server runs ("1 stream").

spec: one slot (``-np 1``), the target split by ``--frac``, the draft model (``-md``,
``--spec-type draft-simple --spec-draft-n-max K``: at this pin a plain draft model drafts only
with --spec-type) whole on the device (patch 0016); one request per server, the same two
phases. Rows: no draft, then each K, at each fraction; tok/s, draft tokens proposed and
accepted (the server's draft_n / draft_n_accepted), acceptance, speed-up over no draft at the
same fraction. ``--synth-accept A[,A...]`` turns on llama-server's synthetic acceptance
(``--spec-synth-rates A,A^2,...,A^K``, "benchmarking only": each draft token is accepted with
probability A once the ones before it were, whatever it is), for models whose own acceptance
means nothing: the zero-weight models of scripts/make_bench_model.py predict ties, which the
draft and the target break differently (acceptance 0).

memory: ``-np N`` slots, one KV stream each (``--no-kv-unified``), ``--context-shift``, llama.cpp's
debug log on (``-lv 5``, into ``--server-log`` or a temporary file): the N prompts filled and
decoded as in *load*, then slot 0 generates past the end of its context, so the server shifts it
(K-shift). Rows per fraction: the device compute buffers and the scheduler's staging buffer as
reserved, whether the staging buffer or a compute buffer grew after the reservation (the log's
"staging buffer from" / "reallocating" lines), the slot's context shift seen, and ``plan``'s
estimate of the compute buffer and of what the split adds (its arena) for the same context.

save: one slot (``-np 1``, ``--slot-save-path``) holding a prompt of ``--prompt-tokens`` tokens
(+1 generated), then ``--repeat`` saves of the slot (``POST /slots/0?action=save``) and as many
restores of one file (``--save-dir``); rows per fraction: the bytes written, the median of the server's own ``save_ms`` and
``restore_ms`` (the time of ``llama_state_seq_save_file`` / ``load_file``), and the ratio to the
first fraction given (put 1 first). The files are removed afterwards.

Errors are one line (exit 1; bad arguments exit 2). ``main(argv)`` returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, List, NamedTuple, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pyllama_headinfer.cli import serve as serve_cli  # noqa: E402
from pyllama_headinfer.runtime.log import compute_buffers_mib  # noqa: E402
from pyllama_headinfer.errors import HeadInferError, ServeError, UsageError  # noqa: E402

PROG = "server_bench"
REQUEST_TIMEOUT_S = 1800.0  # a 32K prompt split on a slow machine takes minutes

# plain words for the prompts: distinct random sequences of them, one seed per prompt
WORDS = """
able about above across after again against along among animal answer apple area around back bank
base beach bird black blue board boat body book bottom bread bridge bright brother brown build
burn busy cake call camp card care carry case catch cause center chair chance change cheap check
child circle city class clean clear clock close cloud coast cold color common corner cotton count
country cover crowd cup dance dark daughter dear deep desert dinner direct dog door double dream
dress drink drive during early earth east edge egg empty energy engine evening event example eye
face fact fall family farm father field figure fine finger fire fish floor flower follow food
foot forest form friend front fruit full game garden gate gentle glass gold grass great green
ground group grow half hand happy heart heavy hill history hold hole horse hour house ice idea
island iron join jump keep kind king kitchen knife lake land large laugh lead leaf learn letter
light line lion list little long lost loud love machine main market match metal middle milk mind
minute modern money moon morning mother mountain mouth music name narrow nation nature near night
noise north note number ocean office open orange order paper party path pencil people piece place
plain plant plate point pool poor power press price print quick quiet rain reach ready record red
river road rock room root rope round rule salt sand school science sea season seat second seed
shape sharp ship shore short silver simple sister size skin sky sleep slow small smile snow soft
soil song sound south space speed spring square stage star station steel stone store storm story
street strong sugar summer sun table tail teacher thick thin thought tiny top town train tree
under valley village voice wall warm water wave weather west wheel white wide wind window winter
wood word work world yard year yellow young
""".split()


class BenchError(HeadInferError):
    """A run that could not be measured (the server answered, but not as expected)."""


# --------------------------------------------------------------------------
# talking to the server


def _post(url: str, path: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")[:300]
        raise BenchError(f"{url}{path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise BenchError(f"{url}{path}: {exc}") from None


def _get(url: str, path: str, timeout: float = 30.0) -> dict:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as response:
            return json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BenchError(f"{url}{path}: {exc}") from None


class Client:
    """``/v1/completions`` through the openai client (``kind`` "openai") or urllib ("http"):
    the response as JSON, with llama-server's extra ``timings``."""

    def __init__(self, url: str, kind: str = "auto", timeout: float = REQUEST_TIMEOUT_S) -> None:
        self.url, self.timeout = url, timeout
        if kind == "auto":
            try:
                import openai  # noqa: F401
                kind = "openai"
            except ImportError:
                kind = "http"
        self.kind = kind
        if kind == "openai":
            try:
                import openai
            except ImportError:
                raise UsageError("--client openai: the openai package is not installed (pip install openai)") \
                    from None
            self._openai = openai
            self._oa = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)

    def completion(self, prompt: List[int], max_tokens: int, extra: dict) -> dict:
        if self.kind == "openai":
            try:
                r = self._oa.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens,
                                                temperature=0, extra_body=extra)
            except self._openai.OpenAIError as exc:
                raise BenchError(f"{self.url}/v1/completions: {type(exc).__name__}: {exc}") from None
            data = r.model_dump()
            data.setdefault("timings", (r.model_extra or {}).get("timings"))
            return data
        body = dict(model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)
        return _post(self.url, "/v1/completions", body, self.timeout)


def tokenize(url: str, text: str) -> List[int]:
    """The server's tokens of ``text``, with BOS as a completion prompt gets it."""
    return _post(url, "/tokenize", {"content": text, "add_special": True}, 120.0)["tokens"]


def make_prompts(url: str, n: int, n_tokens: int, seed: str = "0") -> List[List[int]]:
    """``n`` distinct prompts of exactly ``n_tokens`` tokens: random words, cut with /tokenize."""
    sample = " ".join(WORDS[:64])
    per_word = max(len(tokenize(url, sample)) / 64, 0.25)
    prompts = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        n_words = int(n_tokens / per_word * 1.2) + 16
        while True:
            tokens = tokenize(url, " ".join(rng.choice(WORDS) for _ in range(n_words)))
            if len(tokens) >= n_tokens:
                break
            n_words *= 2
        prompts.append(tokens[:n_tokens])
    if len({tuple(p[:64]) for p in prompts}) < n:
        raise BenchError("two prompts begin with the same tokens: the vocabulary is too small for distinct prompts")
    return prompts


def _timings(response: dict) -> dict:
    t = response.get("timings")
    if not isinstance(t, dict) or "predicted_n" not in t or "predicted_ms" not in t:
        raise BenchError("the server's response has no `timings` (predicted_n/predicted_ms): not the llama-server "
                         "of this project's build?")
    return t


def _completion_tokens(response: dict) -> int:
    return int((response.get("usage") or {}).get("completion_tokens", -1))


def run_parallel(calls: Sequence[Callable[[], dict]]) -> tuple:
    """Run the calls in threads released together: (results, wall seconds until the last ended)."""
    results: List[Optional[dict]] = [None] * len(calls)
    errors: List[BaseException] = []
    barrier = threading.Barrier(len(calls) + 1)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return results, wall


def fill_and_decode(client: Client, prompts: List[List[int]], max_tokens: int) -> dict:
    """Both phases on slots 0..n-1 (request i pinned to slot i): figures and the raw timings."""
    n = len(prompts)

    def call(i: int, tokens: int) -> Callable[[], dict]:
        extra = {"id_slot": i, "cache_prompt": True, "ignore_eos": True}
        return lambda: client.completion(prompts[i], tokens, extra)

    fill, fill_wall = run_parallel([call(i, 1) for i in range(n)])
    decode, decode_wall = run_parallel([call(i, max_tokens) for i in range(n)])
    ft = [_timings(r) for r in fill]
    dt = [_timings(r) for r in decode]
    predicted = [int(t["predicted_n"]) for t in dt]
    longest_ms = max(float(t["predicted_ms"]) for t in dt)
    per_slot = [1e3 * int(t["predicted_n"]) / float(t["predicted_ms"]) if t["predicted_ms"] else 0.0 for t in dt]
    tokens = [_completion_tokens(r) for r in decode]
    return {
        "prompt_tokens": [len(p) for p in prompts],
        "fill_prompt_n": [int(t["prompt_n"]) for t in ft],
        "fill_cache_n": [int(t.get("cache_n", 0)) for t in ft],
        "fill_s": fill_wall,
        "fill_tok_s": sum(len(p) for p in prompts) / fill_wall if fill_wall > 0 else 0.0,
        "fill_prompt_ms_max": max(float(t["prompt_ms"]) for t in ft),
        "decode_cache_n": [int(t.get("cache_n", 0)) for t in dt],
        "decode_prompt_n": [int(t["prompt_n"]) for t in dt],
        "predicted_n": predicted,
        "completion_tokens": tokens,
        "agg_tok_s": 1e3 * sum(predicted) / longest_ms if longest_ms > 0 else 0.0,
        "agg_wall_tok_s": sum(predicted) / decode_wall if decode_wall > 0 else 0.0,
        "per_slot_tok_s": sum(per_slot) / n,
        "decode_wall_s": decode_wall,
        "timings_fill": ft,
        "timings_decode": dt,
        "draft_n": sum(int(t.get("draft_n", 0)) for t in dt),
        "draft_n_accepted": sum(int(t.get("draft_n_accepted", 0)) for t in dt),
        "timings_found": True,
        "texts": [((r.get("choices") or [{}])[0]).get("text") for r in decode],
    }


def _check_reuse(result: dict, label: str) -> None:
    """Warn when the fill found a prompt cached already (the fill time is then too short), or a decode
    request did not find its prompt in its slot (its fill is then in the decode wall time)."""
    cached = [i for i, c in enumerate(result["fill_cache_n"]) if c > 0]
    if cached:
        print(f"{PROG}: warning: {label}: slot(s) {cached} had their prompt cached before the fill phase: "
              "the prompt fill time is too short", file=sys.stderr)
    missed = [i for i, (c, p) in enumerate(zip(result["decode_cache_n"], result["prompt_tokens"])) if c < p - 1]
    result["cache_reused"] = not missed
    if missed:
        print(f"{PROG}: warning: {label}: slot(s) {missed} evaluated their prompt again in the decode phase "
              "(cache not reused): the wall tok/s include a fill", file=sys.stderr)


# --------------------------------------------------------------------------
# servers


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Running(NamedTuple):
    url: str
    split: str  # what llama.cpp logged about the split (serve's split_decision)


class ServerRun:
    """A llama-server for one configuration, started like ``serve`` starts it; stopped on exit."""

    def __init__(self, args, frac: float, extra: List[str], label: str) -> None:
        self.args, self.frac, self.extra, self.label = args, frac, extra, label
        self.proc = self.pump = None
        self.log = None

    def __enter__(self) -> Running:
        a = self.args
        command = serve_cli.server_command(a.model, frac=self.frac, vram_budget=None, margin="0", host=a.host,
                                           port=a.port or free_port(a.host), extra=self.extra,
                                           server=Path(a.server) if a.server else None)
        if a.server_log:
            self.log = open(a.server_log, "a", encoding="utf-8")
            self.log.write(f"\n===== {self.label}: {' '.join(command.argv)}\n")
        try:
            self.proc, self.pump = serve_cli.start_server(command, echo=self.log, timeout=a.startup_timeout)
        except BaseException:
            self.__exit__()
            raise
        split = serve_cli.split_decision(self.pump, command.frac, command.backend)
        print(f"{PROG}: {self.label}: {command.url}; split: {split}", file=sys.stderr)
        return Running(url=command.url, split=split)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            serve_cli.stop_server(self.proc)
            self.pump.join(timeout=5)  # the server's last lines, before the log closes
        if self.log is not None:
            self.log.close()


class External:
    """``--url``: a server started elsewhere (never stopped here)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def __enter__(self) -> Running:
        if not serve_cli._healthy(self.url):
            raise BenchError(f"no llama-server answers {self.url}/health")
        return Running(url=self.url, split="external server")

    def __exit__(self, *exc) -> None:
        pass


def _common_server_args(args) -> List[str]:
    extra = []
    if args.ngl is not None:
        extra += ["-ngl", str(args.ngl)]
    if args.threads:
        extra += ["-t", str(args.threads)]
    return extra


# --------------------------------------------------------------------------
# the two modes


def _seed(args, index: int) -> str:
    """The prompts' seed: the same prompts for every server started here (comparable rows); new ones
    for each run on an external server, whose slots keep the last run's prompts cached."""
    return f"{args.seed}:{index}" if args.url else str(args.seed)


LAYOUTS = {"per-slot": ["--no-kv-unified"], "unified": ["-kvu"]}


def load_configs(args) -> List[dict]:
    layouts = [name for name, on in (("per-slot", args.per_slot), ("unified", args.unified)) if on] or ["per-slot"]
    configs = []
    for frac in args.fracs:
        for n in args.slot_counts:
            for layout in (["1 stream"] if n == 1 else layouts):
                configs.append({"frac": frac, "slots": n, "kv": layout})
    return configs


def run_load(args, rows: List[dict]) -> None:
    """One row per configuration, appended to ``rows`` as it is measured."""
    if args.url:
        props = _get(args.url, "/props")
        total = int(props.get("total_slots", 1))
        counts = args.slot_counts if args.slots_given else [total]
        if max(counts) > total:
            raise UsageError(f"--slots {max(counts)}: the server at {args.url} has {total} slot(s)")
        configs = [{"frac": None, "slots": n, "kv": "external"} for n in counts]
    else:
        configs = load_configs(args)
    for index, cfg in enumerate(configs):
        n = cfg["slots"]
        label = f"load: {n} slot(s), {cfg['kv']}" + ("" if cfg["frac"] is None else f", frac {cfg['frac']:g}")
        if args.url:
            server = External(args.url)
        else:
            extra = ["-np", str(n), "-c", str(args.ctx * n), *LAYOUTS.get(cfg["kv"], []), "--no-cache-idle-slots",
                     *_common_server_args(args), *args.server_args]
            server = ServerRun(args, cfg["frac"], extra, label)
        with server as running:
            client = Client(running.url, args.client, args.request_timeout)
            prompts = make_prompts(running.url, n, args.prompt_tokens, _seed(args, index))
            result = fill_and_decode(client, prompts, args.max_tokens)
        _check_reuse(result, label)
        rows.append({**cfg, "split": running.split, "client": client.kind, "max_tokens": args.max_tokens,
                     "ctx_per_slot": args.ctx, **result})


_STAGING_RE = re.compile(r"(\S+) staging buffer from ([0-9.]+) MiB to ([0-9.]+) MiB")
_SHIFT_RE = re.compile(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)")


def memory_figures(log_text: str, mark: int) -> dict:
    """The device buffers a server logged (llama.cpp's debug log): compute buffers as last reserved before ``mark``
    (an offset into the log; the device's own, staging included: not the CPU's nor a pinned host buffer such as
    CUDA_Host), the staging buffer as reserved, and what grew after ``mark``."""
    before, after = log_text[:mark], log_text[mark:]
    compute = {name: mib for name, mib in compute_buffers_mib([(None, line) for line in before.splitlines()]).items()
               if not name.startswith("CPU") and not name.endswith("_Host")}
    staging = {m.group(1): float(m.group(3)) for m in _STAGING_RE.finditer(before)}
    return {"compute_mib": compute, "staging_mib": staging,
            "staging_grew": [m.group(0) for m in _STAGING_RE.finditer(after)],
            "compute_grew": [line for line in after.splitlines() if "reallocating" in line],
            "shifts": len(_SHIFT_RE.findall(after))}


def run_memory(args, rows: List[dict]) -> None:
    """One row per fraction: the device memory of N slots' streams and a context shift (see the module help)."""
    from pyllama_headinfer.params import ContextParams
    from pyllama_headinfer.vram.plan import plan_kv

    n = args.slot_counts[-1]
    for frac in args.fracs:
        label = f"memory: {n} slot(s), one stream each, frac {frac:g}"
        if args.server_log:
            log_path = Path(args.server_log)
        else:
            fd, name = tempfile.mkstemp(suffix=".log")
            os.close(fd)
            log_path = Path(name)
        start = log_path.stat().st_size if log_path.exists() else 0
        extra = ["-np", str(n), "-c", str(args.ctx * n), "--no-kv-unified", "--context-shift", "-lv", "5",
                 "--no-cache-idle-slots", *_common_server_args(args), *args.server_args]
        saved, args.server_log = args.server_log, str(log_path)
        try:
            with ServerRun(args, frac, extra, label) as running:
                client = Client(running.url, args.client, args.request_timeout)
                prompts = make_prompts(running.url, n, args.prompt_tokens, _seed(args, 0))
                result = fill_and_decode(client, prompts, args.max_tokens)
                mark = log_path.stat().st_size
                # slot 0 generates past the end of its context: the server shifts it once at least
                client.completion(prompts[0], args.ctx - args.prompt_tokens + 64,
                                  {"id_slot": 0, "cache_prompt": True, "ignore_eos": True})
            data = log_path.read_bytes()
        finally:
            args.server_log = saved
            if not saved:
                log_path.unlink(missing_ok=True)
        # this server's lines, and where the shift's request began in them (offsets in bytes, then in characters)
        figures = memory_figures(data[start:].decode("utf-8", "replace"),
                                 len(data[start:mark].decode("utf-8", "replace")))
        if figures["shifts"] == 0:
            raise BenchError(f"{label}: the server logged no context shift")
        # the context this server was started with, as `serve` reads llama-server's arguments (its defaults too)
        type_k, type_v = serve_cli.server_kv_types(extra)
        params = ContextParams(**serve_cli.server_context_fields(extra, n_ctx_train=args.ctx * n),
                               type_k=type_k or "f16", type_v=type_v or "f16")
        row_plan = plan_kv(args.model, params).row_for_frac(frac)
        rows.append({"frac": frac, "slots": n, "ctx_per_slot": args.ctx, "split": running.split, "client": client.kind,
                     **figures,
                     "plan_compute_mib": row_plan.compute / 2**20, "plan_arena_mib": row_plan.arena / 2**20,
                     "decode_tok_s": result["agg_tok_s"]})


def run_spec(args, rows: List[dict]) -> None:
    """One row per configuration, appended to ``rows`` as it is measured."""
    if args.url:
        configs = [{"frac": None, "draft_max": None}]
    else:
        alphas = args.synth_accept or [None]
        configs = [c for f in args.fracs for c in
                   [{"frac": f, "draft_max": 0, "synth_accept": None}]
                   + [{"frac": f, "draft_max": k, "synth_accept": a} for k in args.draft_max for a in alphas]]
    for index, cfg in enumerate(configs):
        k, alpha = cfg["draft_max"], cfg.get("synth_accept")
        label = ("spec: external" if args.url else
                 f"spec: frac {cfg['frac']:g}, " + (f"draft K={k}" if k else "no draft"))
        if alpha is not None:
            label += f", synthetic acceptance {alpha:g}"
        if args.url:
            server = External(args.url)
        else:
            extra = ["-np", "1", "-c", str(args.ctx), *_common_server_args(args)]
            if k:
                extra += ["-md", str(args.draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
                draft_ngl = args.draft_ngl if args.draft_ngl is not None else args.ngl
                if draft_ngl is not None:
                    extra += ["--spec-draft-ngl", str(draft_ngl)]
                if alpha is not None:
                    rates = [alpha ** (i + 1) for i in range(k)]
                    extra += ["--spec-synth-rates", ",".join(f"{r:.6g}" for r in rates)]
            extra += args.server_args
            server = ServerRun(args, cfg["frac"], extra, label)
        with server as running:
            client = Client(running.url, args.client, args.request_timeout)
            prompts = make_prompts(running.url, 1, args.prompt_tokens, _seed(args, index))
            result = fill_and_decode(client, prompts, args.max_tokens)
        _check_reuse(result, label)
        drafted, accepted = result["draft_n"], result["draft_n_accepted"]
        if k and not drafted:
            print(f"{PROG}: warning: {label}: the server proposed no draft tokens", file=sys.stderr)
        rows.append({"synth_accept": None, **cfg, "split": running.split, "client": client.kind,
                     "max_tokens": args.max_tokens, "tok_s": result["agg_tok_s"],
                     "wall_tok_s": result["agg_wall_tok_s"], "acceptance": accepted / drafted if drafted else None,
                     **result})
        # speed-up over the run without a draft at the same fraction (run first)
        base = next((r for r in rows if r["frac"] == cfg["frac"] and r["draft_max"] == 0), None)
        rows[-1]["speedup"] = rows[-1]["tok_s"] / base["tok_s"] if base and base["tok_s"] else None


def run_save(args, rows: List[dict]) -> None:
    """One row per fraction: save and restore one slot holding a prompt of --prompt-tokens tokens."""
    import statistics
    import tempfile

    for index, frac in enumerate([None] if args.url else args.fracs):
        label = "save: external" if args.url else f"save: frac {frac:g}"
        with tempfile.TemporaryDirectory(prefix="slot-save-", dir=args.save_dir) as save_dir:
            if args.url:
                server = External(args.url)
            else:
                extra = ["-np", "1", "-c", str(args.ctx), "--slot-save-path", save_dir, *_common_server_args(args),
                         *args.server_args]
                server = ServerRun(args, frac, extra, label)
            with server as running:
                client = Client(running.url, args.client, args.request_timeout)
                prompt = make_prompts(running.url, 1, args.prompt_tokens, _seed(args, index))[0]
                client.completion(prompt, 1, {"id_slot": 0, "cache_prompt": True})
                saves, restores = [], []
                for i in range(args.repeat):
                    saves.append(_post(running.url, "/slots/0?action=save", {"filename": "slot.bin"},
                                       args.request_timeout))
                for i in range(args.repeat):
                    restores.append(_post(running.url, "/slots/0?action=restore", {"filename": "slot.bin"},
                                          args.request_timeout))
        save_ms = statistics.median(float(r["timings"]["save_ms"]) for r in saves)
        restore_ms = statistics.median(float(r["timings"]["restore_ms"]) for r in restores)
        rows.append({"frac": frac, "split": running.split, "client": client.kind, "prompt_tokens": len(prompt),
                     "n_saved": int(saves[0]["n_saved"]), "n_written": int(saves[0]["n_written"]),
                     "n_restored": int(restores[0]["n_restored"]), "save_ms": save_ms, "restore_ms": restore_ms,
                     "save_ms_all": [r["timings"]["save_ms"] for r in saves],
                     "restore_ms_all": [r["timings"]["restore_ms"] for r in restores]})


# --------------------------------------------------------------------------
# output


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def load_table(rows: List[dict]) -> str:
    lines = ["| slots | KV | frac | aggregate tok/s (server) | aggregate tok/s (wall) | per-slot tok/s "
             "| prompt fill s | fill tok/s | prompt tokens/slot | tokens/slot |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['slots']} | {r['kv']} | {_fmt(r['frac'], 'g')} | {r['agg_tok_s']:.2f} "
                     f"| {r['agg_wall_tok_s']:.2f} | {r['per_slot_tok_s']:.2f} | {r['fill_s']:.2f} "
                     f"| {r['fill_tok_s']:.0f} | {r['prompt_tokens'][0]} | {r['max_tokens']} |")
    return "\n".join(lines)


def save_table(rows: List[dict]) -> str:
    lines = ["| frac | cells saved | MiB written | save ms (median) | restore ms (median) | save x first | "
             "restore x first |", "|---:|---:|---:|---:|---:|---:|---:|"]
    first = rows[0]
    for r in rows:
        lines.append(f"| {_fmt(r['frac'], 'g')} | {r['n_saved']} | {r['n_written'] / 2**20:.1f} | {r['save_ms']:.1f} "
                     f"| {r['restore_ms']:.1f} | {r['save_ms'] / first['save_ms']:.2f} "
                     f"| {r['restore_ms'] / first['restore_ms']:.2f} |")
    return "\n".join(lines)


def memory_table(rows: List[dict]) -> str:
    lines = ["| frac | slots x ctx | device compute MiB (staging included) | staging MiB | grew after reserve "
             "| context shifts | plan compute MiB | plan arena MiB | decode tok/s |", "|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        grew = "; ".join(r["staging_grew"] + r["compute_grew"]) or "no"
        lines.append(f"| {r['frac']:g} | {r['slots']} x {r['ctx_per_slot']} | {sum(r['compute_mib'].values()):.1f} "
                     f"| {sum(r['staging_mib'].values()):.1f} | {grew} | {r['shifts']} | {r['plan_compute_mib']:.1f} "
                     f"| {r['plan_arena_mib']:.1f} | {r['decode_tok_s']:.2f} |")
    return "\n".join(lines)


def spec_table(rows: List[dict]) -> str:
    lines = ["| frac | draft K | tok/s (server) | tok/s (wall) | speed-up | drafted | accepted | acceptance "
             "| prompt fill s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        k = "external" if r["frac"] is None else (str(r["draft_max"]) if r["draft_max"] else "none")
        if r.get("synth_accept") is not None:
            k += f" (synthetic {r['synth_accept']:g})"
        lines.append(f"| {_fmt(r['frac'], 'g')} | {k} | {r['tok_s']:.2f} | {r['wall_tok_s']:.2f} "
                     f"| {_fmt(r['speedup'])} | {r['draft_n']} | {r['draft_n_accepted']} "
                     f"| {_fmt(r['acceptance'], '.3f')} | {r['fill_s']:.2f} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# arguments


def _int_list(text: str) -> List[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _frac_list(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from None
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be in [0, 1], got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = ap.add_subparsers(dest="mode", required=True, metavar="load|spec|save|memory")
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", "-m", help="GGUF model: one llama-server per configuration is started")
    where.add_argument("--url", help="drive the llama-server running at this URL instead (http://host:port)")
    common.add_argument("--frac", dest="fracs", type=_frac_list, default=[1.0],
                        help="fraction(s) of each layer's KV heads on the GPU (-hgf), comma-separated (default 1)")
    common.add_argument("--prompt-tokens", type=int, default=512, help="tokens of each prompt (default 512)")
    common.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    common.add_argument("--ctx", type=int, default=None,
                        help="context per slot (default: prompt + generated tokens + 64, rounded up to 256)")
    common.add_argument("--ngl", type=int, default=None, help="-ngl for llama-server (default: its own)")
    common.add_argument("--threads", "-t", type=int, default=None,
                        help="-t for llama-server (default: serve's, the CPUs this process may run on)")
    common.add_argument("--seed", type=int, default=0, help="seed of the prompts' words")
    common.add_argument("--client", choices=("auto", "openai", "http"), default="auto",
                        help="requests through the openai package or urllib (default: openai when installed)")
    common.add_argument("--server", default=None,
                        help="llama-server binary (default: the build's, as `serve` finds it)")
    common.add_argument("--host", default="127.0.0.1")
    common.add_argument("--port", type=int, default=0, help="port for the servers (default: a free one)")
    common.add_argument("--startup-timeout", type=float, default=serve_cli.STARTUP_TIMEOUT_S)
    common.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT_S)
    common.add_argument("--server-log", default=None, help="append the servers' output to this file")
    common.add_argument("--json", default=None, metavar="OUT", help="also write the rows (and raw timings) as JSON")
    common.add_argument("server_args", nargs=argparse.REMAINDER, metavar="-- ARGS",
                        help="more llama-server arguments, after --")

    load = modes.add_parser("load", parents=[common], help="n slots, n concurrent distinct prompts",
                            description="n slots, n concurrent requests on distinct prompts (see the module help)")
    load.add_argument("--slots", type=_int_list, default=None, help="slot counts, one server each (default 1,2,4)")
    load.add_argument("--per-slot", action="store_true", help="one KV stream per slot (the default layout)")
    load.add_argument("--unified", action="store_true", help="one unified KV cache (-kvu); with --per-slot: both")

    spec = modes.add_parser("spec", parents=[common], help="speculative decoding with a draft model",
                            description="speculative decoding: a draft model next to the split target")
    spec.add_argument("--draft", "-md", default=None, help="draft GGUF model (same vocabulary); needed with --model")
    spec.add_argument("--draft-max", type=_int_list, default=[4], help="draft sizes K, one server each (default 4)")
    spec.add_argument("--draft-ngl", type=int, default=None, help="--spec-draft-ngl (default: --ngl)")
    spec.add_argument("--synth-accept", type=_frac_list, default=None, metavar="A[,A...]",
                      help="llama-server's synthetic acceptance (benchmarking only): each draft token accepted with "
                           "probability A once the ones before it were (--spec-synth-rates A,A^2,...); one server "
                           "per value and K")
    memory = modes.add_parser("memory", parents=[common], help="the device memory of N slots and a context shift",
                              description="N slots, one KV stream each, and a context shift: the device buffers "
                                          "against plan's estimate (see the module help)")
    memory.add_argument("--slots", type=_int_list, default=[4], help="slots (default 4)")
    save = modes.add_parser("save", parents=[common], help="slot save and restore (llama_state_seq_*_file)",
                            description="one slot's save and restore through llama-server (see the module help)")
    save.add_argument("--repeat", type=int, default=5, help="saves and restores per fraction (default 5)")
    save.add_argument("--save-dir", default=None,
                      help="where the slot file goes (default: the temporary directory; /dev/shm keeps the disk out "
                           "of the timing); one file, overwritten by each save and removed at the end")
    return ap


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    extra = list(args.server_args)
    args.server_args = extra[1:] if extra and extra[0] == "--" else extra
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        raise UsageError("--prompt-tokens and --max-tokens must be >= 1")
    needed = args.prompt_tokens + args.max_tokens + (max(args.draft_max) + 1 if args.mode == "spec" else 0)
    if args.ctx is None:
        args.ctx = -(-(needed + 64) // 256) * 256
    elif args.ctx < needed:
        raise UsageError(f"--ctx {args.ctx} is too small for {args.prompt_tokens} prompt + {args.max_tokens} "
                         f"generated tokens (needs >= {needed})")
    if args.mode == "save":
        if args.repeat < 1:
            raise UsageError("--repeat must be >= 1")
    elif args.mode == "load":
        args.slots_given = args.slots is not None
        args.slot_counts = args.slots or [1, 2, 4]
    elif args.mode == "memory":
        if args.url:
            raise UsageError("memory starts its own servers (their debug log is read): use --model, not --url")
        args.slot_counts = args.slots
    else:
        if args.model and not args.draft:
            raise UsageError("spec needs --draft (the draft model)")
        if args.draft and not Path(args.draft).is_file():
            raise UsageError(f"draft model not found: {args.draft}")
    if args.url:
        args.url = args.url.rstrip("/")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse: message already printed
        return int(exc.code or 0)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    rows: List[dict] = []
    error, status = None, 0
    try:
        {"load": run_load, "spec": run_spec, "save": run_save, "memory": run_memory}[args.mode](args, rows)
    except UsageError as exc:
        error, status = str(exc), 2
    except (HeadInferError, OSError) as exc:
        error, status = str(exc), 1
    except KeyboardInterrupt:
        error, status = "interrupted", 130
    if rows:  # what was measured, also before an error
        print({"load": load_table, "spec": spec_table, "save": save_table, "memory": memory_table}[args.mode](rows))
        clients = " and ".join(sorted({"openai" if r["client"] == "openai" else "urllib" for r in rows}))
        print(f"\n({len(rows)} run(s); requests through {clients} (/v1/completions); "
              + ("times from llama-server's save_ms/restore_ms)" if args.mode == "save" else
                 "tok/s (server) from llama-server's timings, (wall) from the clock)"))
    if args.json and (rows or error is None):
        record = {"mode": args.mode, "argv": list(argv if argv is not None else sys.argv[1:]), "rows": rows,
                  "error": error}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    if error is not None:
        print(f"{PROG}: error: {error}", file=sys.stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
