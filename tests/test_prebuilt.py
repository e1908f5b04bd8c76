"""``scripts/prebuilt_cuda.py``: a build packed where it was made and unpacked in another directory
(the GPU machine's checkout) still loads and decodes, from there and nowhere else. The CPU build
stands in for the CUDA one here; the GPU sessions carry CUDA builds made without a GPU this way
(docs/GPU.md, "A build carried to the GPU")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyllama_headinfer.runtime.manifest import find_manifest, read_manifest
from testing_scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def prebuilt():
    return load_script("prebuilt_cuda")


def test_a_packed_build_runs_from_another_directory(built, gguf_models, prebuilt, tmp_path):
    origin = find_manifest()
    archive = tmp_path / "build.tar.xz"
    prebuilt.pack(origin.build_dir, archive, require_cuda=False)
    dest = tmp_path / "elsewhere"
    prebuilt.unpack(archive, dest)

    moved = read_manifest(dest)
    assert moved.data["relocated_from"] == str(origin.build_dir)
    assert moved.lib_dir == dest / "bin"
    assert moved.source_tree == dest / "src" and (dest / "src" / "include" / "llama.h").is_file()
    assert all(Path(p).parent == dest / "bin" for p in moved.libraries.values())
    assert moved.bindings is not None and moved.bindings.parent == dest / "python"

    # decode from the unpacked build; every libllama/libggml the process maps is the unpacked one
    code = (
        "from pyllama_headinfer.llama import Model, Context\n"
        f"m = Model({str(gguf_models['llama-gqa'])!r})\n"
        "c = Context(m, n_ctx=64, n_threads=1)\n"
        "c.decode(m.tokenize('hello'))\n"
        "import json\n"
        "maps = [l.split()[-1] for l in open('/proc/self/maps') if 'libllama' in l or 'libggml' in l]\n"
        "print(json.dumps(sorted(set(maps))))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYLLAMA_HEADINFER_BUILD_DIR=str(dest))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    mapped = json.loads(res.stdout.strip().splitlines()[-1])
    assert mapped and all(Path(p).resolve().parent == (dest / "bin").resolve() for p in mapped), mapped


def test_pack_refuses_a_build_without_cuda(built, prebuilt, tmp_path):
    with pytest.raises(SystemExit, match="no libggml-cuda"):
        prebuilt.pack(find_manifest().build_dir, tmp_path / "x.tar.xz")
    assert not (tmp_path / "x.tar.xz").exists()
