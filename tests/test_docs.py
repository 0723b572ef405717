"""The documentation build fails on what CI must catch (scripts/build-docs, zensical.toml).

Each test builds a small site with the real tools and the repository's docstring extension
(scripts/griffe_extensions.py): a page and a package named ``zkdv`` whose docstrings use
Sphinx roles the way agent/*/src does.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
EXTENSION = REPO_ROOT / "scripts" / "griffe_extensions.py"

pytestmark = pytest.mark.slow  # each build takes a few seconds

PACKAGE = '''\
"""A package whose docstrings name things with Sphinx roles.

:class:`Config` and :meth:`Config.run` are here, :func:`~zkdv.helper` too; :func:`_private`
exists but is not rendered; :class:`ValueError` is a builtin and :func:`jax.jit` belongs
to another project. {extra}

Usage::

    zkdv.helper()
"""


class Config:
    """A configuration; :meth:`run` uses it."""

    def run(self) -> None:
        """Run it (see :class:`Config`)."""


def helper() -> None:
    """Help."""


def _private() -> None:
    """Not part of the API."""
'''


def build(tmp_path: Path, *, extra: str = "", page: str = "") -> tuple[int, str, Path]:
    (tmp_path / "src" / "zkdv").mkdir(parents=True)
    (tmp_path / "src" / "zkdv" / "__init__.py").write_text(PACKAGE.format(extra=extra))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(f"# Home\n\n## Install\n\n{page}\n")
    (tmp_path / "docs" / "api.md").write_text("# API\n\n::: zkdv\n")
    # The repository's own configuration, pointed at this package instead of agent/*/src.
    config = (REPO_ROOT / "zensical.toml").read_text()
    assert 'paths = ["agent/zkdv/src", "agent/dvbench/src"]' in config
    assert 'extensions = ["scripts/griffe_extensions.py"]' in config
    config = re.sub(r"(?ms)^nav = \[.*?^\]\n", 'nav = ["index.md", "api.md"]\n', config)
    config = config.replace('paths = ["agent/zkdv/src", "agent/dvbench/src"]', 'paths = ["src"]')
    config = config.replace('"scripts/griffe_extensions.py"', f'"{EXTENSION}"')
    tomllib.loads(config)
    (tmp_path / "zensical.toml").write_text(config)
    completed = subprocess.run(
        [sys.executable, "-m", "zensical", "build", "--strict", "--clean"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    output = re.sub(r"\x1b\[[0-9;]*m", "", completed.stdout + completed.stderr)
    return completed.returncode, output, tmp_path / "site"


def test_docstring_roles_become_links_or_code(tmp_path: Path) -> None:
    status, output, site = build(tmp_path, page="See [the API](api.md#zkdv.Config).")
    assert status == 0, output
    html = (site / "api" / "index.html").read_text()
    for anchor in ("zkdv.Config", "zkdv.Config.run", "zkdv.helper"):
        assert re.search(rf'<a class="autorefs[^"]*"[^>]*href="[^"]*#{re.escape(anchor)}"', html), (
            anchor
        )
    assert "<code>helper</code>" in html  # the ~ form shows the last name only
    for plain in ("_private", "ValueError", "jax.jit"):
        assert f"<code>{plain}</code>" in html
        assert not re.search(rf'href="[^"]*#{re.escape(plain)}"', html), plain
    assert ":class:" not in html
    assert ":func:" not in html
    assert "Usage:" in html and "Usage::" not in html


def test_a_docstring_role_that_names_nothing_fails_the_build(tmp_path: Path) -> None:
    status, output, _ = build(tmp_path, extra="It returns a :class:`~zkdv.Missing`.")
    assert status != 0
    assert "unresolved autoref" in output
    assert "zkdv.Missing" in output


@pytest.mark.parametrize(
    ("link", "warning"),
    [
        ("[gone](gone.md)", "page does not exist"),
        ("[api](api.md#nowhere)", "anchor does not exist"),
    ],
)
def test_a_broken_link_fails_the_build(tmp_path: Path, link: str, warning: str) -> None:
    status, output, _ = build(tmp_path, page=f"See {link}.")
    assert status != 0
    assert warning in output


def _check_markdown() -> Any:
    spec = importlib.util.spec_from_file_location(
        "check_markdown", REPO_ROOT / "scripts" / "check_markdown.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_text_after_a_closing_fence_and_headings_in_code_are_found() -> None:
    # docs/quickstart-trainers.md as it was: its JAX section rendered as shell.
    page = (
        "## 2. Register\n\n```sh\npython digits.py --dataset-commitment\n``` The web UI and\n"
        "`create_experiment` do the same.\n\n## 3. JAX\n\n```python\nimport zkdv\n```\n"
    )
    found = _check_markdown().problems(page)
    assert [line for line, _ in found] == [5, 8, 10]
    assert "does not close here" in found[0][1] and "opened at line 3" in found[0][1]
    assert "heading inside the code block" in found[1][1]
    assert _check_markdown().problems("```sh\nls\n```\n\n## Fine\n\n~~~\n```\n~~~\n") == []
    assert _check_markdown().problems("text\n\n```sh\nls\n") == [
        (3, "this code block never closes")
    ]


def test_the_repository_s_pages_close_every_fence() -> None:
    assert _check_markdown().main([]) == 0
