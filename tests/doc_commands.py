"""The commands that README.rst and docs/ show, run as shown.

Every literal block that shows a command (a line starting with ``$ ``) or a
Python program (``.. code-block:: python``) carries a marker: an RST comment
just before the block, or before the paragraph that introduces it, which is
invisible when the page is rendered::

    .. check: run                   run every "$ " line; each must exit with 0
    .. check: run; exit 3           ... must exit with 3
    .. check: run; output           ... and print on stdout what the block shows
                                    under it ("..." alone on a line stands for
                                    any lines, "..." inside a line for any text)
    .. check: run; timeout 300      seconds each command may take (default 120)
    .. check: file NAME             write the block to NAME before the commands run
    .. check: in .ci/run            CI runs it: its words, in their order, are on one
                                    line of .ci/run (which may add -q or a timeout)
    .. check: not run: REASON       shown, not run (a cluster's MPI, minutes of training)

A command or program block without a marker is an error, so no command can
escape the check. Commands run in document order, each in a fresh ``bash``
under a timeout, in a scratch directory that links to every entry of the
repository root: paths such as ``tests/scripts/failure.py`` work as they do
from the root, and what the commands write stays out of the tree. One
scratch directory per page, so a page's commands see each other's files.

The pages are also checked as text: valid reStructuredText (with docutils,
if installed) and relative links that lead to an existing file and section.

Usage (CI runs it on the README and every page of docs/)::

    python tests/doc_commands.py README.rst CONTRIBUTING.rst CHANGELOG.rst jobs/README.rst docs/*.rst
    python tests/doc_commands.py --list README.rst      # the blocks and their markers
    python tests/doc_commands.py --no-run docs/*.rst    # markers, links, RST only
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shm_segments import remove_orphaned_segments, segments

ROOT = Path(__file__).resolve().parent.parent
CI_SCRIPT = ROOT / ".ci" / "run"
DEFAULT_TIMEOUT = 120.0

_MARKER = re.compile(r"^\s*\.\. check:\s*(.*?)\s*$")
_CODE_DIRECTIVE = re.compile(r"^\s*\.\. (?:code-block|code|sourcecode)::\s*(\S*)\s*$")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
#: A hyperlink with its target: `text <target>`_ or, anonymous, `text <target>`__.
LINK = re.compile(r"`[^`<]*<([^>`]+)>`__?")


class DocError(Exception):
    """A page whose markers, blocks or links are wrong."""


@dataclass
class Marker:
    """What to do with the block after a ``.. check:`` comment."""

    line: int
    run: bool = False
    exit: int = 0
    output: bool = False
    timeout: float = DEFAULT_TIMEOUT
    file: str | None = None
    in_ci: bool = False
    reason: str = ""

    @classmethod
    def parse(cls, text: str, line: int, where: str) -> Marker:
        marker = cls(line)
        for clause in (c.strip() for c in text.split(";")):
            word, _, rest = clause.partition(" ")
            rest = rest.strip()
            if clause == "run":
                marker.run = True
            elif word == "exit" and rest.isdigit():
                marker.exit = int(rest)
            elif clause == "output":
                marker.output = True
            elif word == "timeout" and re.fullmatch(r"\d+(\.\d+)?", rest):
                marker.timeout = float(rest)
            elif word == "file" and rest and "/" not in rest:
                marker.file = rest
            elif clause == "in .ci/run":
                marker.in_ci = True
            elif clause.startswith("not run:") and clause[len("not run:") :].strip():
                marker.reason = clause[len("not run:") :].strip()
            else:
                raise DocError(f"{where}:{line}: unknown check clause {clause!r} (see tests/doc_commands.py)")
        kinds = [marker.run, marker.file is not None, marker.in_ci, bool(marker.reason)]
        if sum(kinds) != 1:
            raise DocError(f"{where}:{line}: a check says exactly one of run, file NAME, in .ci/run, not run: REASON")
        if not marker.run and (marker.output or marker.exit or marker.timeout != DEFAULT_TIMEOUT):
            raise DocError(f"{where}:{line}: output, exit and timeout go with run")
        return marker


@dataclass
class Command:
    """One ``$ `` line of a block and the lines the block shows under it."""

    line: int
    text: str
    shown: list[str] = field(default_factory=list)


@dataclass
class Block:
    """A literal block: where its first line is, its dedented lines, its language, its marker."""

    line: int
    lines: list[str]
    language: str
    marker: Marker | None = None

    def commands(self) -> list[Command]:
        found: list[Command] = []
        for offset, text in enumerate(self.lines):
            if text.startswith("$ "):
                found.append(Command(self.line + offset, text[2:].strip()))
            elif found:
                found[-1].shown.append(text)
        for cmd in found:
            while cmd.shown and not cmd.shown[-1].strip():
                cmd.shown.pop()
        return found

    def needs_marker(self) -> bool:
        return self.language == "python" or any(line.startswith("$ ") for line in self.lines)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def blocks(text: str, where: str) -> list[Block]:
    """The literal blocks of an RST text, each with the marker that precedes it."""
    lines = text.splitlines()
    found: list[Block] = []
    pending: Marker | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        m = _MARKER.match(line)
        if m:
            if pending is not None:
                raise DocError(f"{where}:{pending.line}: check not followed by a block before the next check")
            pending = Marker.parse(m.group(1), i + 1, where)
            i += 1
            continue
        if pending is not None and _UNDERLINE.match(line) and i > 0 and lines[i - 1].strip():
            raise DocError(f"{where}:{pending.line}: check not followed by a block before the next section")
        code = _CODE_DIRECTIVE.match(line)
        literal = not line.lstrip().startswith("..") and line.rstrip().endswith("::")
        if not (code or literal):
            i += 1
            continue
        base = _indent(line)
        i += 1
        if code:  # directive options (":linenos:") come first
            while i < len(lines) and lines[i].strip().startswith(":") and _indent(lines[i]) > base:
                i += 1
        start = i
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            i += 1
        body = lines[start:i]
        while body and not body[-1].strip():
            body.pop()
        first = next((k for k, text in enumerate(body) if text.strip()), len(body))
        body = body[first:]
        if not body:
            continue
        cut = min(_indent(text) for text in body if text.strip())
        found.append(Block(start + first + 1, [text[cut:] for text in body], code.group(1) if code else "", pending))
        pending = None
    if pending is not None:
        raise DocError(f"{where}:{pending.line}: check not followed by a block")
    return found


def _words(command: str) -> list[str]:
    return shlex.split(command, comments=True)


def _is_subsequence(small: list[str], big: list[str]) -> bool:
    it = iter(big)
    return all(word in it for word in small)


def static_problems(path: Path, ci_script: Path = CI_SCRIPT) -> list[str]:
    """What is wrong with a page without running anything: markers, blocks, links, CI commands."""
    where = _display(path)
    try:
        found = blocks(path.read_text(encoding="utf-8"), where)
    except DocError as exc:
        return [str(exc)]
    problems = []
    ci_lines = [_words(line) for line in ci_script.read_text().splitlines()] if ci_script.exists() else []
    for block in found:
        marker = block.marker
        if marker is None:
            if block.needs_marker():
                what = "Python program" if block.language == "python" else "command"
                problems.append(f"{where}:{block.line}: a {what} block without a '.. check:' marker")
            continue
        if (marker.run or marker.in_ci) and not block.commands():
            problems.append(f"{where}:{block.line}: 'check: run' or 'in .ci/run' on a block without '$ ' lines")
        if marker.in_ci:
            for cmd in block.commands():
                if not any(_is_subsequence(_words(cmd.text), line) for line in ci_lines):
                    problems.append(f"{where}:{cmd.line}: `{cmd.text}` is not run by {_display(ci_script)}")
    return problems + link_problems(path)


def _slug(title: str) -> str:
    """The id docutils (and so GitHub) gives a section: lower case, runs of other characters as '-'."""
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def section_ids(path: Path) -> set[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return {
        _slug(lines[i - 1])
        for i in range(1, len(lines))
        if _UNDERLINE.match(lines[i]) and lines[i - 1].strip() and len(lines[i].rstrip()) >= len(lines[i - 1].rstrip())
    }


def link_problems(path: Path) -> list[str]:
    """Relative links that lead nowhere: a missing file, or a section the target page lacks."""
    problems = []
    text = path.read_text(encoding="utf-8")
    for m in LINK.finditer(text):
        target = m.group(1).strip()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        line = text.count("\n", 0, m.start()) + 1
        if not dest.exists():
            problems.append(f"{_display(path)}:{line}: link to {target}: no such file")
        elif anchor and dest.suffix == ".rst" and anchor not in section_ids(dest):
            problems.append(f"{_display(path)}:{line}: link to {target}: {_display(dest)} has no such section")
    return problems


def rst_problems(path: Path) -> list[str]:
    """docutils' warnings and errors about a page ([] if docutils is not installed)."""
    try:
        from docutils.core import publish_doctree
        from docutils.utils import Reporter
    except ImportError:
        return []
    stream = io.StringIO()
    publish_doctree(
        path.read_text(encoding="utf-8"),
        source_path=str(path),
        settings_overrides={
            "report_level": Reporter.WARNING_LEVEL,
            "halt_level": Reporter.SEVERE_LEVEL + 1,
            "warning_stream": stream,
            "syntax_highlight": "none",
        },
    )
    return [line for line in stream.getvalue().splitlines() if line.strip()]


