"""The repository layout of the design card, with nothing shadowing the standard library."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import grimp
import pytest

from tests.sources import AGENT_SOURCES

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Where top-level import names live: the repository root (the server) and the SDK.
IMPORT_ROOTS = (REPO_ROOT, *AGENT_SOURCES)
DESIGN_CARD = (
    "manage.py",
    "pyproject.toml",
    "platform",
    "attestations",
    "provers",
    "agent",
    "templates",
    "tests",
    "compose.yaml",
    "README.md",
)
NOT_IMPORTABLE = {".venv", ".git", ".data", "node_modules"}
#: Suffixes of files that are never source: database dumps (a Redis snapshot, SQLite
#: databases, SQL dumps) and logs.
NOT_SOURCE_SUFFIXES = (".rdb", ".sqlite3", ".db", ".dump", ".log")
#: The largest tracked file outside the folders allowed to hold large files.
MAX_TRACKED_BYTES = 1_000_000
LARGE_FILES_ALLOWED_UNDER = ("docs/screenshots/",)


def top_level_import_names(root: Path) -> set[str]:
    """Packages (folders with ``__init__.py``) and modules (``*.py``) directly under ``root``."""
    names = set()
    for entry in root.iterdir():
        if entry.name in NOT_IMPORTABLE:
            continue
        if entry.is_dir() and (entry / "__init__.py").exists():
            names.add(entry.name)
        elif entry.is_file() and entry.suffix == ".py":
            names.add(entry.stem)
    return names


def test_import_platform_from_the_repo_root_is_the_standard_library() -> None:
    probe = (
        "import json, platform; "
        "print(json.dumps({'file': platform.__file__, 'system': platform.system()}))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    found = json.loads(completed.stdout)
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(found["file"]).resolve().parent == stdlib
    assert Path(found["file"]).resolve().is_relative_to(Path(sys.base_prefix).resolve())
    assert found["system"]  # e.g. "Linux"


def test_manage_py_sees_the_standard_library_platform() -> None:
    # manage.py puts the repo root first on sys.path; the stdlib module must still win.
    completed = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", "import platform; print(platform.system())"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    # (`shell` may print a line about auto-imports before the command's own output.)
    assert (
        completed.stdout.strip().splitlines()[-1]
        == subprocess.run(
            [sys.executable, "-c", "import platform; print(platform.system())"],
            cwd="/",
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )


@pytest.mark.parametrize("root", IMPORT_ROOTS, ids=lambda root: str(root.relative_to(REPO_ROOT)))
def test_no_top_level_name_shadows_the_standard_library(root: Path) -> None:
    clashes = top_level_import_names(root) & sys.stdlib_module_names
    assert not clashes, f"{root} has top-level import names of stdlib modules: {sorted(clashes)}"


def test_the_checker_would_catch_a_package_named_platform(tmp_path: Path) -> None:
    (tmp_path / "platform").mkdir()
    (tmp_path / "platform" / "__init__.py").write_text("")
    (tmp_path / "site.py").write_text("")
    assert top_level_import_names(tmp_path) & sys.stdlib_module_names == {"platform", "site"}


@pytest.mark.parametrize("name", DESIGN_CARD)
def test_the_design_card_layout_exists(name: str) -> None:
    assert (REPO_ROOT / name).exists(), f"{name} is missing from the repository root"


def test_platform_is_a_plain_folder_of_build_and_process_files() -> None:
    platform_dir = REPO_ROOT / "platform"
    assert not list(platform_dir.rglob("__init__.py")), "platform/ must never become a package"
    assert (platform_dir / "Dockerfile").is_file()
    assert (platform_dir / "gunicorn.conf.py").is_file()


def test_the_django_configuration_package_is_config() -> None:
    from django.conf import settings

    assert settings.ROOT_URLCONF == "config.urls"
    assert settings.WSGI_APPLICATION == "config.wsgi.application"


def test_the_readme_sets_up_with_exactly_two_commands() -> None:
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Set up", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["./scripts/demo", "./scripts/test"]
    for line in block.splitlines():
        assert "#" in line, f"set-up command without its one-line explanation: {line!r}"
    for command in commands:
        script = REPO_ROOT / command
        assert script.is_file() and os.access(script, os.X_OK), f"{command} is not executable"


def _private_modules(package: str) -> set[str]:
    """Dotted names of the modules under ``agent/<package>/src`` whose name starts with "_"."""
    src = REPO_ROOT / "agent" / package / "src"
    return {
        ".".join(path.relative_to(src).with_suffix("").parts)
        for path in (src / package).rglob("_*.py")
        if not path.name.startswith("__")
    }


def _forbidden_contract(name: str) -> list[str]:
    import tomllib

    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"] == name]
    assert contract["type"] == "forbidden"
    return list(contract["forbidden_modules"])


@pytest.mark.parametrize(
    ("package", "contract"),
    [
        ("zkdv", "Nothing outside zkdv imports a private zkdv module"),
        ("dvbench", "Nothing outside dvbench imports a private dvbench module"),
    ],
)
def test_the_import_contracts_name_every_private_module(package: str, contract: str) -> None:
    """import-linter matches whole names, so each private module is listed; none is missed."""
    listed = _forbidden_contract(contract)
    assert listed == sorted(listed)
    assert set(listed) == _private_modules(package)


#: The packages whose private names the benches and other packages' tests may not use
#: (import-linter's contracts catch a private module; this catches a private name in a
#: public one too).
OTHER_PACKAGES = frozenset({"zkdv", "dvbench", "provers", "attestations", "config", "demo"})


#: Underscore names that their framework documents as public, not private: Django's
#: Model ``_meta`` API, and a named tuple's ``_asdict``, ``_fields``, ``_make``, ``_replace``.
PUBLIC_UNDERSCORE_NAMES = frozenset({"_meta", "_asdict", "_fields", "_make", "_replace"})


def _private(name: str) -> bool:
    return (
        name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE_NAMES
    )


def private_names_used(name: str, source: str, own: frozenset[str] = frozenset()) -> list[str]:
    """``file:line name`` of each private name of ``OTHER_PACKAGES`` but ``own`` that
    ``source`` uses: ``import zkdv._numba``, ``from zkdv.jax import _nnx``, ``from
    zkdv.probes import _gemm``, an underscore attribute read off a name imported from
    them (``batch_module._kernel``, ``ZKDV._check_continuity``, ``zkdv.jax._driver``), one
    named by a string beside such a name (``monkeypatch.setattr(batch_module, "_kernel",
    f)``, ``getattr(ZKDV, "_seal")``) or a dotted string (``mock.patch("zkdv.jax._x.f")``,
    ``importlib.import_module("zkdv._numba")``)."""
    packages = OTHER_PACKAGES - own
    tree = ast.parse(source)
    found: list[str] = []
    imported: dict[str, str] = {}  # local name -> dotted name it was imported as

    def flag(line: int, dotted: str) -> None:
        found.append(f"{name}:{line} {dotted}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in packages:
                    if any(_private(part) for part in alias.name.split(".")):
                        flag(node.lineno, alias.name)
                    local = alias.asname or alias.name.split(".")[0]
                    imported[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] not in packages:
                continue
            if any(_private(part) for part in node.module.split(".")):
                flag(node.lineno, node.module)
                continue
            for alias in node.names:
                if _private(alias.name):
                    flag(node.lineno, f"{node.module}.{alias.name}")
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def public_chain(value: ast.expr) -> list[str] | None:
        """The dotted name ``value`` reads off an imported name, through public names."""
        chain: list[str] = []
        while isinstance(value, ast.Attribute) and not _private(value.attr):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in imported:
            return [imported[value.id], *reversed(chain)]
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if (chain := public_chain(node.value)) is not None:
                flag(node.lineno, ".".join([*chain, node.attr]))
        elif isinstance(node, ast.Call) and len(node.args) >= 2:
            target, attribute = node.args[:2]
            if (
                isinstance(attribute, ast.Constant)
                and isinstance(attribute.value, str)
                and _private(attribute.value)
                and (chain := public_chain(target)) is not None
            ):
                flag(node.lineno, ".".join([*chain, attribute.value]))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            parts = node.value.split(".")
            if (
                len(parts) > 1
                and parts[0] in packages
                and all(part.isidentifier() for part in parts)
                and any(_private(part) for part in parts)
            ):
                flag(node.lineno, node.value)
    return sorted(found, key=lambda f: int(f.split(":")[1].split()[0]))


def test_no_bench_uses_a_private_name_of_another_package() -> None:
    """Issue 57: benches use public or internal APIs only (a package's public-named
    module for what others need, as ``zkdv.torch.replay``), never its private names."""
    found = [
        hit
        for path in sorted((REPO_ROOT / "bench").glob("*.py"))
        for hit in private_names_used(path.name, path.read_text(encoding="utf-8"))
    ]
    assert not found, "private names used by the benches:\n" + "\n".join(found)


#: The test folders of the packages, each the packages whose private units its tests may
#: test (zkdv's subpackages are one package; the server's tests test its settings too).
#: A test anywhere else (tests/, tests/reliability, tests/seeds) tests no package's
#: private units.
TEST_FOLDERS = {
    ("agent", "zkdv"): frozenset({"zkdv"}),
    ("agent", "dvbench"): frozenset({"dvbench"}),
    ("provers",): frozenset({"provers"}),
    ("attestations",): frozenset({"attestations", "config"}),
}


def owning_packages(path: Path) -> frozenset[str]:
    """The packages whose test folder holds ``path`` (a file under tests/), if any."""
    parts = path.relative_to(REPO_ROOT / "tests").parts
    for folder, packages in TEST_FOLDERS.items():
        if parts[: len(folder)] == folder:
            return packages
    return frozenset()


def private_names_used_by_tests() -> list[str]:
    """``file:line name`` of each private name of another package that a test (or a test
    helper) under tests/ uses."""
    return [
        hit
        for path in sorted((REPO_ROOT / "tests").rglob("*.py"))
        for hit in private_names_used(
            path.relative_to(REPO_ROOT).as_posix(),
            path.read_text(encoding="utf-8"),
            owning_packages(path),
        )
    ]


def test_no_test_uses_a_private_name_of_another_package() -> None:
    """Issue 57: tests use another package's public or internal APIs only, as the
    benches do; a test of a private unit sits in its own package's test folder
    (:data:`TEST_FOLDERS`)."""
    found = private_names_used_by_tests()
    assert not found, "private names of another package used by tests:\n" + "\n".join(found)


def test_the_bench_check_would_catch_each_way_of_reaching_a_private_name() -> None:
    source = """
