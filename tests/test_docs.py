"""README.rst and docs/: every command block marked, links alive, valid RST, and the
README's Python example runs as shown. CI runs all of the pages' commands
(``python tests/doc_commands.py``); here only the example, which is quick."""

from __future__ import annotations

from pathlib import Path

import doc_commands
import pytest
from doc_commands import DocError, Marker, blocks, matches, run_page, static_problems
from mpitest import clean_env, on_rank0_quietly

ROOT = doc_commands.ROOT
#: The pages CI checks (.ci/run): the README, the manual, and the other pages beside the code.
PAGES = [
    *(ROOT / name for name in ("README.rst", "CONTRIBUTING.rst", "CHANGELOG.rst", "jobs/README.rst")),
    *sorted((ROOT / "docs").glob("*.rst")),
]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_is_marked_and_every_link_leads_somewhere(page: Path) -> None:
    assert static_problems(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_are_valid_rst(page: Path) -> None:
    pytest.importorskip("docutils")
    assert doc_commands.rst_problems(page) == []


def test_index_lists_every_page() -> None:
    """A new page of docs/ is reachable from the manual's table of contents."""
    index = ROOT / "docs" / "index.rst"
    linked = {
        (index.parent / m.group(1).partition("#")[0]).resolve() for m in doc_commands.LINK.finditer(index.read_text())
    }
    missing = [p.name for p in PAGES if p.parent == index.parent and p != index and p.resolve() not in linked]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_scripts_the_pages_run_by_path_are_executable(page: Path) -> None:
    """A command such as ``jobs/emulate/sweep.py ...`` works as shown: the file is executable."""
    scripts = {
        cmd.text.split()[0]
        for block in blocks(page.read_text(), page.name)
        for cmd in block.commands()
        if cmd.text.split() and "/" in cmd.text.split()[0]
    }
    mode_bits = {name: (ROOT / name).stat().st_mode for name in scripts if (ROOT / name).is_file()}
    assert [name for name, mode in sorted(mode_bits.items()) if not mode & 0o100] == []


def test_readme_is_a_front_door() -> None:
    """Short, and the README's commands include the install, the first run, the main job and the tests."""
    text = (ROOT / "README.rst").read_text()
    assert len(text.splitlines()) < 250
    commands = [cmd.text for block in blocks(text, "README.rst") for cmd in block.commands()]
    for wanted in ("pip install", "mpidl info", "mpidl train", "python allreduce_demo.py", "pytest --with-mpi"):
        assert any(wanted in cmd for cmd in commands), wanted


@pytest.mark.mpi
def test_readme_python_example_runs_as_shown() -> None:
    failures = on_rank0_quietly(run_page, ROOT / "README.rst", clean_env(), "allreduce_demo.py", lambda _: None)
    assert failures == [], "\n".join(failures)


PAGE = """\
Title
=====

.. check: file hello.sh

::

    echo hello "$1"

.. check: run; output

.. code-block:: console

    $ bash hello.sh world
    hello world
    $ printf 'a\\nb\\nc\\n'
    a
    ...
    $ echo "the answer is 42"
    the answer is ...

.. check: run; exit 3

.. code-block:: console

    $ exit 3
"""


def test_markers_bind_to_the_next_block() -> None:
    found = blocks(PAGE, "page")
    assert [b.marker.file if b.marker else None for b in found] == ["hello.sh", None, None]
    assert [c.text for c in found[1].commands()] == [
        "bash hello.sh world",
        "printf 'a\\nb\\nc\\n'",
        'echo "the answer is 42"',
    ]
    assert found[1].commands()[1].shown == ["a", "..."]
    assert found[2].marker is not None and found[2].marker.exit == 3


def test_shown_output_with_wildcards() -> None:
    assert matches(["a", "..."], ["a", "b", "c"])
    assert matches(["...", "c"], ["a", "b", "c"])
    assert matches(["x ... z"], ["x y z"])
    assert not matches(["a", "b"], ["a", "c"])
    assert not matches(["a"], ["a", "b"])


@pytest.mark.parametrize(
    "text, problem",
    [
        ("::\n\n    $ ls\n", "without a '.. check:' marker"),
        (".. code-block:: python\n\n    print(1)\n", "Python program block without"),
        (".. check: run\n\n::\n\n    no command here\n", "on a block without '$ ' lines"),
        (".. check: in .ci/run\n\n::\n\n    $ rm -rf /nowhere\n", "is not run by"),
    ],
)
def test_static_problems(tmp_path: Path, text: str, problem: str) -> None:
    page = tmp_path / "page.rst"
    page.write_text(text)
    problems = static_problems(page)
    assert len(problems) == 1 and problem in problems[0], problems


@pytest.mark.parametrize(
    "text, error",
    [
        (".. check: run; louder\n\n::\n\n    $ ls\n", "unknown check clause 'louder'"),
        (".. check: run; file x.py\n\n::\n\n    $ ls\n", "exactly one of"),
        (".. check: not run: slow; output\n\n::\n\n    $ ls\n", "output, exit and timeout go with run"),
        (".. check: run\n\nSection\n-------\n\n::\n\n    $ ls\n", "before the next section"),
        ("text\n\n.. check: run\n", "not followed by a block"),
    ],
)
def test_bad_markers(text: str, error: str) -> None:
    with pytest.raises(DocError, match=error):
        blocks(text, "page")


def test_dead_links(tmp_path: Path) -> None:
    page = tmp_path / "page.rst"
    (tmp_path / "other.rst").write_text("Other\n=====\n\nA section\n---------\n")
    page.write_text(
        "`ok <other.rst#a-section>`_ `gone <missing.rst>`_ `no section <other.rst#nothing>`_ `web <https://x.org>`_\n"
    )
    problems = doc_commands.link_problems(page)
    assert len(problems) == 2 and "missing.rst: no such file" in problems[0] and "no such section" in problems[1]


def test_commands_run_and_fail_as_the_page_says(tmp_path: Path) -> None:
    page = tmp_path / "page.rst"
    page.write_text(PAGE)
    assert run_page(page, clean_env(), log=lambda _: None) == []
    page.write_text(PAGE.replace("hello world", "hello moon").replace("exit 3\n\n", "exit 4\n\n"))
    failures = run_page(page, clean_env(), log=lambda _: None)
    assert len(failures) == 2
    assert "`bash hello.sh world` printed other lines than the page shows" in failures[0]
    assert "`exit 3` exited with 3, expected 4" in failures[1]


def test_a_command_past_its_timeout_is_killed(tmp_path: Path) -> None:
    page = tmp_path / "page.rst"
    page.write_text(".. check: run; timeout 1\n\n::\n\n    $ sleep 30 & sleep 30\n")
    failures = run_page(page, clean_env(), log=lambda _: None)
    assert len(failures) == 1 and "did not end within 1 s" in failures[0]


def test_marker_parse_defaults() -> None:
    m = Marker.parse("run", 1, "page")
    assert (m.run, m.exit, m.output, m.timeout) == (True, 0, False, doc_commands.DEFAULT_TIMEOUT)
