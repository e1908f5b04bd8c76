"""The patch manager, on a tiny fake pin (fast) and on the real pinned tree."""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import git, snapshot
from pyllama_headinfer import paths
from pyllama_headinfer.errors import PatchError
from pyllama_headinfer.patches import apply as patch_apply
from pyllama_headinfer.patches.check import Outcome, check
from pyllama_headinfer.patches.export import export
from pyllama_headinfer.patches.series import load_series, parse_patch
from pyllama_headinfer.patches.status import State, status, tree_acceptance
from pyllama_headinfer.series import read_series_names, series_hash
from pyllama_headinfer.source.tree_verify import scan_tree, verify_tree

pytestmark = pytest.mark.usefixtures("isolated_cache")


@pytest.fixture
def tree(fake_pin, tmp_path) -> Path:
    return fake_pin.fresh_tree(tmp_path / "llama.cpp")


# --------------------------------------------------------------------------
# reading the series


def test_parse_patch_finds_files_and_hunks(fake_pin):
    series = load_series(fake_pin.patches)
    assert len(series) == 2
    first, second = series.patches
    by_path = {f.path: f for f in first.files}
    assert set(by_path) == {"src/core.c", "src/headinfer.c", "include/hi/headinfer.h"}
    core = by_path["src/core.c"]
    assert [h.number for h in core.hunks] == [1, 2, 3]
    assert core.hunks[0].header.startswith("@@ -1,") and core.hunks[0].header.endswith("@@")
    assert by_path["src/headinfer.c"].old_path is None  # created
    deleted = {f.path: f for f in second.files}["docs/old.txt"]
    assert deleted.new_path is None and deleted.old_path == "docs/old.txt"
    assert series.touched == {"src/core.c", "src/headinfer.c", "include/hi/headinfer.h", "README.md", "docs/old.txt"}


def test_hunk_body_lines_starting_with_dashes_are_not_headers():
    text = (
        "diff --git a/x.lua b/x.lua\n--- a/x.lua\n+++ b/x.lua\n"
        "@@ -1,3 +1,2 @@\n a\n--- removed comment\n b\n"
        "@@ -10,2 +9,3 @@\n c\n+++ added comment\n d\n"
    )
    (section,) = parse_patch(text)
    assert section.path == "x.lua"
    assert [h.header for h in section.hunks] == ["@@ -1,3 +1,2 @@", "@@ -10,2 +9,3 @@"]


def test_series_file_comments_and_errors(tmp_path):
    (tmp_path / "series").write_text("# comment\n\n0001-a.patch  # why\n")
    assert read_series_names(tmp_path) == ["0001-a.patch"]
    with pytest.raises(PatchError, match="does not exist"):
        load_series(tmp_path)
    (tmp_path / "series").write_text("a.patch\na.patch\n")
    with pytest.raises(PatchError, match="listed twice"):
        read_series_names(tmp_path)
    (tmp_path / "series").write_text("../escape.patch\n")
    with pytest.raises(PatchError, match="invalid patch name"):
        read_series_names(tmp_path)


def test_series_hash_covers_order_and_content(fake_pin, tmp_path):
    copy = tmp_path / "p"
    shutil.copytree(fake_pin.patches, copy)
    original = series_hash(copy)
    assert original == series_hash(fake_pin.patches)
    names = read_series_names(copy)
    (copy / "series").write_text("".join(f"{n}\n" for n in reversed(names)))
    assert series_hash(copy) != original
    shutil.copy(fake_pin.patches / "series", copy / "series")
    assert series_hash(copy) == original
    with open(copy / names[0], "a") as handle:
        handle.write("\n")
    assert series_hash(copy) != original
    (copy / names[1]).unlink()
    with pytest.raises(PatchError):
        series_hash(copy)


def test_empty_series_is_handled(fake_pin, tree, tmp_path):
    missing = tmp_path / "no-patches-here"
    assert status(tree, missing).state == State.PRISTINE
    assert check(tree, missing).ok
    result = patch_apply.apply(tree, missing)
    assert not result.changed and "empty" in result.message
    assert series_hash(missing) == series_hash(tmp_path / "also-missing")


# --------------------------------------------------------------------------
# apply / status / revert


def test_clean_apply_gives_the_patched_commit(fake_pin, tree):
    assert status(tree, fake_pin.patches).state == State.PRISTINE
    result = patch_apply.apply(tree, fake_pin.patches)
    assert result.changed
    assert scan_tree(tree) == fake_pin.applied_listing()
    assert not (tree / "docs").exists()  # emptied by the deletion, removed like git does
    assert os.access(tree / "tools/run.sh", os.X_OK)
    report = status(tree, fake_pin.patches)
    assert report.state == State.APPLIED and report.applied == 2


