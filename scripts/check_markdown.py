"""Fenced code blocks that do not close where the author meant them to.

CommonMark closes a fenced block only at a line holding the same fence character, at
least as many times, and nothing else: "``` The web UI ..." is text inside the block,
so everything after it, headings included, renders as code, and the site builds without
a warning. ``scripts/build-docs`` runs this first and fails on what it finds:

* text after a fence inside a block (the block does not close there),
* a Markdown heading (``## ...``) inside a code block,
* a block still open at the end of the file.

    python scripts/check_markdown.py [FILE ...]     # default: README.md and docs/**/*.md
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<rest>.*)$")
HEADING = re.compile(r"^#{2,6} \S")


def problems(text: str) -> list[tuple[int, str]]:
    """``(line, message)`` for each fence problem in the Markdown ``text`` (1-based lines)."""
    found: list[tuple[int, str]] = []
    opened: tuple[int, str] | None = None  # (line, fence)
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if opened is None:
            if match is not None:
                opened = (number, match.group("fence"))
            continue
        start, fence = opened
        if match is not None and match.group("fence").startswith(fence[0] * len(fence)):
            if match.group("fence")[0] == fence[0] and not match.group("rest").strip():
                opened = None
                continue
            found.append(
                (
                    number,
                    f"text after a fence inside the block opened at line {start}: the block "
                    "does not close here (put the text on the next line)",
                )
            )
        elif HEADING.match(line.strip()):
            found.append((number, f"a heading inside the code block opened at line {start}"))
    if opened is not None:
        found.append((opened[0], "this code block never closes"))
    return found


def main(arguments: list[str]) -> int:
    files = [Path(a) for a in arguments] or [ROOT / "README.md", *sorted(ROOT.glob("docs/**/*.md"))]
    failed = 0
    for path in files:
        for number, message in problems(path.read_text()):
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"{shown}:{number}: {message}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
