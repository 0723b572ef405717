"""Griffe extension for the API reference (zensical.toml): Sphinx roles become links.

The agent's docstrings are Google style with Sphinx cross-reference roles, e.g.
``:class:`~zkdv.errors.ZKDVError``` or ``:func:`verify_bundle```. mkdocstrings renders
Markdown, where such a role would show as literal text, so this rewrites each role before
rendering:

* a target that names an object of ``zkdv`` or ``dvbench`` (absolute, or relative to the
  docstring's class, module or package, or imported there) becomes a link when the site
  renders that object, and plain code when it does not (private helpers);
* a target outside these packages (the standard library, JAX, torch, httpx) becomes plain
  code: the build downloads no other project's inventory;
* a target that names nothing (a typo, a renamed or deleted object) becomes a required
  cross-reference, which the strict build reports as an unresolved autoref and fails on.

It also turns a reStructuredText literal-block marker (a line ending in ``::``) into a
colon: the indented block that follows is already a Markdown code block.
"""

from __future__ import annotations

import builtins
import re
from typing import Any

import griffe

OWN_PACKAGES = ("zkdv", "dvbench")
ROLE = re.compile(r":(?:func|class|meth|mod|attr|exc|data|obj):`(?P<target>[^`]+)`")
LITERAL_BLOCK = re.compile(r"(?<=\S)::$", re.MULTILINE)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles in every docstring of the packages this build loads."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name not in OWN_PACKAGES:
            return
        # A docstring of one package may name the other (dvbench's name zkdv's objects).
        for name in OWN_PACKAGES:
            if name not in loader.modules_collection.members:
                loader.load(name)
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _rewrite(obj.docstring.value, obj, loader.modules_collection)


def _walk(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if isinstance(member, griffe.Object) and member.parent is obj:  # not an import
            found.extend(_walk(member))
    return found


def _rewrite(text: str, obj: griffe.Object, collection: griffe.ModulesCollection) -> str:
    def link(match: re.Match[str]) -> str:
        target = match.group("target").strip()
        short = target.startswith("~")
        target = target.lstrip("~").removesuffix("()")
        shown = target.rsplit(".", 1)[-1] if short else target
        code = f"<code>{shown}</code>"
        path = _resolve(target, obj, collection)
        if path is not None:
            # Optional: a link when the site renders the object, plain code when not.
            return f'<autoref identifier="{path}" optional>{code}</autoref>'
        ours = target.split(".", 1)[0] in OWN_PACKAGES
        unqualified = "." not in target and not hasattr(builtins, target)
        if ours or unqualified:
            return f"[`{shown}`][{target}]"  # names nothing: the strict build fails
        return code  # another project's object

    return LITERAL_BLOCK.sub(":", ROLE.sub(link, text))


def _resolve(target: str, obj: griffe.Object, collection: griffe.ModulesCollection) -> str | None:
    candidates = []
    if target.split(".", 1)[0] in OWN_PACKAGES:
        candidates.append(target)
    scope: griffe.Object | None = obj
    while scope is not None:
        candidates.append(f"{scope.path}.{target}")
        scope = scope.parent
    for candidate in candidates:
        found = _lookup(candidate, collection)
        if found is not None:
            return found
    return None


def _lookup(path: str, collection: griffe.ModulesCollection, depth: int = 0) -> str | None:
    """The canonical path of the object at ``path``, following imports; None if none."""
    if depth > 10 or path.split(".", 1)[0] not in OWN_PACKAGES:
        return None
    parts = path.split(".")
    current: Any = collection
    for index, part in enumerate(parts):
        members = current.members
        if part not in members:
            return None
        current = members[part]
        if current.is_alias:
            rest = ".".join([current.target_path, *parts[index + 1 :]])
            return _lookup(rest, collection, depth + 1)
    return str(current.path)