def test_double_apply_says_so_and_changes_nothing(fake_pin, tree):
    patch_apply.apply(tree, fake_pin.patches)
    before = snapshot(tree)
    result = patch_apply.apply(tree, fake_pin.patches)
    assert not result.changed and "already applied" in result.message
    assert snapshot(tree) == before


def test_revert_restores_byte_identical_pristine(fake_pin, tree):
    before = snapshot(tree)
    patch_apply.apply(tree, fake_pin.patches)
    assert snapshot(tree) != before
    result = patch_apply.revert(tree, fake_pin.patches)
    assert result.changed
    assert snapshot(tree) == before
    assert status(tree, fake_pin.patches).state == State.PRISTINE
    again = patch_apply.revert(tree, fake_pin.patches)
    assert not again.changed and "already pristine" in again.message


def test_check_fails_on_a_hand_edit_the_hunks_do_not_touch(fake_pin, tree):
    """An edit outside every hunk still lets git apply the patches, but apply
    refuses the MODIFIED tree -- so check must not say "applies"."""
    core = tree / "src/core.c"
    core.write_text(core.read_text() + "/* local edit, far from every hunk */\n")
    before = snapshot(tree)
    report = check(tree, fake_pin.patches)
    assert report.applies and not report.ok
    assert "refuses a MODIFIED tree" in report.describe()
    assert snapshot(tree) == before


def test_conflicting_tree_report_names_the_hunk_and_keeps_the_tree(fake_pin, tree):
    core = tree / "src/core.c"
    core.write_text(core.read_text().replace("int core_26 = 26;", "int core_26 = -1; /* local edit */"))
    before = snapshot(tree)

    report = check(tree, fake_pin.patches)
    assert not report.ok
    first = report.patches[0]
    assert first.outcome == Outcome.FAILS
    core_hunks = [h for h in first.hunks if h.path == "src/core.c"]
    assert [h.applies for h in core_hunks] == [True, True, False]
    assert core_hunks[2].header.startswith("@@ -2")
    described = report.describe()
    assert "src/core.c: hunk #3 @@ -2" in described and "FAILS" in described

    state = status(tree, fake_pin.patches)
    assert state.state == State.MODIFIED and "src/core.c" in state.describe()
    with pytest.raises(PatchError) as failure:
        patch_apply.apply(tree, fake_pin.patches)
    assert "src/core.c: hunk #3" in str(failure.value)
    with pytest.raises(PatchError, match="source fetch --force"):
        patch_apply.revert(tree, fake_pin.patches)
    assert snapshot(tree) == before


def test_partial_tree_is_refused_then_reverted(fake_pin, tree, tmp_path):
    first_only = tmp_path / "first-only"
    first_only.mkdir()
    name = read_series_names(fake_pin.patches)[0]
    shutil.copy(fake_pin.patches / name, first_only / name)
    (first_only / "series").write_text(name + "\n")
    pristine = snapshot(tree)
    patch_apply.apply(tree, first_only)

    report = status(tree, fake_pin.patches)
    assert report.state == State.PARTIAL and report.applied == 1
    checked = check(tree, fake_pin.patches)
    assert [p.outcome for p in checked.patches] == [Outcome.ALREADY_APPLIED, Outcome.APPLIES]
    partial = snapshot(tree)
    with pytest.raises(PatchError, match="patch revert"):
        patch_apply.apply(tree, fake_pin.patches)
    assert snapshot(tree) == partial
    patch_apply.revert(tree, fake_pin.patches)
    assert snapshot(tree) == pristine


def test_files_outside_the_series_must_match_the_pin(fake_pin, tree):
    patch_apply.apply(tree, fake_pin.patches)
    (tree / "src/util.c").write_text("edited\n")
    (tree / "stray.o").write_bytes(b"\0")
    (tree / "tools/run.sh").chmod(0o644)
    report = status(tree, fake_pin.patches)
    assert report.state == State.MODIFIED
    text = report.describe()
    assert "src/util.c" in text and "stray.o" in text and "tools/run.sh" in text


