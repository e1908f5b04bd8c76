"""Steps 4-6 of ``build``, in a build directory: configure, compile, bindings.

- configure: CMake runs only when the directory was not configured with
  exactly these options, this cmake and this source tree
  (:func:`needs_configure`; the last successful configure is recorded in
  ``STATE_NAME``);
- compile: ``ninja <library targets>`` (the targets are read from
  ``build.ninja``) with the progress display;
- bindings: the cffi extension, compiled again only when the libraries or
  what it is compiled from changed.

Every command's full output goes to the log (:func:`run_logged`); a failing
step prints the log's tail and becomes one one-paragraph :class:`BuildError`
whose ``.kind`` names the cause when it is recognized (:func:`_fail`), or
:class:`BuildInterrupted` after Ctrl-C.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
from pathlib import Path
from typing import IO, Dict, List, Mapping, Optional, Sequence, Tuple

from pyllama_headinfer.build import extension, toolchain
from pyllama_headinfer.build.lock import held_lock_fds
from pyllama_headinfer.build.plan import TOOL_TARGETS, BuildPlan, parse_define, tool_option_names
from pyllama_headinfer.errors import BuildError, BuildInterrupted, HeadInferError, UsageError
from pyllama_headinfer.build.record import write_json
from pyllama_headinfer.runtime.manifest import read_json
from pyllama_headinfer.build.progress import Progress, classify_failure, tail

STATE_NAME = ".pyllama-configure.json"  # what the last successful configure used

TAIL_LINES = 30



# --------------------------------------------------------------------------
# configure


def configured_tools(d: Path) -> Tuple[Optional[str], Optional[str]]:
    """The cmake and ninja the directory was configured with (kept while they work; see find_tool)."""
    state = read_json(d / STATE_NAME) or {}
    argv = state.get("argv") or []
    ninja = next((a.split("=", 1)[1] for a in argv if a.startswith("-DCMAKE_MAKE_PROGRAM=")), None)
    return state.get("cmake") or (argv[0] if argv else None), state.get("ninja") or ninja


def configured_with_tools(d: Path) -> bool:
    """Whether the last successful configure of ``d`` included the tools (``build --tools``)."""
    state = read_json(d / STATE_NAME) or {}
    return "-DLLAMA_BUILD_TOOLS=ON" in (state.get("argv") or [])


def configured_user_defines(d: Path) -> List[str]:
    """The user's -D options of the last successful configure of ``d`` (-D, --cmake-arg, $CMAKE_ARGS),
    which a later ``build`` of the directory keeps (``--reset-options`` forgets them)."""
    state = read_json(d / STATE_NAME) or {}
    defines = state.get("user_defines")
    if not isinstance(defines, list):
        # configured before the state recorded them: the -D options of the configure command that
        # the tool does not set itself
        defines = [a for a in (state.get("argv") or [])[1:] if isinstance(a, str) and a.startswith("-D")]
        ours = tool_option_names()
    else:
        ours = set()
    kept = []
    for define in defines:
        try:
            name = parse_define(str(define))[0]
        except UsageError:  # not one of ours (a hand-edited state): not kept
            continue
        if name not in ours:
            kept.append(str(define))
    return kept


def configure_if_needed(plan, source_tree, cmake, ninja, fresh, log, log_path, run_env, echo, say) -> bool:
    d = plan.build_dir
    previous = read_json(d / STATE_NAME)
    argv = configure_argv(plan, source_tree, cmake, ninja)
    reason = needs_configure(plan, source_tree, argv, fresh)
    if reason is None:
        return False
    if fresh or (previous and previous.get("source_tree") != str(source_tree)):
        _wipe_cmake_cache(d)
        previous = None
    (d / STATE_NAME).unlink(missing_ok=True)
    say(f"Configuring with CMake {toolchain.fmt_version(cmake.version)} ({reason}) ...")
    rc = run_logged(argv + unset_dropped(plan, previous), log, cwd=d, echo=echo, env=run_env)
    if rc != 0:
        raise _fail("Configuring llama.cpp with CMake", rc, log_path, say,
                    "Check the -D/--cmake-arg options and $CMAKE_ARGS; --fresh configures this "
                    "directory from scratch. ")
    write_json(d / STATE_NAME, {"source_tree": str(source_tree), "argv": argv, "options": plan.options,
                                 "user_defines": plan.user_defines(), "cmake": cmake.path, "ninja": ninja.path})
    return True


def needs_configure(plan: BuildPlan, source_tree: Path, argv: List[str], fresh: bool) -> Optional[str]:
    """Why CMake must run now, or None when ninja alone is enough."""
    d = plan.build_dir
    if fresh:
        return "--fresh"
    if not (d / "build.ninja").is_file() or not (d / "CMakeCache.txt").is_file():
        return "first configure of this directory"
    state = read_json(d / STATE_NAME)
    if state is None:
        return "no record of the last configure"
    if state.get("source_tree") != str(source_tree):
        return f"source tree changed (was {state.get('source_tree')})"
    old = state.get("argv") or []
    if old != argv:
        if old[:1] != argv[:1]:
            return f"another cmake: {argv[0]} (was {old[0] if old else 'unknown'})"
        added = [a for a in argv if a not in old]
        removed = [a for a in old if a not in argv]
        changes = ", ".join([f"+{a}" for a in added] + [f"-{a}" for a in removed])
        return f"CMake options changed: {changes}"
    return None


def configure_argv(plan: BuildPlan, source_tree: Path, cmake: toolchain.Tool, ninja: toolchain.Tool) -> List[str]:
    """The configure command (without the -U of options dropped since last time)."""
    return [cmake.path, "-S", str(source_tree), "-B", str(plan.build_dir), "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja.path}", *plan.defines()]


def unset_dropped(plan: BuildPlan, previous: Optional[dict]) -> List[str]:
    """``-UNAME`` for options passed last time but not now, so they return to their defaults."""
    old = (previous or {}).get("options", {})
    return [f"-U{name}" for name in old if name not in plan.options]


def _wipe_cmake_cache(build_dir: Path) -> None:
    (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    (build_dir / STATE_NAME).unlink(missing_ok=True)


# --------------------------------------------------------------------------
# compile


_PHONY_RE = re.compile(r"^build ([\w.+-]+): phony (\S+)$", re.M)


def phony_outputs(build_dir: Path) -> Dict[str, str]:
    """target -> output path (relative) of the phony target aliases in build.ninja."""
    try:
        text = (build_dir / "build.ninja").read_text(errors="replace")
    except OSError:
        return {}
    return {m.group(1): m.group(2) for m in _PHONY_RE.finditer(text)}


def library_targets(phonies: Mapping[str, str]) -> Dict[str, str]:
    """The llama and ggml* shared-library targets of a configured tree."""
    libs = {}
    for name, out in phonies.items():
        base = os.path.basename(out)
        if (name == "llama" or name.startswith("ggml")) and (base.startswith("lib") or base.endswith(".dll")):
            libs[name] = out
    return libs


def select_targets(d: Path, phonies: Mapping[str, str], libs: Mapping[str, str], tools: bool,
                    log_path: Path, say) -> List[str]:
    if "llama" not in libs:
        raise BuildError(f"CMake produced no `llama` library target in {d}/build.ninja; "
                         f"see {log_path}, or configure again from scratch with --fresh.")
    targets = list(libs)
    if tools:
        targets += [t for t in TOOL_TARGETS if t in phonies]
        missing = [t for t in TOOL_TARGETS if t not in phonies]
        if missing:
            say(f"warning: no target {', '.join(missing)} in this configuration; not built.")
    return targets


def run_ninja(d: Path, ninja: toolchain.Tool, targets: List[str], jobs: Optional[int], log, log_path, run_env, echo,
             out, say) -> Tuple[int, bool]:
    argv = [ninja.path, "-C", str(d)] + (["-j", str(jobs)] if jobs else []) + targets
    progress = Progress(out)
    steps = {"n": 0, "no_work": False}
    say(f"Compiling {', '.join(targets)} with ninja (log: {log_path}) ...")
    rc = run_logged(argv, _Tee(log, steps), cwd=d, progress=progress, echo=echo, env=run_env)
    if rc != 0:
        raise _fail("Compiling llama.cpp", rc, log_path, say,
                    "Run build again after fixing the cause; finished objects are kept. ")
    return steps["n"], steps["no_work"] or (steps["n"] == 0 and steps.get("always", 0) > 0)


class _Tee:
    """A log file that also counts ninja's steps and notices ``no work to do``."""

    def __init__(self, log: IO[str], counters: dict):
        self.log = log
        self.counters = counters

    # llama-server's web UI step runs at every build (an always-out-of-date custom command):
    # it is not a change, so a build with only that step is still "up to date"
    ALWAYS_RUN = ("Provisioning UI assets",)

    def write(self, line: str) -> None:
        self.log.write(line)
        if line.startswith("[") and re.match(r"^\[\d+/\d+\]", line):
            if any(what in line for what in self.ALWAYS_RUN):
                self.counters["always"] = self.counters.get("always", 0) + 1
            else:
                self.counters["n"] += 1
        elif line.startswith("ninja: no work to do"):
            self.counters["no_work"] = True

    def flush(self) -> None:
        self.log.flush()


