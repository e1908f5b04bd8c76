"""Reading ``<build_dir>/manifest.json``, the record a finished build leaves.

The build tool writes it last (:mod:`pyllama_headinfer.build.record`; a
failed build leaves none); the runtime reads it here to find the libraries and
the compiled bindings. Its fields are described in docs/BUILD.md.

This module imports only the pin, the paths, the series hash and the errors:
finding a build never runs the build tool's probes (no cmake, no nvidia-smi)
and does not depend on ``$CMAKE_ARGS``.

Which build is used can change when another one finishes, so the choice is
said: :attr:`Manifest.chosen` is why :func:`find_manifest` took it, and
:func:`announce` logs one INFO line (``using build/cpu (most recently
finished; set PYLLAMA_HEADINFER_BUILD_DIR to choose)``) on the logger
``pyllama_headinfer.runtime.manifest``; the bindings do when they load it,
``serve`` when it starts the build's server.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Tuple

from pyllama_headinfer import paths, pin
from pyllama_headinfer.errors import NotBuiltError, StaleBuildError
from pyllama_headinfer.series import series_hash

log = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 2
BUILD_DIR_ENV = "PYLLAMA_HEADINFER_BUILD_DIR"


def rebuild_hint() -> str:
    """What to run to get a usable build: for the directory $PYLLAMA_HEADINFER_BUILD_DIR names, if set."""
    bdir = os.environ.get(BUILD_DIR_ENV)
    if bdir:
        return f"run `python -m pyllama_headinfer build --build-dir {bdir}` ({BUILD_DIR_ENV} names that directory)"
    return "run `python -m pyllama_headinfer build`"


def _or_set_env() -> str:
    return "" if os.environ.get(BUILD_DIR_ENV) else f" (or set {BUILD_DIR_ENV} to a build directory)"


@dataclass(frozen=True)
class Manifest:
    """A finished build, as its manifest records it.

    The fields the runtime relies on are typed attributes; ``data`` is the
    whole JSON object (compilers, CMake options, timings, ... -- descriptive
    fields, see docs/BUILD.md).
    """

    build_dir: Path
    pin_build: str
    pin_commit: str
    series_hash: str
    libraries: Mapping[str, Path]
    lib_dir: Path
    include_dirs: Tuple[Path, ...]
    source_tree: Path
    bindings: Optional[Path]  # the compiled cffi module; None when built without bindings
    sanitize: Optional[str]
    sanitizer_preload: Tuple[str, ...]
    # GGML_BACKEND_DL (build --portable): the backends (CPU variants, CUDA, RPC) are modules in
    # lib_dir that the bindings load at run time; False for a build made before this was recorded
    backend_dl: bool
    data: Mapping[str, Any]
    chosen: str = "named by the caller"  # why find_manifest chose this build (see describe_choice)

    @property
    def stamp(self) -> str:
        """What the build was made from: ``"<pin commit>+<series hash>"``."""
        return f"{self.pin_commit}+{self.series_hash}"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], build_dir: Path) -> "Manifest":
        bdir = Path(data.get("build_dir") or build_dir)
        bindings = data.get("bindings")
        if bindings and not Path(bindings).is_absolute():
            bindings = bdir / bindings
        libraries = {name: Path(p) for name, p in (data.get("libraries") or {}).items()}
        return cls(
            build_dir=bdir,
            pin_build=str((data.get("pin") or {}).get("build")),
            pin_commit=str((data.get("pin") or {}).get("commit")),
            series_hash=str(data.get("series_hash")),
            libraries=libraries,
            lib_dir=Path(data.get("lib_dir") or bdir / "bin"),
            include_dirs=tuple(Path(d) for d in data.get("include_dirs") or ()),
            source_tree=Path(data.get("source_tree") or ""),
            bindings=Path(bindings) if bindings else None,
            sanitize=data.get("sanitize") or None,
            sanitizer_preload=tuple(data.get("sanitizer_preload") or ()),
            backend_dl=bool(data.get("backend_dl")),
            data=dict(data),
        )


def read_json(path: Path) -> Optional[dict]:
    """A JSON object from ``path``; None when the file is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_manifest(build_dir: os.PathLike) -> Manifest:
    """The manifest of the finished build in ``build_dir``; :class:`NotBuiltError` when
    there is none, it has another format, or a library it names is missing."""
    build_dir = Path(build_dir)
    path = build_dir / MANIFEST_NAME
    data = read_json(path)
    if data is None:
        raise NotBuiltError(f"No llama.cpp build in {build_dir} (no readable {MANIFEST_NAME}); {rebuild_hint()}"
                            f"{_or_set_env()}.")
    if data.get("format") != MANIFEST_FORMAT:
        raise NotBuiltError(f"{path} has format {data.get('format')!r}, expected {MANIFEST_FORMAT}; {rebuild_hint()}.")
    missing = [p for p in (data.get("libraries") or {}).values() if not Path(p).exists()]
    if missing or "llama" not in (data.get("libraries") or {}):
        raise NotBuiltError(f"The build in {build_dir} is incomplete (missing {', '.join(missing) or 'libllama'}); "
                            f"{rebuild_hint()} again.")
    return Manifest.from_dict(data, build_dir)


