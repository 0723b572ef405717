"""Every name the seeds document stands as docs/seed-api.md says (STYLE.md rule 25).

The page's tables are the list: one row per name, the signature the seed shows and a
status. A name that is removed or renamed, a parameter dropped or a default changed,
fails here until the page says what happened; so does one that comes back, so the page
never understates the API either.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGE = REPO_ROOT / "docs" / "seed-api.md"
STATUSES = ("as documented", "extended", "deprecated", "changed", "not provided")
ROW = re.compile(
    r"^\| `(?P<name>[\w.]+)` \| (?:`(?P<signature>\(.*\))`|—) \| (?P<status>[a-z ]+) \|"
)
#: The README's and the tutorial's files, which the page says are here.
SEED_FILES = [
    "examples/jax/train_state.py",
    "examples/jax/basic_training.py",
    "examples/jax/proof_trainstate.py",
    "examples/torch/basic_training.py",
    "scripts/serve-docs",
    "scripts/build-docs",
]
MISSING = object()

NONE = object()  # a parameter without a default


@dataclass(frozen=True)
class Parameter:
    """One parameter, as the seeds write it: ``name``, ``name=default``, ``*args``."""

    name: str
    kind: str  # "positional", "keyword", "*" or "**"
    default: Any = NONE  # the seed's text of the default, or ours as found

    @property
    def optional(self) -> bool:
        return self.default is not NONE

    @property
    def variadic(self) -> bool:
        return self.kind in ("*", "**")


def _rows() -> list[tuple[str, str | None, str]]:
    rows = []
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        found = ROW.match(line)
        if found and found["name"] != "Name":
            rows.append((found["name"], found["signature"], found["status"]))
    return rows


ROWS = _rows()


def _seed_parameters(signature: str) -> list[Parameter]:
    parameters, keyword = [], False
    for token in filter(None, (part.strip() for part in signature[1:-1].split(","))):
        if token == "*":
            keyword = True
        elif token.startswith("**"):
            parameters.append(Parameter("**", "**"))
        elif token.startswith("*"):
            parameters.append(Parameter("*", "*"))
            keyword = True
        else:
            name, _, default = token.partition("=")
            kind = "keyword" if keyword else "positional"
            parameters.append(Parameter(name, kind, default or NONE))
    return parameters


def _our_parameters(target: Any) -> list[Parameter]:
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.VAR_POSITIONAL: "*",
        inspect.Parameter.VAR_KEYWORD: "**",
    }
    listed = list(inspect.signature(target).parameters.values())
    if inspect.isfunction(target) and listed and listed[0].name == "self":
        listed = listed[1:]  # a method looked up on its class
    out = []
    for parameter in listed:
        kind = kinds[parameter.kind]
        name = kind if kind in ("*", "**") else parameter.name
        default = NONE if parameter.default is inspect.Parameter.empty else parameter.default
        out.append(Parameter(name, kind, default))
    return out


def _same_default(seed: str, ours: Any) -> bool:
    try:
        return bool(ast.literal_eval(seed) == ours)
    except ValueError:  # a name: a function's or an enum member's
        return seed in (getattr(ours, "__name__", None), getattr(ours, "name", None))


def _compatible(seed: list[Parameter], ours: list[Parameter]) -> bool:
    """Whether every call the seed's signature allows works on ours, with its defaults."""
    positional = [p for p in ours if p.kind == "positional"]
    matched: set[str] = set()
    for index, wanted in enumerate(p for p in seed if p.kind == "positional"):
        if index >= len(positional) or positional[index].name != wanted.name:
            return False
        matched.add(wanted.name)
    by_name = {p.name: p for p in ours}
    for wanted in seed:
        found = by_name.get(wanted.name)
        if found is None:
            return False
        matched.add(wanted.name)
        if wanted.optional and (
            not found.optional or not _same_default(wanted.default, found.default)
        ):
            return False
    return all(p.name in matched or p.optional or p.variadic for p in ours)


def _exact(seed: list[Parameter], ours: list[Parameter]) -> bool:
    return (
        _compatible(seed, ours)
        and [(p.name, p.kind) for p in seed] == [(p.name, p.kind) for p in ours]
        and all(p.optional == q.optional for p, q in zip(seed, ours, strict=True))
    )