def test_apply_restores_the_tree_when_writing_fails(fake_pin, tree, monkeypatch):
    before = snapshot(tree)
    real_replace = patch_apply.replace_file
    calls = []

    def failing_replace(new, target, **kwargs):
        calls.append(target)
        if len(calls) == 3 and not kwargs.get("keep_times"):
            raise OSError("disk full")
        return real_replace(new, target, **kwargs)

    monkeypatch.setattr(patch_apply, "replace_file", failing_replace)
    with pytest.raises(PatchError, match="disk full"):
        patch_apply.apply(tree, fake_pin.patches)
    assert snapshot(tree) == before


def test_enclosing_repository_and_broken_gitfile_do_not_interfere(fake_pin, tmp_path):
    outer = tmp_path / "outer"
    outer.mkdir()
    git(outer, "init", "-q")
    tree = fake_pin.fresh_tree(outer / "vendor" / "llama.cpp")
    (tree / ".git").write_text("gitdir: ../../.git/modules/vendor/llama.cpp\n")  # as in the sdist
    patch_apply.apply(tree, fake_pin.patches)
    assert status(tree, fake_pin.patches).state == State.APPLIED
    assert git(outer, "ls-files") == b""  # the enclosing repository's index was never touched
    patch_apply.revert(tree, fake_pin.patches)
    assert status(tree, fake_pin.patches).state == State.PRISTINE


def test_tree_that_is_a_git_checkout_works(fake_pin, tmp_path):
    checkout = tmp_path / "checkout"
    git(fake_pin.repo, "worktree", "add", "-q", "--detach", str(checkout), fake_pin.base)
    try:
        patch_apply.apply(checkout, fake_pin.patches)
        assert status(checkout, fake_pin.patches).state == State.APPLIED
        # the checkout's own index is untouched: the changes show as unstaged
        assert git(checkout, "diff", "--cached", "--name-only") == b""
    finally:
        git(fake_pin.repo, "worktree", "remove", "--force", str(checkout))


# --------------------------------------------------------------------------
# export


def test_export_reproduces_the_series(fake_pin, tmp_path):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "series").write_text("old-0001.patch\n")
    (out / "old-0001.patch").write_text("stale")
    (out / "keep-me.txt").write_text("not part of the series")
    names = export(fake_pin.repo, out)
    assert names == read_series_names(fake_pin.patches)
    for name in names:
        assert (out / name).read_bytes() == (fake_pin.patches / name).read_bytes()
    assert not (out / "old-0001.patch").exists() and (out / "keep-me.txt").exists()
    assert read_series_names(out) == names


def test_export_to_a_relative_directory_keeps_the_series(fake_pin, tmp_path, monkeypatch):
    """A relative --patches-dir is relative to the caller's directory, not to the repository git
    runs in (it once sent format-patch's output there and emptied the series)."""
    out = tmp_path / "exported"
    shutil.copytree(fake_pin.patches, out)
    monkeypatch.chdir(tmp_path)
    names = export(fake_pin.repo, "exported")
    assert names == read_series_names(fake_pin.patches) and len(names) == 2
    for name in names:
        assert (out / name).read_bytes() == (fake_pin.patches / name).read_bytes()
    assert not list(fake_pin.repo.glob("exported*"))


