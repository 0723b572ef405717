"""The README and the role guides run as written, in order, against the session's demo.

Sybil parses the Markdown (fenced blocks, ``<!-- skip: next "why" -->``), and each block
is run the way its reader would run it:

* ``sh`` blocks in bash (``set -euo pipefail``), one after another in one working folder
  that looks like the repository (``agent/`` and ``examples/`` linked in, ``.data/`` the
  demo's data directory), the environment and the current directory carried from block
  to block within a guide. ``pip install`` lines install into a virtual environment of
  the test's own (offline: the pinned dependencies come from ``.venv``), so ``dvbench``
  is the one the guide installed.
* ``python`` blocks marked ``<!-- guide: excerpt examples/... -->`` are excerpts of an
  example, which the guide then runs: every line of the block, comments aside, must be a
  line of that file, so the page cannot drift from the code that runs.
* ``<!-- skip: next "why" -->`` marks what cannot run here (the README's own two
  commands, which are this suite and its setup; a production deployment).

Two substitutions make the guides' placeholders concrete, and nothing else is changed:
``http://127.0.0.1:8000`` becomes the demo's address (it serves on a free port), and
``dvb_...`` the key of the guide's reader (the trainer's in the trainers' guide, the
auditor's in the auditors'). A command that fails (``curl -fsS`` fails on an HTTP error
status, ``dvbench verify-report`` on a FAILED certificate) fails the test with the guide,
its line and the output.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import SkipTest

import pytest
from sybil import Document, Example, Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

from tests.conftest import EmbeddedDemo

REPO_ROOT = Path(__file__).resolve().parent.parent
#: In the order a newcomer reads them: the trainers' runs give the regulator's log two
#: entries and more.
GUIDES = [
    "README.md",
    "docs/quickstart-trainers.md",
    "docs/quickstart-auditors.md",
    "docs/quickstart-regulators.md",
]
#: Whose key ``dvb_...`` stands for, per guide.
READER = {"docs/quickstart-trainers.md": "trainer", "docs/quickstart-auditors.md": "auditor"}
BLOCK_TIMEOUT_SECONDS = 600

pytestmark = pytest.mark.slow


@dataclass
class Workspace:
    """Where the guides run: a repository look-alike with its own venv and a live demo."""

    root: Path
    url: str
    accounts: dict[str, Any]
    environment: dict[str, str]
    log: list[str] = field(default_factory=list)


def _guide_parsers() -> list[Any]:
    def excerpt(example: Example) -> None:
        example.document.namespace["excerpt"] = example.parsed.strip()

    class ExcerptParser:
        """``<!-- guide: excerpt PATH -->``: the next python block is an excerpt of PATH."""

        def __init__(self) -> None:
            self.lexer = DirectiveInHTMLCommentLexer("guide", r"excerpt\s+\S+")

        def __call__(self, document: Document) -> Iterator[Region]:
            for lexed in self.lexer(document):
                path = str(lexed.lexemes["arguments"]).split(None, 1)[1]
                yield Region(lexed.start, lexed.end, path, excerpt)

    return [
        SkipParser(),
        ExcerptParser(),
        CodeBlockParser("sh", evaluator=_run_shell),
        CodeBlockParser("python", evaluator=_check_excerpt),
    ]


def _run_shell(example: Example) -> None:
    namespace = example.document.namespace
    workspace: Workspace = namespace["workspace"]
    guide: str = namespace["guide"]
    source = str(example.parsed)
    source = source.replace("http://127.0.0.1:8000", workspace.url)
    if guide in READER:
        source = source.replace("dvb_...", workspace.accounts[READER[guide]]["api_key"])
    state = workspace.root / ".guide-state"
    state.mkdir(exist_ok=True)
    # One environment and one working folder per guide, named by the guide: a document's
    # id() is reused once an earlier guide's document is freed, and the regulators' guide
    # then ran in the auditors' folder with their variables (its KEY read from a
    # .data/demo-accounts.json that is not there, so empty, and the next curl a 401).
    name = guide.replace("/", "_")
    environment_file, directory_file = state / f"{name}.env", state / f"{name}.cwd"
    if not environment_file.exists():
        environment_file.write_text("")
        directory_file.write_text(str(workspace.root))
    script = "\n".join(
        [
            f"source {shlex.quote(str(environment_file))}",
            f'cd "$(cat {shlex.quote(str(directory_file))})"',
            "set -euo pipefail",
            source,
            f"pwd > {shlex.quote(str(directory_file))}",
            f"export -p > {shlex.quote(str(environment_file))}",
        ]
    )
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", script],
        env=workspace.environment,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_SECONDS,
        check=False,
    )
    where = f"{guide}:{example.line}"
    workspace.log.append(f"{where}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, (
        f"{where}: the block exits {done.returncode}\n--- block ---\n{source}\n"
        f"--- output ---\n{(done.stdout + done.stderr)[-6000:]}"
    )


def _code_lines(text: str) -> list[str]:
    """Non-blank lines without their trailing comments or indentation (``...`` dropped)."""
    lines = []
    for line in text.splitlines():
        code = re.sub(r"\s+#.*$", "", line).strip()
        if code and code != "..." and not code.startswith("#"):
            lines.append(code)
    return lines


def _check_excerpt(example: Example) -> None:
    namespace = example.document.namespace
    guide: str = namespace["guide"]
    path = namespace.pop("excerpt", None)
    assert path is not None, (
        f"{guide}:{example.line}: a python block must run or be marked "
        '`<!-- guide: excerpt examples/... -->` (or `<!-- skip: next "why" -->`)'
    )
    source = set(_code_lines((REPO_ROOT / path).read_text()))
    missing = [line for line in _code_lines(str(example.parsed)) if line not in source]
    assert not missing, f"{guide}:{example.line}: not in {path}: {missing}"


@pytest.fixture(scope="module")
def workspace(embedded_demo: EmbeddedDemo) -> Workspace:
    """The guides' folder is the demo's (``.data`` beside ``agent/`` and ``examples/``)."""
    root = embedded_demo.root
    for name in ("agent", "examples"):
        (root / name).symlink_to(REPO_ROOT / name)
    # The guide's `pip install` goes into a venv of its own that sees .venv's packages
    # (a .pth file): offline and quick, and .venv's editable installs stay as they are.
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # Its own setuptools (the interpreter's bundled one) would shadow the pinned one.
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True
    )
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "zz-dvbench-dev.pth").write_text(
        "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n"
    )
    home = root / "home"
    home.mkdir()
    environment = {
        **embedded_demo.environment,
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "PATH": os.pathsep.join(
            [str(venv / "bin"), str(Path(sys.executable).parent), "/usr/bin", "/bin"]
        ),
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",  # pip reads this one inverted: 0 = no isolation
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    accounts = json.loads((embedded_demo.data / "demo-accounts.json").read_text())
    return Workspace(root, embedded_demo.url, accounts, environment)


# Every block of four guides, 600 s at most each; the demo's setup comes on top of this
# (tests/conftest.py, SLOW_FIXTURE_SECONDS).
@pytest.mark.timeout(1200)
def test_the_guides_run_as_written_in_order(workspace: Workspace) -> None:
    sybil = Sybil(parsers=_guide_parsers())
    ran: dict[str, int] = {}
    for guide in GUIDES:
        document = sybil.parse(REPO_ROOT / guide)
        document.namespace.update(workspace=workspace, guide=guide)
        ran[guide] = 0
        for example in document:
            try:
                example.evaluate()
            except SkipTest:
                continue
            ran[guide] += example.region.evaluator in (_run_shell, _check_excerpt)
    print("\n".join(workspace.log))
    # Every guide ran blocks (a parser that found none would pass vacuously).
    assert all(ran[guide] for guide in GUIDES[1:]), ran
