"""The command line, driven through cli.main([...])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, snapshot
from pyllama_headinfer.cli import main as cli
from pyllama_headinfer.source import fetch as source

pytestmark = pytest.mark.usefixtures("isolated_cache")


@pytest.fixture
def tree(fake_pin, tmp_path) -> Path:
    return fake_pin.fresh_tree(tmp_path / "llama.cpp")


def test_module_help_smoke():
    result = subprocess.run([sys.executable, "-m", "pyllama_headinfer", "--help"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "source" in result.stdout and "patch" in result.stdout


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert cli.main(["no-such-command"]) == 2
    assert cli.main(["patch"]) == 2
    assert cli.main(["patch", "apply", "--no-such-option"]) == 2
    assert cli.main(["--help"]) == 0
    assert cli.main(["--version"]) == 0
    assert "llama.cpp b11312" in capsys.readouterr().out


def test_help_imports_no_command_module(monkeypatch, capsys):
    loaded = []
    monkeypatch.setattr(cli, "_load", lambda name: loaded.append(name))
    assert cli.main(["--help"]) == 0
    assert loaded == []


def test_missing_command_module_is_left_out(monkeypatch, capsys):
    table = list(cli.SUBCOMMANDS) + [cli.Subcommand("later", "pyllama_headinfer.not_written_yet", "soon")]
    monkeypatch.setattr(cli, "SUBCOMMANDS", table)
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "later" not in out and "patch" in out


def test_source_verify_and_path(fake_pin, tree, capsys):
    assert cli.main(["source", "verify", "--llama-src", str(tree)]) == 0
    assert "pristine" in capsys.readouterr().out
    assert cli.main(["source", "path", "--llama-src", str(tree)]) == 0
    assert capsys.readouterr().out.strip() == str(tree.resolve())
    (tree / "README.md").write_text("edited\n")
    assert cli.main(["source", "verify", "--llama-src", str(tree)]) == 1
    assert "README.md" in capsys.readouterr().out
    assert cli.main(["source", "path", "--llama-src", str(tree)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_patch_cycle(fake_pin, tree, capsys):
    pristine = snapshot(tree)
    common = ["--llama-src", str(tree), "--patches-dir", str(fake_pin.patches)]
    assert cli.main(["patch", "status", *common]) == 0
    assert "PRISTINE" in capsys.readouterr().out
    assert cli.main(["patch", "check", *common]) == 0
    assert "the series applies" in capsys.readouterr().out
    assert cli.main(["patch", "apply", *common]) == 0
    assert cli.main(["patch", "apply", *common]) == 0
    assert "already applied" in capsys.readouterr().out
    assert cli.main(["patch", "status", *common]) == 0
    assert "APPLIED" in capsys.readouterr().out
    assert cli.main(["patch", "revert", *common]) == 0
    assert snapshot(tree) == pristine


def test_patch_failure_is_a_message_not_a_traceback(fake_pin, tree, capsys):
    core = tree / "src/core.c"
    core.write_text(core.read_text().replace("int core_26 = 26;", "int core_26 = -1;"))
    common = ["--llama-src", str(tree), "--patches-dir", str(fake_pin.patches)]
    assert cli.main(["patch", "status", *common]) == 1
    assert "MODIFIED" in capsys.readouterr().out
    assert cli.main(["patch", "check", *common]) == 1
    assert "src/core.c: hunk #3" in capsys.readouterr().out
    assert cli.main(["patch", "apply", *common]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: refusing to patch") and "Traceback" not in err


def test_patch_export(fake_pin, tmp_path, capsys):
    out = tmp_path / "exported"
    assert cli.main(["patch", "export", "--llama-src", str(fake_pin.repo), "--patches-dir", str(out)]) == 0
    assert (out / "series").is_file()
    assert cli.main(["patch", "export", "--patches-dir", str(out)]) == 1
    assert "needs --llama-src" in capsys.readouterr().err


def test_default_tree_is_the_cached_one(fake_pin, capsys):
    cached = fake_pin.fresh_tree(source.cached_tree_path())
    assert cli.main(["patch", "status"]) == 0  # fake_pin makes its series the default
    assert str(cached) in capsys.readouterr().out


def test_verbose_logs_debug_to_stderr(fake_pin, tree, capsys):
    assert cli.main(["-v", "source", "verify", "--llama-src", str(tree)]) == 0
    assert "debug: scanned" in capsys.readouterr().err
    assert cli.main(["source", "verify", "--llama-src", str(tree)]) == 0
    assert "debug:" not in capsys.readouterr().err
