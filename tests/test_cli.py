"""The command line, driven through cli.main([...])."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, snapshot
from pyllama_headinfer.cli import main as cli
from pyllama_headinfer.source.fetch import cached_tree_path

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


def test_help_imports_no_command_module():
    code = ("import sys; from pyllama_headinfer.cli.main import main; rc = main(['--help']); "
            "print(rc, sorted(m for m in sys.modules if m.startswith('pyllama_headinfer.cli.')))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "0 ['pyllama_headinfer.cli.main']"


def test_every_command_is_listed(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("source", "patch", "build", "generate", "plan", "bench", "serve"):
        assert command in out


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_help_says_the_threads_default(command, capsys):
    """generate, bench and serve default to the CPUs this process may run on, and say so."""
    from pyllama_headinfer.params import default_n_threads

    assert cli.main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"the CPUs this process may run on, {default_n_threads()} here" in out
    assert "llama.cpp's)" not in out


@pytest.mark.parametrize("command", ["generate", "plan"])
def test_help_says_what_ctx_0_means(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--ctx" in out and "0 = the model's training context" in out


@pytest.mark.parametrize("command", ["generate", "bench", "plan"])
def test_every_layer_goes_to_the_gpu_by_default(command):
    """As llama.cpp's tools: without --ngl every layer is offloaded when there is a GPU (-1 or 99,
    both more than any model's layers); on a CPU-only build llama.cpp has no device to put them on."""
    import argparse

    from pyllama_headinfer.cli import bench, generate, plan

    parser = argparse.ArgumentParser()
    {"generate": generate, "bench": bench, "plan": plan}[command].add_arguments(parser)
    ngl = parser.get_default("ngl")
    assert ngl == -1 or ngl >= 99, (command, ngl)


@pytest.mark.parametrize("exc, status", [
    (ValueError("x"), 2), (FileNotFoundError("x"), 2), (KeyboardInterrupt(), 130),
])
def test_exit_status_of_foreign_exceptions(exc, status):
    assert cli.exit_status(exc) == status


def test_exit_status_of_our_exceptions():
    from pyllama_headinfer import errors

    assert cli.exit_status(errors.UsageError("x")) == 2
    assert cli.exit_status(errors.TokenError("x")) == 2
    assert cli.exit_status(errors.BuildError("x")) == 1
    assert cli.exit_status(errors.PlanError("x")) == 1
    assert cli.exit_status(errors.ModelError("x")) == 1
    assert cli.exit_status(errors.BuildInterrupted("x")) == 130


def test_commands_leave_the_loggers_as_they_were(fake_pin, tree):
    import logging

    loggers = [logging.getLogger(name) for name in ("pyllama_headinfer", "pyllama_headinfer.llama")]
    before = [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    assert cli.main(["source", "verify", "--llama-src", str(tree)]) == 0
    assert cli.main(["-v", "source", "verify", "--llama-src", str(tree)]) == 0
    assert [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers] == before


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


@pytest.mark.parametrize("command", [["source", "verify"], ["source", "path"], ["patch", "status"]])
def test_a_missing_llama_src_is_a_usage_error(fake_pin, tmp_path, capsys, command):
    """A tree the user names that does not exist is bad input (exit 2, one line), not a failed operation."""
    assert cli.main([*command, "--llama-src", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the llama.cpp tree ") and "is not a directory" in err and "Traceback" not in err


@pytest.mark.parametrize("contents", [{}, {"README.md": "# not llama.cpp\n"}], ids=["empty", "readme-only"])
@pytest.mark.parametrize("command", [["patch", "check"], ["patch", "apply"], ["patch", "revert"], ["patch", "status"],
                                     ["patch", "rebase", "--out", "OUT", "--onto"]])
def test_a_directory_that_is_not_llama_cpp_is_refused(fake_pin, tmp_path, capsys, command, contents):
    """An empty directory passed `patch check` as "another llama.cpp tree" ("47 patches: 28 clean, 19
    resolved", exit 0) and `patch apply` reported its failures: bad input, refused before any work."""
    other = tmp_path / "other"
    other.mkdir()
    for name, text in contents.items():
        (other / name).write_text(text)
    before = snapshot(other)
    argv = [word.replace("OUT", str(tmp_path / "out")) for word in command]
    argv += [str(other)] if argv[-1] == "--onto" else ["--llama-src", str(other)]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"error: {other} is not a llama.cpp tree: it has no CMakeLists.txt, include/llama.h, "
                            "ggml/include/ggml.h, src/llama.cpp\n"), captured
    assert captured.out == "" and snapshot(other) == before and not (tmp_path / "out").exists()


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
    assert cli.main(["patch", "export", "--patches-dir", str(out)]) == 2  # bad usage
    assert "needs --llama-src" in capsys.readouterr().err


def test_default_tree_is_the_cached_one(fake_pin, capsys):
    cached = fake_pin.fresh_tree(cached_tree_path())
    assert cli.main(["patch", "status"]) == 0  # fake_pin makes its series the default
    assert str(cached) in capsys.readouterr().out


def test_verbose_logs_debug_to_stderr(fake_pin, tree, capsys):
    assert cli.main(["-v", "source", "verify", "--llama-src", str(tree)]) == 0
    assert "debug: scanned" in capsys.readouterr().err
    assert cli.main(["source", "verify", "--llama-src", str(tree)]) == 0
    assert "debug:" not in capsys.readouterr().err