def _files(directory: Path) -> dict:
    """name -> (bytes, mtime_ns, inode): a rewritten file changes at least its inode or mtime."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_ino) for p in sorted(directory.iterdir())}


def test_export_does_not_depend_on_git_configuration(fake_pin, tmp_path, monkeypatch):
    """Global, system and repository settings that change git's patch format
    (prefixes, abbreviation, context, diff algorithm, signature, extra
    headers) leave the exported files byte-identical."""
    repo = tmp_path / "repo"
    shutil.copytree(fake_pin.repo, repo, symlinks=True)
    hostile = ("[core]\n\tabbrev = 12\n[diff]\n\tnoprefix = true\n\tcontext = 9\n\talgorithm = histogram\n"
               "\tmnemonicPrefix = true\n[format]\n\tsignature = evil\n\theaders = X-Evil: 1\n\tsignOff = true\n"
               "\tnumbered = true\n")
    (tmp_path / "gitconfig").write_text(hostile)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "gitconfig"))
    with open(repo / ".git" / "config", "a") as config:
        config.write(hostile)
    out = tmp_path / "exported"
    names = export(repo, out)
    for name in names:
        assert (out / name).read_bytes() == (fake_pin.patches / name).read_bytes(), name


def test_reexport_rewrites_nothing(fake_pin, tmp_path):
    """Exporting the same series again touches no file -- also when a commit
    got a new author date (a rebase that reset dates) but the same change."""
    repo = tmp_path / "repo"
    shutil.copytree(fake_pin.repo, repo, symlinks=True)
    out = tmp_path / "exported"
    export(repo, out)
    before = _files(out)
    export(repo, out)
    assert _files(out) == before
    env = dict(os.environ, GIT_COMMITTER_DATE="2025-06-01T00:00:00Z", GIT_CEILING_DIRECTORIES=str(tmp_path))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--amend", "--no-edit",
                    "--date", "2025-06-01T00:00:00Z"], cwd=repo, env=env, check=True)
    export(repo, out)
    assert _files(out) == before
    # a real change rewrites that patch (and only that one)
    (repo / "README.md").write_text((repo / "README.md").read_text() + "one more line\n")
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--amend", "--no-edit",
                    "-a"], cwd=repo, env=env, check=True)
    export(repo, out)
    after = _files(out)
    changed = sorted(name for name in before if after[name] != before[name])
    assert changed == [read_series_names(out)[-1]]


def test_export_refuses_dirty_or_foreign_repositories(fake_pin, tmp_path):
    with pytest.raises(PatchError, match="not the top of a git repository"):
        export(fake_pin.tree, tmp_path / "out")
    readme = fake_pin.repo / "README.md"
    original = readme.read_text()
    readme.write_text("dirty\n")
    try:
        with pytest.raises(PatchError, match="uncommitted changes"):
            export(fake_pin.repo, tmp_path / "out")
    finally:
        readme.write_text(original)
    with pytest.raises(PatchError, match="does not contain the base commit"):
        export(fake_pin.repo, tmp_path / "out", base="1" * 40)


def test_export_from_a_committed_copy_of_the_pin(fake_pin, tmp_path):
    """The documented workflow: git init a pristine tree, `git am` the series, export."""
    repo = fake_pin.fresh_tree(tmp_path / "hi")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "llama.cpp pin")
    for name in read_series_names(fake_pin.patches):
        git(repo, "am", "-q", str(fake_pin.patches / name))
    out = tmp_path / "exported"
    names = export(repo, out)
    assert read_series_names(out) == names
    for name in names:
        assert (out / name).read_bytes() == (fake_pin.patches / name).read_bytes()
    (repo / "README.md").unlink()
    git(repo, "commit", "-qam", "unrelated")
    git(repo, "checkout", "-q", "--orphan", "other")
    git(repo, "commit", "-qm", "no pin here")
    with pytest.raises(PatchError, match="pass --base"):
        export(repo, out)


# --------------------------------------------------------------------------
# the real pinned tree


def test_real_series_applies_and_reverts(request):
    assert read_series_names(paths.patches_dir()), f"the patch series in {paths.patches_dir()} is empty"
    pinned_copy = request.getfixturevalue("pinned_copy")  # only now: copying costs seconds
    before = snapshot(pinned_copy)
    report = check(pinned_copy)
    assert report.ok, report.describe()
    patch_apply.apply(pinned_copy)
    assert status(pinned_copy).state == State.APPLIED
    patch_apply.revert(pinned_copy)
    assert status(pinned_copy).state == State.PRISTINE
    assert snapshot(pinned_copy) == before


def test_made_up_series_on_the_real_tree(pinned_copy, tmp_path):
    """The whole cycle at real scale (3665 files), whatever the real series holds."""
    readme = (pinned_copy / "README.md").read_text()
    changed = readme.replace("\n", "\nHeadInfer was here.\n", 1)
    diff = "".join(difflib.unified_diff(
        readme.splitlines(True), changed.splitlines(True), "a/README.md", "b/README.md"))
    created = "new file mode 100644\n--- /dev/null\n+++ b/headinfer/NOTE.md\n@@ -0,0 +1 @@\n+note\n"
    series_dir = tmp_path / "series"
    series_dir.mkdir()
    (series_dir / "0001-note.patch").write_text(
        "Subject: [PATCH] note\n\n---\n"
        f"diff --git a/README.md b/README.md\n{diff}"
        f"diff --git a/headinfer/NOTE.md b/headinfer/NOTE.md\n{created}"
    )
    (series_dir / "series").write_text("0001-note.patch\n")
    before = snapshot(pinned_copy)
    patch_apply.apply(pinned_copy, series_dir)
    assert status(pinned_copy, series_dir).state == State.APPLIED
    assert tree_acceptance(pinned_copy)[0] is False  # not the default (real) series
    patch_apply.revert(pinned_copy, series_dir)
    assert verify_tree(pinned_copy).ok
    assert snapshot(pinned_copy) == before