def _resolve(name: str) -> Any:
    """The object a dotted name names: its longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        owner = target
        for attribute in parts[cut:]:
            owner, target = target, inspect.getattr_static(target, attribute, MISSING)
            if target is MISSING:
                return MISSING
        if isinstance(target, classmethod | staticmethod):
            return getattr(owner, parts[-1])  # bound: the signature the caller sees
        return target
    return MISSING


def _skip_without_framework(name: str) -> None:
    for framework in ("jax", "torch"):
        if name.startswith(f"zkdv.{framework}"):
            pytest.importorskip(framework, reason=f"{name} needs the {framework} extra")


def test_the_page_lists_the_seeds_names() -> None:
    names = [name for name, _, _ in ROWS]
    assert len(names) == len(set(names)), "a name is listed twice"
    assert {status for _, _, status in ROWS} <= set(STATUSES)
    # One name of each seed page, so a table that stops parsing fails here.
    for name in (
        "zkdv.SamplingPolicy",
        "zkdv.session.OwnerSession",
        "dvbench.Experiment.proof",
        "zkdv.torch.optimizers.OptimizerBridge.transition",
    ):
        assert name in names
    assert len(ROWS) >= 100


@pytest.mark.parametrize(("name", "signature", "status"), ROWS, ids=[row[0] for row in ROWS])
def test_each_seed_name_stands_as_the_page_says(
    name: str, signature: str | None, status: str
) -> None:
    _skip_without_framework(name)
    target = _resolve(name)
    if status == "not provided":
        assert target is MISSING, f"{name} exists now: docs/seed-api.md says it is not provided"
        return
    assert target is not MISSING, f"the seeds document {name}; it is gone ({status} on the page)"
    if signature is None:
        assert status in ("as documented", "deprecated")
        return
    seed, ours = _seed_parameters(signature), _our_parameters(target)
    found = (
        "as documented"
        if _exact(seed, ours)
        else "extended"
        if _compatible(seed, ours)
        else "changed"
    )
    mine = ", ".join(f"{p.name}={p.default!r}" if p.optional else p.name for p in ours)
    if status == "deprecated":
        assert found != "changed", f"{name}: the seeds' call {signature} fails on ({mine})"
    else:
        assert found == status, f"{name}: {found}, not {status}: seed {signature}, here ({mine})"


@pytest.mark.parametrize(
    ("name", "bases"),
    [
        ("zkdv.ZKDVError", (RuntimeError,)),
        ("zkdv.ZKDVPoisonedError", ("zkdv.ZKDVError",)),
        ("zkdv.ZKDVVerificationError", ("zkdv.ZKDVError",)),
        ("zkdv.overlap.Policy", ("enum.IntEnum",)),
        ("zkdv.torch.ZKDV", ("zkdv.driver.Driver",)),
        ("zkdv.torch.optimizers.OptimizerContract", ("abc.ABC",)),
        ("zkdv.torch.prepared.PreparedOptimizer", ("torch.optim.Optimizer",)),
        ("zkdv.jax.contrib.TrainState", ("flax.training.train_state.TrainState",)),
    ],
)
def test_the_documented_bases(name: str, bases: tuple[Any, ...]) -> None:
    _skip_without_framework(name)
    target = _resolve(name)
    for base in bases:
        if isinstance(base, str):
            module, _, attribute = base.rpartition(".")
            base = getattr(importlib.import_module(module), attribute)
        assert issubclass(target, base), f"{name} is documented as a {base}"


@pytest.mark.parametrize("name", ["ALWAYS", "UNCHECKED", "NEVER"])
def test_the_overlap_policies_are_members(name: str) -> None:
    import zkdv

    assert getattr(zkdv.overlap, name) is zkdv.overlap.Policy[name]


def test_the_dataclasses_the_seeds_mark() -> None:
    import dataclasses

    for name in (
        "zkdv.compilation.PyTreeAdapter",
        "zkdv.compilation.ResultSchema",
        "zkdv.transaction.InputBinding",
    ):
        assert dataclasses.is_dataclass(_resolve(name)), name
    pytest.importorskip("torch")
    assert dataclasses.is_dataclass(_resolve("zkdv.torch.model.PreparedModel"))


@pytest.mark.parametrize("path", SEED_FILES)
def test_the_files_the_seeds_name_are_here(path: str) -> None:
    assert (REPO_ROOT / path).is_file(), f"the seeds point users at {path}"


def test_the_tests_the_page_names_exist() -> None:
    """The page maps each seed example to its test; a renamed test must update it."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## The seeds' examples as tests") :]
    named = set(re.findall(r"\b(test_\w+)\b(?!\.py)", section))
    defined = {
        found
        for path in (REPO_ROOT / "tests").rglob("test_*.py")
        for found in re.findall(r"^def (test_\w+)\(", path.read_text(), re.MULTILINE)
    }
    assert len(named) > 15
    assert named <= defined, f"docs/seed-api.md names tests that do not exist: {named - defined}"