def find_manifest(build_dir: Optional[os.PathLike] = None, *, require_current: bool = False) -> Manifest:
    """The build to use.

    ``build_dir`` None: ``$PYLLAMA_HEADINFER_BUILD_DIR``, else the most
    recently finished build of the active pin under :func:`paths.build_root`
    (sanitizer builds only when named: they load only with their runtime preloaded).
    ``require_current``: :class:`StaleBuildError` if the build was made from
    another pin or patch series than this checkout's.
    """
    chosen = "named by the caller"
    if build_dir is None and os.environ.get(BUILD_DIR_ENV):
        build_dir, chosen = os.environ[BUILD_DIR_ENV], f"from ${BUILD_DIR_ENV}"
    if build_dir is not None:
        manifest = read_manifest(Path(build_dir).expanduser().resolve())
    else:
        manifest, chosen = _newest_manifest(), f"most recently finished; set {BUILD_DIR_ENV} to choose"
    manifest = dataclasses.replace(manifest, chosen=chosen)
    if require_current:
        check_current(manifest)
    return manifest


def describe_choice(manifest: Manifest) -> str:
    """``using build/cpu (most recently finished; set PYLLAMA_HEADINFER_BUILD_DIR to choose)``:
    which build, and why (the directory relative to the current one when it is below it)."""
    try:
        shown = manifest.build_dir.relative_to(Path.cwd())
    except ValueError:
        shown = manifest.build_dir
    return f"using {shown} ({manifest.chosen})"


def announce(manifest: Manifest) -> None:
    """Log :func:`describe_choice` at INFO (shown by the CLI; silent unless logging is configured)."""
    log.info("%s", describe_choice(manifest))


def _newest_manifest() -> Manifest:
    """The most recently finished build of the active pin (``$PYLLAMA_HEADINFER_PIN``, else the default)."""
    root = paths.build_root()
    wanted = pin.active().build
    found = sorted(root.glob(f"*/{MANIFEST_NAME}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in found:
        try:
            manifest = read_manifest(path.parent)
        except NotBuiltError:
            continue
        if not manifest.sanitize and manifest.pin_build == wanted:
            return manifest
    raise NotBuiltError(f"No build of llama.cpp {wanted} found under {root}; {rebuild_hint()}{_or_set_env()}.")


def check_current(manifest: Manifest) -> None:
    """:class:`StaleBuildError` unless ``manifest`` was built from one of this checkout's pins and
    that pin's series as it is now."""
    built = pin.PINS.get(manifest.pin_build)
    current = series_hash(paths.patches_dir(built)) if built is not None else None
    if built is None or manifest.pin_commit != built.ident or manifest.series_hash != current:
        now = f"series {current[:12]} for it" if current else f"only {', '.join(pin.PINS)}"
        raise StaleBuildError(
            f"The build in {manifest.build_dir} was made from llama.cpp {manifest.pin_build} "
            f"with patch series {manifest.series_hash[:12]}, but this checkout has {now}; "
            f"{rebuild_hint()} again."
        )
