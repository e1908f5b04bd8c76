"""``patch lint``: the series' shape (size, churn, messages, authors, the AI-usage disclosure), on small
synthetic series made with git on top of the fake pin (conftest), and the exact churn count of the replay."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

import pytest

from conftest import git
from pyllama_headinfer.cli.main import main
from pyllama_headinfer.errors import UsageError
from pyllama_headinfer.patches.lint import author_problems, disclosure_problems, lint, message_problems
from pyllama_headinfer.source.fetch import cached_tree_path

pytestmark = pytest.mark.usefixtures("isolated_cache")

AUTHOR = "Jane Doe <jane@users.noreply.github.com>"
DISCLOSED = "\n\nAI usage disclosure: NO"
UTIL = "src/util.c"
UTIL_LINES = [f"int util_{n} = {n};" for n in range(20)]

Commit = Tuple[str, str, Dict[str, Optional[str]]]  # author, message, {path: text, None to delete}


@pytest.fixture
def pin_tree(fake_pin):
    """The fake pin as the cached tree: lint replays a series on its files."""
    return fake_pin.fresh_tree(cached_tree_path())


def make_series(fake_pin, root: Path, commits: Sequence[Commit]) -> Path:
    """A series made as the real one is: commits on top of the pin, ``git format-patch``."""
    repo = root / "repo"
    shutil.copytree(fake_pin.tree, repo)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "pin")
    base = git(repo, "rev-parse", "HEAD").decode().strip()
    for author, message, files in commits:
        for relative, text in files.items():
            path = repo / relative
            if text is None:
                path.unlink()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        git(repo, "add", "-A")
        git(repo, "commit", "-q", f"--author={author}", "-m", message)
    out = root / "series"
    git(repo, "format-patch", "-q", "--zero-commit", "--no-signature", "--no-stat", "-N", "-o", str(out), f"{base}..HEAD")
    names = sorted(p.name for p in out.iterdir())
    (out / "series").write_text("".join(f"{name}\n" for name in names))
    return out


def util(lines) -> str:
    return "".join(line + "\n" for line in lines)


def test_lines_a_later_patch_removes_are_the_churn_of_the_patch_that_added_them(fake_pin, pin_tree, tmp_path):
    """Patch 1 adds three lines, one a copy of an upstream line; patch 2 changes one of them, deletes
    another and deletes the *upstream* copy: 2 churned lines, not 3 (a content match would say 3)."""
    first = UTIL_LINES[:10] + ["int added_a = 1;", "int added_b = 2;"] + UTIL_LINES[10:] + ["int util_3 = 3;"]
    second = [line for line in first if line not in ("int added_b = 2;",)]
    second.remove("int util_3 = 3;")  # the first one: upstream's line 4
    second[second.index("int added_a = 1;")] = "int added_a = 10;"
    series = make_series(fake_pin, tmp_path, [
        (AUTHOR, "util : add a and b" + DISCLOSED, {UTIL: util(first)}),
        (AUTHOR, "util : change a, drop b and util_3" + DISCLOSED, {UTIL: util(second)}),
    ])
    report = lint(series)
    one, two = report.patches
    assert (one.added_outside_tests, one.churned, one.churned_by) == (3, 2, {two.name: 2})
    assert one.problems == ["2 of its added lines are removed again by 0002"]
    assert (two.added_outside_tests, two.churned, two.ok) == (1, 0, True)
    assert not report.ok and report.counts()["churned"] == 2


def test_a_file_a_later_patch_deletes_churns_all_its_lines(fake_pin, pin_tree, tmp_path):
    series = make_series(fake_pin, tmp_path, [
        (AUTHOR, "src : add tmp.c" + DISCLOSED, {"src/tmp.c": "int a;\nint b;"}),  # no final newline
        (AUTHOR, "src : one more line in tmp.c" + DISCLOSED, {"src/tmp.c": "int a;\nint b;\nint c;\n"}),
        (AUTHOR, "src : drop tmp.c" + DISCLOSED, {"src/tmp.c": None}),
    ])
    one, two, three = lint(series).patches
    # the second patch gives "int b;" its newline: git removes the line and adds it again
    assert (one.churned, one.churned_by) == (2, {two.name: 1, three.name: 1})
    assert (two.churned, two.churned_by) == (2, {three.name: 2})
    assert three.churned == 0 and three.added_outside_tests == 0


def test_crlf_lines_are_replayed_as_git_applies_them(fake_pin, pin_tree, tmp_path):
    """A patch file's CRLF lines keep their CR: the replay still equals git apply's result."""
    series = make_series(fake_pin, tmp_path, [
        (AUTHOR, "src : add win.c" + DISCLOSED, {"src/win.c": "int a;\r\nint b;\r\nint c;\r\n"}),
        (AUTHOR, "src : change b" + DISCLOSED, {"src/win.c": "int a;\r\nint bb;\r\nint c;\r\n"}),
    ])
    one, two = lint(series).patches
    assert (one.added_outside_tests, one.churned, two.added_outside_tests, two.churned) == (3, 1, 1, 0)


def test_more_than_300_added_lines_outside_tests_fail(fake_pin, pin_tree, tmp_path):
    series = make_series(fake_pin, tmp_path, [
        (AUTHOR, "src : a large change" + DISCLOSED, {"src/big.c": util(f"int big_{n};" for n in range(301))}),
        (AUTHOR, "tests : many cases" + DISCLOSED, {"tests/test-big.c": util(f"int case_{n};" for n in range(400)),
                                                   "src/small.c": util(f"int small_{n};" for n in range(300))}),
    ])
    big, tests = lint(series).patches
    assert (big.added_outside_tests, big.added_in_tests) == (301, 0)
    assert big.problems == ["adds 301 lines outside tests (at most 300)"]
    assert (tests.added_outside_tests, tests.added_in_tests, tests.ok) == (300, 400, True)


@pytest.mark.parametrize("message, problem", [
    ("fixes #12", '"#12" is not an upstream reference'),
    ("see issue 27 for the numbers", '"issue 27" is not an upstream reference'),
    ("as in Issue #3", '"Issue #3" is not an upstream reference'),
    ("as ggml-org/llama.cpp#1 and #2 do", '"#2" is not an upstream reference'),
    ("the last patch of this series", '"this series" (the series as a history)'),
    ("undoes the previous\npatch", '"previous patch" (the series as a history)'),
    ("moved here in a later change", '"later change" (the series as a history)'),
    ("after the earlier commits", '"earlier commits" (the series as a history)'),
    ("measured on an H100", '"H100" (a GPU model as evidence)'),
    ("2x faster on a GB200", '"GB200" (a GPU model as evidence)'),
    ("and on an RTX 4090", '"RTX 4090" (a GPU model as evidence)'),
    ("an A100 too", '"A100" (a GPU model as evidence)'),
    ("found by pyllama-headinfer", '"pyllama" (the project\'s name)'),
    ("for the HeadInfer project", '"HeadInfer project" (the project\'s name)'),
    ("CPU-only CI runs it", '"CI" (the project\'s CI)'),
])
def test_message_problems(message, problem):
    problems = message_problems("subject\n\n" + message)
    assert len(problems) == 1 and problems[0].startswith("message: " + problem), problems


@pytest.mark.parametrize("message", [
    "the same fix as ggml-org/llama.cpp#25636", "carries ggerganov/llama.cpp#100", "as PR #1234 does",
    "upstream #77 will replace it", "upstream PR #5 and upstream issue #9", "see github.com/ggml-org/llama.cpp/pull/42",
    "HeadInfer: split the KV heads", "#include <stdio.h> and a CIFAR test, CUDA_CI unset, A1000 rows",
])
def test_messages_without_problems(message):
    assert message_problems("subject\n\n" + message) == []


@pytest.mark.parametrize("author, problem", [
    ("Jane Doe <jane@users.noreply.github.com>", None),
    ("Jane Doe <jane.doe@mail.co.uk>", None),
    ("pyllama-headinfer <dev@pyllama-headinfer>", "its domain has no dot"),
    ("Jane Doe <jane@example.com>", "example.com is a reserved placeholder domain"),
    ("Jane Doe <jane@dev.example.org>", "dev.example.org is a reserved placeholder domain"),
    ("Seed maintainers <m@users.noreply.a-seed.example>", "users.noreply.a-seed.example is a reserved placeholder"),
    ("Jane Doe <jane@example>", "its domain has no dot"),
    ("Jane Doe <jane@host.invalid>", "host.invalid is a reserved placeholder domain"),
    ("Jane Doe <jane@localhost>", "its domain has no dot"),
    ("Jane Doe <jane@box.localhost>", "box.localhost is a reserved placeholder domain"),
    ("Jane Doe <jane@ci.test>", "ci.test is a reserved placeholder domain"),
    ("<jane@mail.com>", "not a name and an email address"),
    ("Jane Doe", "not a name and an email address"),
])
def test_author_problems(author, problem):
    problems = author_problems(author)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize("lines, ok", [
    ([], False),
    (["AI usage disclosure: NO"], True),
    (["AI usage disclosure: no, none"], True),
    (["AI usage disclosure: YES - Claude drafted the tests; every line was reviewed"], True),
    (["AI usage disclosure: YES", "Claude drafted the tests."], True),
    (["AI usage disclosure: YES"], False),
    (["AI usage disclosure: maybe"], False),
    (["Assisted-by: Claude (Anthropic)"], False),
    (["  AI usage disclosure: NO"], False),  # a line that starts with it
])
def test_the_ai_usage_disclosure(lines, ok):
    assert (disclosure_problems("\n".join(["subject", "", "body", *lines])) == []) == ok


def test_the_cli_exit_status_text_and_json(fake_pin, pin_tree, tmp_path, capsys):
    clean = make_series(fake_pin, tmp_path / "clean", [
        (AUTHOR, "util : one more" + "\n\nAs ggml-org/llama.cpp#25636 does." + DISCLOSED, {UTIL: util(UTIL_LINES + ["int x;"])}),
    ])
    assert main(["patch", "lint", "--patches-dir", str(clean)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith(": added 1 outside tests + 0 in tests, churned 0: ok"), out
    assert out[-1] == "1 patches: 1 lines added (1 outside tests, 0 in tests), 0 churned: ok"

    bad = make_series(fake_pin, tmp_path / "bad", [
        ("pyllama-headinfer <dev@pyllama-headinfer>", "util : one more\n\nMeasured on an H200 (issue 30).",
         {UTIL: util(UTIL_LINES + ["int x;"])}),
        (AUTHOR, "util : another" + DISCLOSED, {UTIL: util(UTIL_LINES + ["int y;"])}),
    ])
    assert main(["patch", "lint", "--patches-dir", str(bad)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("0001-util-one-more.patch: added 1 outside tests + 0 in tests, churned 1 (removed by "
                             "0002: 1): FAIL: 1 of its added lines are removed again by 0002; "
                             'message: "H200" (a GPU model as evidence); '
                             'message: "issue 30" is not an upstream reference'), out
    assert 'author "pyllama-headinfer <dev@pyllama-headinfer>": its domain has no dot' in out[0]
    assert out[0].endswith('no "AI usage disclosure:" line'), out
    assert out[-1] == ("2 patches: 2 lines added (2 outside tests, 0 in tests), 1 churned: FAIL: 1 with churned "
                       "lines, 1 with message problems (2 in all), 1 with a bad author, 1 without a usable AI usage "
                       "disclosure"), out

    assert main(["patch", "lint", "--patches-dir", str(bad), "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["summary"]["churned"] == 1
    assert data["patches"][0]["churned_by"] == {"0002-util-another.patch": 1}

    assert main(["patch", "lint", "--patches-dir", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.startswith("error: no series in ")


def test_the_fake_pins_series_is_linted_against_its_pin(fake_pin, pin_tree, capsys):
    """The default series (the fake pin's, see conftest) replays on the pin's files."""
    assert main(["patch", "lint"]) == 1  # its commits have no disclosure, and a test@example.com author
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith("2 patches: "), out
    assert "example.com is a reserved placeholder domain" in out


def test_a_series_of_another_tree_is_refused_and_the_cache_kept(fake_pin, pin_tree, tmp_path, capsys):
    """The llama-cpp-python layer's series changes files the pin does not have: lint (and rebase,
    which take the pin's files the same way) refuse it as bad usage, before any archive is opened;
    an archive lacking files it was asked for would otherwise be deleted as broken."""
    from pyllama_headinfer import paths
    from pyllama_headinfer.source.fetch import extract_pin_files

    foreign = make_series(fake_pin, tmp_path / "foreign", [
        (AUTHOR, "util : one more" + DISCLOSED, {UTIL: util(UTIL_LINES + ["int x;"])}),
    ])
    patch = next(foreign.glob("0001-*.patch"))
    patch.write_text(patch.read_text().replace(UTIL, "llama_cpp/llama.py"))
    downloads = paths.cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    (downloads / "kept.tar.gz").write_bytes(b"an archive")

    for command in (["patch", "lint", "--patches-dir", str(foreign)],
                    ["patch", "rebase", "--patches-dir", str(foreign), "--onto", "bfake", "--out", str(tmp_path / "out")]):
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert "is not a series of llama.cpp bfake" in err and "llama_cpp/llama.py" in err, err
    assert [p.name for p in downloads.iterdir()] == ["kept.tar.gz"]

    with pytest.raises(UsageError, match="none of llama_cpp/llama.py is a file of llama.cpp"):
        extract_pin_files(["llama_cpp/llama.py"], tmp_path / "extracted")
    assert not (tmp_path / "extracted").exists()
