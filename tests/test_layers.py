"""The package's architecture, checked: imports point one way between the
layers (source -> patches -> build; runtime, vram -> api -> the llama facade;
cli on top), with no circles and no private names crossing modules; and the
API, imported and used, loads nothing of the build tool and starts no process.

The import graph is read from the source with ``ast`` (standard library only)
by scripts/import_graph.py, which also prints it for people.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from testing_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]

# What each layer may import (besides itself). "core" is the package's base:
# errors, paths, pin, series, params and the package's __init__.
MAY_IMPORT = {
    "core": set(),
    "source": {"core"},
    "patches": {"core", "source"},
    "runtime": {"core"},
    "vram": {"core"},
    "api": {"core", "runtime", "vram"},
    "llama": {"core", "runtime", "api"},
    "build": {"core", "source", "patches", "runtime"},
    "cli": {"core", "source", "patches", "build", "runtime", "vram", "api", "llama"},
}
NEVER_AT_RUNTIME = ("build", "patches", "source")


def _graph_module():
    return load_script("import_graph")


@pytest.fixture(scope="module")
def package_graph():
    """(edges, private imports) of the package, read once for this module."""
    return _graph_module().graph(ROOT)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    if parts[1] == "__main__":
        return "cli"
    return parts[1] if parts[1] in MAY_IMPORT else "core"


def test_every_module_has_a_layer(package_graph):
    edges, _ = package_graph
    subpackages = {m.split(".")[1] for m in edges if m.count(".") >= 2}
    assert subpackages <= set(MAY_IMPORT), subpackages - set(MAY_IMPORT)


def test_imports_point_one_way(package_graph):
    edges, _ = package_graph
    upward = [(m, t) for m, targets in edges.items() for t in targets
              if layer_of(t) != layer_of(m) and layer_of(t) not in MAY_IMPORT[layer_of(m)]]
    assert upward == []
    # the one-way rule of the issue, spelled out
    for m, targets in edges.items():
        if layer_of(m) in ("runtime", "api", "vram", "llama"):
            assert not {layer_of(t) for t in targets} & set(NEVER_AT_RUNTIME), m


def test_no_circles(package_graph):
    edges, _ = package_graph
    assert [c for c in _graph_module().sccs(edges) if len(c) > 1] == []


def test_no_private_names_cross_modules(package_graph):
    _, private = package_graph
    assert private == []


def test_the_checker_sees_violations(tmp_path):
    """The rules above can fail: a copy of the package with an upward import, a
    circle and a private import is caught."""
    graph = _graph_module()
    pkg = tmp_path / "pyllama_headinfer"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "build").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "build" / "__init__.py").write_text("")
    (pkg / "runtime" / "a.py").write_text("from pyllama_headinfer.build.b import thing\n")
    (pkg / "build" / "b.py").write_text("from ..runtime.a import _hidden\nthing = 1\n")
    edges, private = graph.graph(tmp_path)
    assert "pyllama_headinfer.build.b" in edges["pyllama_headinfer.runtime.a"]
    assert [c for c in graph.sccs(edges) if len(c) > 1] == [["pyllama_headinfer.build.b",
                                                               "pyllama_headinfer.runtime.a"]]
    assert private == [("pyllama_headinfer.build.b", "pyllama_headinfer.runtime.a", "_hidden")]


_PROBE = r"""
import json, sys

events = []
SPAWNING = ("subprocess.Popen", "os.system", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.exec")


def hook(event, args):
    if event.startswith(SPAWNING):
        events.append(event)


sys.addaudithook(hook)
import pyllama_headinfer.llama as llama

imported = sorted(m for m in sys.modules if m.startswith("pyllama_headinfer"))
with llama.Model(sys.argv[1]) as model, llama.Context(model, n_ctx=64, n_threads=1) as ctx:
    ctx.decode(model.tokenize("hello"))
    report = ctx.kv_residency()
used = sorted(m for m in sys.modules if m.startswith("pyllama_headinfer"))
print(json.dumps({"imported": imported, "used": used, "spawned": events}))
"""


def test_the_api_loads_no_build_tool_and_starts_no_process(built, gguf_models):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", _PROBE, str(gguf_models["qwen2"])], capture_output=True, text=True,
                         env=env, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("imported", "used"):
        bad = [m for m in out[key] if layer_of(m) in NEVER_AT_RUNTIME or "cmake" in m or "toolchain" in m]
        assert bad == [], (key, bad)
    assert "pyllama_headinfer.runtime.bindings" in out["used"]  # the probe did load the bindings
    assert out["spawned"] == []