import zkdv._numba
import zkdv.jax
from zkdv.jax import _nnx
from zkdv.torch._capture import current_capture
from zkdv.probes import ProbeSet, _gemm
from zkdv import batch as batch_module
from provers import torch_replay
import numpy as np
batch_module._kernel()
ProbeSet._last_post
zkdv.jax._driver.ZKDV
np._private
torch_replay.__name__
batch_module.JIT_ENV
"""
    assert private_names_used("x.py", source) == [
        "x.py:2 zkdv._numba",
        "x.py:4 zkdv.jax._nnx",
        "x.py:5 zkdv.torch._capture",
        "x.py:6 zkdv.probes._gemm",
        "x.py:10 zkdv.batch._kernel",
        "x.py:11 zkdv.probes.ProbeSet._last_post",
        "x.py:12 zkdv.jax._driver",
    ]


def test_the_check_catches_a_private_name_in_a_patch_and_spares_the_own_package() -> None:
    source = """
import importlib
from attestations.accounts.models import ApiKey
from zkdv import environments
from zkdv.torch import forgery
monkeypatch.setattr(environments, "_BACKEND_KINDS", {})
getattr(forgery, "scaled_flops")
mock.patch("zkdv.jax._export.kind_of_backend")
importlib.import_module("dvbench._cli")
"see zkdv.jax._export for why"
ApiKey._meta.concrete_fields
"""
    assert private_names_used("x.py", source) == [
        "x.py:6 zkdv.environments._BACKEND_KINDS",
        "x.py:8 zkdv.jax._export.kind_of_backend",
        "x.py:9 dvbench._cli",
    ]
    assert private_names_used("x.py", source, own=frozenset({"zkdv"})) == ["x.py:9 dvbench._cli"]
    assert owning_packages(REPO_ROOT / "tests/agent/zkdv/jax/test_tpu.py") == {"zkdv"}
    assert owning_packages(REPO_ROOT / "tests/attestations/api/test_x.py") == {
        "attestations",
        "config",
    }
    assert owning_packages(REPO_ROOT / "tests/test_demo_flow.py") == frozenset()


def _import_circles(package: str) -> list[set[str]]:
    """The import circles inside ``package`` (strongly connected modules), counted on
    import-linter's graph, so imports under ``TYPE_CHECKING`` or inside functions count.
    A module importing its own parent package (``from zkdv.jax import _messages``) is
    not an edge: the parent is where the name is looked up, not what it depends on."""
    graph = grimp.build_graph(package, include_external_packages=False)
    edges = {
        m: {t for t in graph.find_modules_directly_imported_by(m) if not m.startswith(t + ".")}
        for m in graph.modules
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component: set[str] = set()
            while True:
                top = stack.pop()
                component.add(top)
                if top == v:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_the_agent_has_no_import_circle() -> None:
    """Issue 57 counted six circles through 24 files; the layers contracts keep each
    package's order, and this keeps the rest of the agent free of circles too."""
    circles = [sorted(c) for package in ("zkdv", "dvbench") for c in _import_circles(package)]
    assert circles == []