# --------------------------------------------------------------------------
# running a command, and a failed step


def run_logged(argv: Sequence[str], log: IO[str], *, cwd: Path, progress: Optional[Progress] = None,
                echo: Optional[IO[str]] = None, env: Optional[Mapping[str, str]] = None) -> int:
    """Runs a command, appending its output to ``log`` (and ``echo``), feeding ``progress``."""
    log.write(f"$ {' '.join(shlex.quote(str(a)) for a in argv)}\n")
    log.flush()
    try:
        # the build lock goes with the child (and ninja's compilers): see build_lock
        proc = subprocess.Popen([str(a) for a in argv], cwd=str(cwd), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(env or os.environ),
                                text=True, encoding="utf-8", errors="replace", bufsize=1,
                                pass_fds=held_lock_fds())
    except OSError as exc:
        raise BuildError(f"Cannot run {argv[0]}: {exc}") from None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if echo is not None:
                echo.write(line)
            elif progress is not None:
                progress.feed(line)
        return proc.wait()
    except KeyboardInterrupt:
        # With a terminal, ninja got the same Ctrl-C; send it anyway in case we
        # were interrupted on our own (it stops its compilers and exits).
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        raise
    finally:
        if progress is not None:
            progress.close()
        log.flush()


def _fail(step: str, rc: int, log_path: Path, say, advice: str = "") -> BuildError:
    """Prints the log's tail and returns the error to raise."""
    lines = tail(log_path, TAIL_LINES)
    if rc in (-signal.SIGINT, 128 + signal.SIGINT) or any("interrupted by user" in line for line in lines[-3:]):
        return interrupted_error()
    if lines or log_path.is_file():  # no log: the directory was removed (build_lock says so)
        say(f"--- last {len(lines)} lines of {log_path} ---")
        for line in lines:
            say(line)
        say("---")
    try:
        whole = log_path.read_text(errors="replace").splitlines()
    except OSError:
        whole = lines
    cause = classify_failure(whole)
    reason = f": {cause[1]}" if cause else ""
    err = BuildError(f"{step} failed (exit status {rc}){reason}. {advice}Full log: {log_path}")
    err.log_tail = lines  # type: ignore[attr-defined]
    err.kind = cause[0] if cause else None  # type: ignore[attr-defined]
    return err