def matches(shown: list[str], actual: list[str]) -> bool:
    """Whether ``actual`` lines are what ``shown`` shows ("..." lines: any lines; "..." in a line: any text)."""
    if not shown:
        return not actual
    head = shown[0].rstrip()
    if head == "...":
        return any(matches(shown[1:], actual[k:]) for k in range(len(actual) + 1))
    if not actual:
        return False
    pattern = ".*".join(re.escape(part) for part in head.split("..."))
    return re.fullmatch(pattern, actual[0].rstrip()) is not None and matches(shown[1:], actual[1:])


def scratch_root(directory: Path, root: Path = ROOT) -> Path:
    """Fill ``directory`` with links to every entry of the repository root."""
    for entry in root.iterdir():
        if entry.name != ".git":
            (directory / entry.name).symlink_to(entry)
    return directory


def run_command(command: str, cwd: Path, timeout: float, env: Mapping[str, str]) -> tuple[int | None, str, str, float]:
    """Run ``command`` in a fresh bash; (exit status or None on timeout, stdout, stderr, seconds).
    On timeout the whole process group (mpiexec and its ranks) is killed; MPICH's segments
    that a killed or aborted job left in /dev/shm are removed."""
    t0 = time.monotonic()
    before = segments()
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=dict(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        status: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = None
    remove_orphaned_segments(before)  # what an aborted or killed MPICH job left in /dev/shm
    return status, out, err, time.monotonic() - t0


def _tail(text: str, lines: int = 30) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join("    | " + line for line in kept) if kept else "    | (nothing)"


def run_page(
    path: Path,
    env: Mapping[str, str] | None = None,
    only: str | None = None,
    log=print,
) -> list[str]:
    """Run the commands of one page as its markers say; the failures, each with the output it left."""
    where = _display(path)
    failures = []
    env = os.environ if env is None else env
    with tempfile.TemporaryDirectory(prefix="doc-commands-") as tmp:
        cwd = scratch_root(Path(tmp))
        for block in blocks(path.read_text(encoding="utf-8"), where):
            marker = block.marker
            if marker is None:
                continue
            if marker.file is not None:
                (cwd / marker.file).write_text("\n".join(block.lines) + "\n", encoding="utf-8")
                continue
            if not marker.run:
                continue
            for cmd in block.commands():
                if only is not None and only not in cmd.text:
                    continue
                status, out, err, took = run_command(cmd.text, cwd, marker.timeout, env)
                problem = None
                if status is None:
                    problem = f"did not end within {marker.timeout:g} s"
                elif status != marker.exit:
                    problem = f"exited with {status}, expected {marker.exit}"
                elif marker.output and not matches(cmd.shown, out.splitlines()):
                    problem = "printed other lines than the page shows:\n" + "\n".join(
                        "    > " + line for line in cmd.shown
                    )
                log(f"{'FAIL' if problem else 'ok  '} {took:6.1f} s  {where}:{cmd.line}  $ {cmd.text}")
                if problem:
                    failures.append(
                        f"{where}:{cmd.line}: `{cmd.text}` {problem}\n  stdout:\n{_tail(out)}\n  stderr:\n{_tail(err)}"
                    )
    return failures


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def describe(paths: Iterable[Path]) -> None:
    for path in paths:
        for block in blocks(path.read_text(encoding="utf-8"), _display(path)):
            if block.marker is None and not block.needs_marker():
                continue
            m = block.marker
            if m is None:
                what = "NO MARKER"
            elif m.file:
                what = f"file {m.file}"
            elif m.in_ci:
                what = "in .ci/run"
            elif m.reason:
                what = f"not run: {m.reason}"
            else:
                what = f"run (exit {m.exit}{', output' if m.output else ''}, timeout {m.timeout:g} s)"
            first = block.lines[0] if block.lines else ""
            print(f"{_display(path)}:{block.line}: {what}: {first[:70]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="+", type=Path, help="RST files")
    parser.add_argument("--no-run", action="store_true", help="check markers, links and RST; run nothing")
    parser.add_argument("--list", action="store_true", help="list the blocks and their markers")
    args = parser.parse_args(argv)
    if args.list:
        describe(args.pages)
        return 0
    problems = [p for page in args.pages for p in static_problems(page) + rst_problems(page)]
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(f"doc_commands: {len(args.pages)} page(s): markers, links and RST fine")
    if args.no_run:
        return 0
    t0 = time.monotonic()
    failures = [f for page in args.pages for f in run_page(page)]
    print(f"doc_commands: commands run in {time.monotonic() - t0:.1f} s, {len(failures)} failed")
    if failures:
        print("\n\n".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