def test_the_circle_count_would_catch_a_hidden_back_edge(tmp_path: Path) -> None:
    package = tmp_path / "loop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from loop import b\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from loop import a\n"
    )
    (package / "c.py").write_text("import loop\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert _import_circles("loop") == [{"loop.a", "loop.b"}]
    finally:
        sys.path.remove(str(tmp_path))


def test_the_driver_runtime_is_one_package_and_each_frontend_holds_its_driver() -> None:
    zkdv = REPO_ROOT / "agent" / "zkdv" / "src" / "zkdv"
    runtime = {path.name for path in (zkdv / "driver").glob("*.py")}
    assert {"base.py", "protocol.py", "flowcontrol.py", "control.py"} <= runtime
    assert (zkdv / "jax" / "_driver.py").exists() and (zkdv / "torch" / "_driver.py").exists()
    # No module names a frontend's driver inside the runtime: each lives under one name.
    assert not {"jax.py", "torch.py"} & runtime
    # zkdv.control, zkdv.flowcontrol and zkdv.pipeline are where the seeds' core reference
    # puts them (released API, STYLE.md rule 25): each only re-exports its runtime module.
    # (zkdv.pipeline's PendingUpdate is a contract's value: zkdv.driver.protocol holds it.)
    for alias, module in (("pipeline", "protocol"), ("flowcontrol", None), ("control", None)):
        tree = ast.parse((zkdv / f"{alias}.py").read_text())
        imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
        source = f"zkdv.driver.{module or alias}"
        assert {node.module for node in imports} == {"__future__", source}
        assert all(
            isinstance(node, ast.ImportFrom | ast.Assign | ast.Expr) for node in tree.body
        ), f"zkdv/{alias}.py holds code: it only re-exports {source}"


def unwanted_tracked_files(sizes: dict[str, int]) -> list[str]:
    """The tracked paths (``{path: bytes}``) that are dumps, logs or too large, with why."""
    found = []
    for path, size in sorted(sizes.items()):
        if path.lower().endswith(NOT_SOURCE_SUFFIXES):
            found.append(f"{path}: a database dump or log")
        elif size > MAX_TRACKED_BYTES and not path.startswith(LARGE_FILES_ALLOWED_UNDER):
            found.append(f"{path}: {size} bytes, over {MAX_TRACKED_BYTES}")
    return found


def _tracked_file_sizes() -> dict[str, int]:
    """``git ls-files`` with each file's size in the working tree (0 if deleted there)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True
        ).stdout
    except OSError as error:
        pytest.skip(f"no git to list the tracked files: {error}")
    except subprocess.CalledProcessError as error:
        reason = error.stderr.decode(errors="replace").strip()
        pytest.skip(f"not a git checkout, no tracked files to check: {reason}")
    sizes = {}
    for name in listed.decode().split("\0"):
        if name:
            path = REPO_ROOT / name
            sizes[name] = path.lstat().st_size if path.is_file() else 0
    return sizes


def test_no_tracked_file_is_a_dump_a_log_or_over_a_megabyte() -> None:
    unwanted = unwanted_tracked_files(_tracked_file_sizes())
    assert not unwanted, (
        "tracked files that do not belong in the repository (git rm --cached them; "
        "large files only under docs/screenshots/):\n" + "\n".join(unwanted)
    )


def test_the_tracked_file_check_would_catch_dumps_logs_and_large_files() -> None:
    big = MAX_TRACKED_BYTES + 1
    sizes = {
        "dump.rdb": 85_000,
        "db.sqlite3": 0,
        "data/cache.db": 10,
        "backup.dump": 10,
        "logs/worker.log": 10,
        "bench/results.json": big,
        "docs/screenshots/01-home.png": big,
        "attestations/models.py": MAX_TRACKED_BYTES,
    }
    assert [line.split(":")[0] for line in unwanted_tracked_files(sizes)] == [
        "backup.dump",
        "bench/results.json",
        "data/cache.db",
        "db.sqlite3",
        "dump.rdb",
        "logs/worker.log",
    ]


#: Issue 30's limits on source outside tests and benches: split by what the code does.
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
#: Where the limits do not apply: tests, benches, and generated migrations.
SIZE_EXEMPT = ("tests/", "bench/")


def oversized_source(sources: dict[str, str]) -> list[str]:
    """Modules over :data:`MAX_MODULE_LINES` lines and functions over
    :data:`MAX_FUNCTION_LINES` (``def`` to the end), by path."""
    found = []
    for path, text in sorted(sources.items()):
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            found.append(f"{path}: {lines} lines, over {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(text, filename=path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_module_or_function_is_too_long_to_read() -> None:
    sources = {
        path: (REPO_ROOT / path).read_text()
        for path in _tracked_file_sizes()
        if path.endswith(".py")
        and not path.startswith(SIZE_EXEMPT)
        and "/migrations/" not in path
        and (REPO_ROOT / path).is_file()
    }
    assert sources, "no tracked Python source found"
    oversized = oversized_source(sources)
    assert not oversized, "split these by what they do:\n" + "\n".join(oversized)


def test_the_size_check_would_catch_a_long_module_and_a_long_function() -> None:
    long_function = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    long_module = "x = 1\n" * (MAX_MODULE_LINES + 1)
    found = oversized_source({"a.py": long_function, "b.py": long_module, "c.py": "y = 2\n"})
    assert [line.split(":")[0] for line in found] == ["a.py", "b.py"]
