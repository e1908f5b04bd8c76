"""An unusable cache (``$PYLLAMA_HEADINFER_CACHE`` read-only, or a file): the commands that write
it fail with one line naming the directory and the variable (exit 1), not a traceback; the
commands that only read it (``generate``, ``plan``) keep working.

Making "read-only" real: the tests run as root, which ignores permission bits (a ``chmod 0o555``
directory is still writable), and a read-only bind mount needs privilege. A *user* namespace gives
it without any: ``unshare --user --map-root-user --mount`` runs the command in its own mount
namespace, where the cache is bound read-only onto itself (``mount --bind -o ro``), so every write
fails with ``EROFS``, the errno of the report, for root too. The tests that need it run the CLI
in a subprocess there, on the real pin, and skip where user namespaces are not allowed. The
file-instead-of-a-directory cases are real everywhere (``ENOTDIR``/``EEXIST``), in-process on
the fake pin.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from conftest import REAL_CACHE, ROOT
from pyllama_headinfer import paths
from pyllama_headinfer.cli.main import main
from pyllama_headinfer.source.fetch import cached_tree_path

pytestmark = pytest.mark.usefixtures("isolated_cache")


def _error_line(cache: Path, reason: str) -> str:
    return (f"error: cannot write to the cache directory {cache} (from $PYLLAMA_HEADINFER_CACHE): {reason}; "
            f"set PYLLAMA_HEADINFER_CACHE to a writable directory")


# --------------------------------------------------------------------------
# a file where the cache should be (in-process, the fake pin)


@pytest.fixture
def cache_file(isolated_cache) -> Path:
    isolated_cache.parent.mkdir(parents=True, exist_ok=True)
    isolated_cache.write_text("not a directory\n")
    return isolated_cache


@pytest.mark.parametrize("argv", [["source", "fetch"], ["source", "path"], ["build", "--build-dir", "BUILD"]])
def test_a_cache_that_is_a_file_is_one_line(fake_pin, cache_file, tmp_path, capsys, argv):
    argv = [word.replace("BUILD", str(tmp_path / "build")) for word in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == _error_line(cache_file, "it is not a directory"), err
    assert "Traceback" not in err


def test_a_cache_whose_series_record_cannot_be_written_fails_the_build_in_one_line(fake_pin, isolated_cache,
                                                                                   tmp_path, capsys):
    """The cached tree is there and gets patched; the record of the applied series cannot be made
    (``applied-series`` is a file: the place of the report's EROFS, build/series_swap.py)."""
    fake_pin.fresh_tree(cached_tree_path())
    (isolated_cache / "applied-series").write_text("")
    assert main(["build", "--build-dir", str(tmp_path / "build")]) == 1
    err = capsys.readouterr().err
    reason = f"File exists: {isolated_cache / 'applied-series'}"
    assert err.splitlines()[-1] == _error_line(isolated_cache, reason), err


def test_writable_cache_dir_names_the_default_when_the_variable_is_unset(tmp_path, monkeypatch):
    from pyllama_headinfer.errors import CacheError

    home = tmp_path / "home"
    home.write_text("")
    monkeypatch.delenv(paths.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    with pytest.raises(CacheError) as caught:
        paths.writable_cache_dir("downloads")
    assert str(caught.value).startswith(f"cannot write to the cache directory {home / 'pyllama-headinfer'} "
                                        "(the default; $PYLLAMA_HEADINFER_CACHE chooses another): Not a directory")


def test_bench_calibrate_does_not_save_into_a_cache_that_is_a_file(cache_file):
    from pyllama_headinfer.errors import CacheError
    from pyllama_headinfer.vram.speed import H200_DEFAULTS, save_calibration

    with pytest.raises(CacheError, match="it is not a directory"):
        save_calibration(H200_DEFAULTS)


def test_plan_reads_a_cache_that_is_a_file(cache_file, gguf_models, capsys):
    assert main(["plan", "-m", str(gguf_models["llama-gqa"]), "-c", "256", "--vram", "1GiB"]) == 0
    assert "fastest exact" in capsys.readouterr().out


# --------------------------------------------------------------------------
# a read-only cache, for real (a read-only bind mount in a user namespace; the real pin)


def _unshare() -> List[str]:
    command = ["unshare", "--user", "--map-root-user", "--mount"]
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1): cannot make a read-only mount")
    probe = subprocess.run([*command, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are not allowed here: {probe.stderr.strip()}")
    return command


def _run_read_only(source: Path, cache: Path, argv: List[str], **env: str) -> subprocess.CompletedProcess:
    """``python -m pyllama_headinfer ARGV`` with ``source`` bound read-only at ``cache``, the cache."""
    cache.mkdir(parents=True, exist_ok=True)
    script = 'mount --bind -o ro "$1" "$2" && shift 2 && exec "$@"'
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **{paths.CACHE_ENV: str(cache)}, **env)
    return subprocess.run([*_unshare(), "sh", "-c", script, "sh", str(source), str(cache),
                           sys.executable, "-m", "pyllama_headinfer", *argv],
                          capture_output=True, text=True, env=environment, timeout=300)


@pytest.mark.parametrize("argv", [["source", "fetch"], ["build", "--build-dir", "BUILD"]])
def test_a_read_only_empty_cache_is_one_line(tmp_path, argv):
    cache = tmp_path / "cache"
    result = _run_read_only(cache, cache, [word.replace("BUILD", str(tmp_path / "build")) for word in argv])
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[-1] == _error_line(cache, f"Read-only file system: {cache / 'src'}"), \
        result.stderr
    assert "Traceback" not in result.stderr


def test_a_read_only_cache_with_the_tree_fails_the_build_in_one_line(pinned_source, tmp_path):
    """The real cache, read-only: its tree is found and verified, then the first write fails."""
    cache = tmp_path / "cache"
    result = _run_read_only(REAL_CACHE, cache, ["build", "--build-dir", str(tmp_path / "build")])
    assert result.returncode == 1, result.stderr
    last = result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr, result.stderr
    if "could not write the patched files" in last:  # the cached tree was pristine: patching it failed first
        assert last.startswith(f"error: could not write the patched files into {cache}/src/"), result.stderr
    else:  # patched already (the build's usual state): recording the series failed
        assert last == _error_line(cache, f"Read-only file system: {cache / 'applied-series'}"), result.stderr


def test_plan_works_with_a_read_only_cache(tmp_path, gguf_models):
    cache = tmp_path / "cache"
    result = _run_read_only(cache, cache, ["plan", "-m", str(gguf_models["llama-gqa"]), "-c", "256", "--vram", "1GiB"])
    assert result.returncode == 0, result.stderr
    assert "fastest exact" in result.stdout


def test_generate_works_with_a_read_only_cache(tmp_path, llama, gguf_models):
    from pyllama_headinfer.runtime.manifest import BUILD_DIR_ENV, find_manifest

    cache = tmp_path / "cache"
    result = _run_read_only(cache, cache, ["generate", "--model", str(gguf_models["qwen2"]), "--prompt", "The baker",
                                           "-n", "4", "--temp", "0", "--ctx", "128", "--threads", "1"],
                            **{BUILD_DIR_ENV: os.environ.get(BUILD_DIR_ENV) or str(find_manifest().build_dir)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