def interrupted_error() -> BuildInterrupted:
    return BuildInterrupted(
        "Build interrupted. Nothing is lost: run the same command again and it resumes "
        "where it stopped (finished objects are kept)."
    )


# --------------------------------------------------------------------------
# the cffi bindings


def bindings_fingerprint(source_tree: Path, series_hash: str) -> str:
    """Hash of everything the cffi extension is compiled from, to skip recompiling it."""
    h = hashlib.sha256(series_hash.encode())
    files = [Path(extension.__file__), source_tree / "include" / "llama.h", *sorted(extension.DECL_DIR.glob("*"))]
    for f in files:
        try:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        except OSError:
            h.update(f.name.encode() + b"\0missing")
    return h.hexdigest()


def build_bindings(plan: BuildPlan, source_tree: Path, lib_dir: Path, previous: Optional[dict],
                    libs_rebuilt: bool, fingerprint: Optional[str], say) -> Optional[str]:
    old = (previous or {}).get("bindings")
    if (not libs_rebuilt and old and Path(old).is_file() and fingerprint
            and (previous or {}).get("bindings_fingerprint") == fingerprint):
        return old
    say("Compiling the cffi bindings ...")
    try:
        return str(extension.compile_extension(plan.build_dir, source_tree, lib_dir))
    except HeadInferError:
        raise
    except Exception as exc:  # noqa: BLE001 - a compiler failure must not become a traceback
        raise BuildError(f"Compiling the cffi bindings failed: {exc}") from exc
