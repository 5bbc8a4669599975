"""scripts/gpu-check.sh rehearsed without a GPU. A GPU run is rare and minutes long: a flag
renamed or a helper moved since the last one would cost it a step, found only there. So the
script runs here as written, with python stood in by a recorder and nvidia-smi by a stub;
then each command line it gave python is parsed by the parser it names, and each Python
here-document is compiled and its imports resolved."""

import argparse
import ast
import contextlib
import importlib
import io
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts/gpu-check.sh"

# Records its arguments, then the here-document a "-" reads, in a file of its own (the script
# runs some in the background), and succeeds; the separators are control characters that no
# argument holds.
RECORDER = r"""#!/usr/bin/env bash
{ printf '%s\x1f' "$@"; printf '\x1d'; [ "${1:-}" = - ] && cat; } \
    > "$(mktemp "$REHEARSAL_DIR/XXXXXXXX")"
exit 0
"""
NVIDIA_SMI = """#!/bin/sh
echo "name, memory.total [MiB], driver_version"
echo "rehearsal, 143771 MiB, 0"
"""
# What a rehearsal must have seen, or it rehearsed less than the script runs.
KINDS = {"pagedserve.cli serve", "pagedserve.cli bench serve", "pagedserve.cli bench throughput",
         "profile_step.py", "sweep_triton_configs.py", "bench_triton_kernels.py",
         "wait_ready.py", "pytest", "here-document"}


@dataclass
class Command:
    argv: list[str]
    stdin: str


class Parsed(Exception):
    """Raised in place of running a command whose line has parsed."""


_parse_args = argparse.ArgumentParser.parse_args


def _parse_only(self, args=None, namespace=None):
    raise Parsed(_parse_args(self, args, namespace))


def _parse_error(run: Callable[[], object]) -> str | None:
    """None where ``run`` gets as far as a parsed command line; else argparse's complaint."""
    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", _parse_only), \
            contextlib.redirect_stderr(err):
        try:
            run()
        except Parsed:
            return None
        except SystemExit:
            return (err.getvalue().strip().splitlines() or ["exited"])[-1]
    return "ran on past its command line"


def _unresolved_imports(code: str) -> list[str]:
    """The modules, and names from modules, that ``code`` imports and this tree lacks."""
    missing = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module_name, name in names:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                missing.append(module_name)
                continue
            if name is not None and not hasattr(module, name):
                missing.append(f"{module_name}.{name}")
    return missing


def rehearse(script: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[Command]]:
    """Runs ``script`` with the recorder as its python; what it printed and what it ran."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", RECORDER), ("nvidia-smi", NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    log = tmp_path / "commands"
    log.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path),
           "OUT": str(tmp_path / "out"), "PYTHON": str(bin_dir / "python"),
           "REHEARSAL_DIR": str(log)}  # (TMPDIR: the script's mktemp folders go with the test's)
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                            timeout=300)
    commands = []
    for record in sorted(log.iterdir()):
        args, _, stdin = record.read_text().partition("\x1d")
        commands.append(Command(args.split("\x1f")[:-1], stdin))
    return result, commands


def problems(commands: list[Command], seen: set[str]) -> list[str]:
    """What would fail on the GPU machine before it ran: each one named by its command."""
    found = []
    for command in commands:
        argv, shown = command.argv, " ".join(command.argv)[:160]
        if argv[0] == "-":
            shown = f"a here-document ({command.stdin.strip().splitlines()[0]}...)"
        if argv[:2] == ["-m", "pagedserve.cli"]:
            from pagedserve import cli

            seen.add(" ".join(["pagedserve.cli", *argv[2:4 if argv[2] == "bench" else 3]]))
            error = _parse_error(partial(cli.main, argv[2:]))
        elif argv[:2] == ["-m", "pytest"]:
            seen.add("pytest")
            missing = [a for a in argv[2:] if a.endswith(".py") and not (ROOT / a).exists()]
            error = f"no such test file: {missing}" if missing else None
        elif argv[:2] == ["-m", "pip"]:
            continue  # (the wheels it installs: tests/test_gpu_host.py)
        elif argv[0] in ("-", "-c"):
            seen.add("here-document" if argv[0] == "-" else "-c")
            code = command.stdin if argv[0] == "-" else argv[1]
            try:
                missing = _unresolved_imports(code)
            except SyntaxError as e:
                missing = [f"a syntax error: {e}"]
            error = f"cannot import {missing}" if missing else None
        elif argv[0] == "scripts/wait_ready.py":
            seen.add("wait_ready.py")
            try:  # PORT PID [TIMEOUT_S]
                int(argv[1]), int(argv[2]), [float(a) for a in argv[3:4]]
                error = None
            except (IndexError, ValueError) as e:
                error = str(e)
        elif argv[0].startswith("scripts/") and argv[0].endswith(".py"):
            name = Path(argv[0]).stem
            seen.add(f"{name}.py")
            module = importlib.import_module(name)
            with mock.patch.object(sys, "argv", argv):
                error = _parse_error(module.main)
        else:
            error = "a command this rehearsal does not know: teach it"
        if error:
            found.append(f"{shown}: {error}")
    return found


def _prepare_imports(monkeypatch) -> None:
    """The here-documents put scripts/ and tests/ on sys.path, and run from the tree's root."""
    for folder in ("tests", "scripts"):
        monkeypatch.syspath_prepend(str(ROOT / folder))
    monkeypatch.chdir(ROOT)


def test_every_command_gpu_check_runs_parses_and_every_here_document_imports(
        tmp_path, monkeypatch):
    result, commands = rehearse(SCRIPT, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "== gpu-check: passed" in result.stdout
    shell_errors = [line for line in (result.stdout + result.stderr).splitlines()
                    if any(s in line for s in ("unbound variable", "syntax error",
                                               "command not found", "bad substitution"))]
    assert shell_errors == []
    _prepare_imports(monkeypatch)
    seen: set[str] = set()
    assert problems(commands, seen) == []
    assert seen >= KINDS, f"not rehearsed: {KINDS - seen}"


def test_a_renamed_flag_and_a_moved_helper_are_caught(tmp_path, monkeypatch):
    text = SCRIPT.read_text()
    broken = text.replace("--stream-interval 4\n", "--stream-intervals 4\n").replace(
        "import bench_decode,", "import bench_decodes,")
    assert broken.count("--stream-intervals") == 1 and "bench_decodes" in broken
    copy = tmp_path / "tree" / "scripts" / "gpu-check.sh"
    copy.parent.mkdir(parents=True)
    copy.write_text(broken)
    shutil.copymode(SCRIPT, copy)
    _, commands = rehearse(copy, tmp_path)
    _prepare_imports(monkeypatch)
    found = problems(commands, set())
    assert len(found) == 2, found
    assert "unrecognized arguments: --stream-intervals" in found[0] + found[1]
    assert "bench_triton_kernels.bench_decodes" in found[0] + found[1]
