"""The agent ships as two distributions, zkdv and dvbench, that install without the server
stack; zkdv installs and verifies a transcript without dvbench's client dependencies or any
framework; the extras resolve as documented; the lock pins every install.

The wheel tests build both wheels from a copy of agent/, install them into a fresh virtual
environment with pip offline (dependencies re-packed from this environment's installed
distributions), and resolve every extra with ``pip install --dry-run`` against the
metadata of the installed, locked versions.
"""

from __future__ import annotations

import ast
import base64
import email.parser
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT = REPO_ROOT / "agent"
DISTRIBUTIONS = ("zkdv", "dvbench")
SERVER_ONLY = {"django", "celery", "psycopg", "psycopg-binary", "gunicorn", "redis", "kombu"}
HEAVY = ("jax", "jaxlib", "flax", "optax", "torch", "django", "celery", "psycopg", "kombu")
FRAMEWORKS = {
    *("jax", "jaxlib", "flax", "optax", "torch", "transformers"),
    *("accelerate", "peft", "lightning"),
}
CLIENT_ONLY = {"httpx", "cryptography"}
EXTRAS = ("jax", "torch", "hf", "peft", "lightning", "jit")
# Imported by zkdv.torch only inside ``try: ... except ImportError`` (bfloat16 arrays when
# JAX's ml_dtypes happens to be installed); never required, so not declared.
OPTIONAL_IMPORTS = {"zkdv": {"ml_dtypes"}, "dvbench": set()}


def load_toml(path: Path) -> dict:
    with path.open("rb") as handle:
        return tomllib.load(handle)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project(name: str) -> dict:
    """``[project]`` of agent/<name>/pyproject.toml."""
    return dict(load_toml(AGENT / name / "pyproject.toml")["project"])


def requirements(table: dict, *, extras: bool = True) -> list[Requirement]:
    declared = list(table["dependencies"])
    if extras:
        for group in table.get("optional-dependencies", {}).values():
            declared += group
    return [Requirement(item) for item in declared]


def lock() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"constraints.txt line {line!r} is not pinned with =="
        pins[canonical(name)] = version
    return pins


def sources(name: str) -> Path:
    """The src folder of distribution ``name`` (``agent/<name>/src``)."""
    return AGENT / name / "src"


def package_version(name: str) -> str:
    """``__version__`` of agent/<name>/src/<name>, read without importing it."""
    tree = ast.parse((sources(name) / name / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__version__" for target in node.targets
        ):
            return str(ast.literal_eval(node.value))
    raise AssertionError(f"agent/{name}/src/{name}/__init__.py sets no __version__")


def modules_loaded_by(statement: str) -> list[str]:
    probe = (
        f"import json, sys; {statement}; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    completed = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    return list(json.loads(completed.stdout))


# --- What the sources and the project files declare ------------------------------------


@pytest.mark.parametrize("statement", ["import zkdv", "import dvbench", "import zkdv, dvbench"])
def test_importing_the_sdk_loads_no_framework_and_no_server_stack(statement: str) -> None:
    assert modules_loaded_by(statement) == []


def test_the_framework_frontends_load_lazily() -> None:
    # zkdv.jax / zkdv.torch are reached through the package's module __getattr__ (PEP 562).
    import zkdv

    assert "jax" in dir(zkdv)
    assert "torch" in dir(zkdv)


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_the_sdk_declares_no_server_dependency(name: str) -> None:
    names = {canonical(item.name) for item in requirements(project(name))}
    assert not names & SERVER_ONLY


def test_zkdv_depends_on_neither_the_client_nor_a_framework() -> None:
    zkdv = project("zkdv")
    core = {canonical(item.name) for item in requirements(zkdv, extras=False)}
    assert core == {"numpy", "blake3", "cbor2"}
    everything = {canonical(item.name) for item in requirements(zkdv)}
    assert not everything & (CLIENT_ONLY | {"dvbench"})


def test_the_zkdv_extras_are_the_frameworks() -> None:
    extras = project("zkdv")["optional-dependencies"]
    assert set(extras) == set(EXTRAS)
    assert {canonical(Requirement(item).name) for item in extras["jax"]} == {
        "jax",
        "jaxlib",
        "flax",
        "optax",
        "flatbuffers",
    }
    assert [str(Requirement(item)) for item in extras["torch"]] == ["torch==2.13.0"]
    assert {str(Requirement(item)) for item in extras["hf"]} == {
        "torch==2.13.0",
        "transformers>=5.0",
        "accelerate>=1.10",
    }
    assert {str(Requirement(item)) for item in extras["peft"]} == {"zkdv[hf]", "peft>=0.17"}
    assert {str(Requirement(item)) for item in extras["lightning"]} == {
        "torch==2.13.0",
        "lightning>=2.5",
    }
    assert {str(Requirement(item)) for item in extras["jit"]} == {"numba>=0.68"}


def test_dvbench_pins_its_zkdv_and_forwards_every_zkdv_extra() -> None:
    zkdv = project("zkdv")
    dvbench = project("dvbench")
    core = {canonical(item.name): item for item in requirements(dvbench, extras=False)}
    assert str(core["zkdv"].specifier) == f"=={zkdv['version']}"
    assert not core["zkdv"].extras
    assert not set(core) & FRAMEWORKS  # a framework comes only with an extra
    own = dvbench.get("optional-dependencies", {})
    for extra in zkdv["optional-dependencies"]:
        forwarded = [Requirement(item) for item in own.get(extra, [])]
        assert [(canonical(item.name), item.extras, str(item.specifier)) for item in forwarded] == [
            ("zkdv", {extra}, f"=={zkdv['version']}")
        ], f"dvbench[{extra}] must be exactly zkdv[{extra}]=={zkdv['version']}"


def test_the_versions_agree() -> None:
    # The distributions' versions are the packages' __version__, and the platform pins the
    # dvbench it is released with (no index can substitute another distribution of the name).
    for name in DISTRIBUTIONS:
        assert project(name)["version"] == package_version(name), name
    platform = load_toml(REPO_ROOT / "pyproject.toml")["project"]
    pinned = {canonical(Requirement(item).name): item for item in platform["dependencies"]}
    assert pinned["dvbench"] == f"dvbench=={project('dvbench')['version']}"


def imported_modules(package: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    yield alias.name.split(".")[0], path
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                yield node.module.split(".")[0], path


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_each_distribution_imports_only_what_it_declares(name: str) -> None:
    # zkdv must not reach for dvbench's httpx or cryptography (or dvbench itself): an
    # install of zkdv alone would fail where such an import runs.
    providers = metadata.packages_distributions()
    declared = {canonical(item.name) for item in requirements(project(name))}
    if name == "dvbench":  # what zkdv brings, with the extras dvbench forwards
        declared |= {canonical(item.name) for item in requirements(project("zkdv"))}
    own = {"zkdv"} if name == "zkdv" else {"zkdv", "dvbench"}
    undeclared = {}
    for module, path in imported_modules(sources(name) / name):
        if module in sys.stdlib_module_names or module in own | OPTIONAL_IMPORTS[name]:
            continue
        distributions = {canonical(dist) for dist in providers.get(module, [module])}
        if not distributions & declared:
            undeclared.setdefault(module, str(path.relative_to(REPO_ROOT)))
    assert not undeclared, f"agent/{name}/pyproject.toml does not declare: {undeclared}"


def test_the_lock_pins_every_declared_dependency() -> None:
    pins = lock()
    declared = requirements(load_toml(REPO_ROOT / "pyproject.toml")["project"])
    for name in DISTRIBUTIONS:
        declared += requirements(project(name))
    ours = {"zkdv", "dvbench"}  # installed from this repository, editable
    unpinned = sorted({canonical(item.name) for item in declared} - set(pins) - ours)
    assert not unpinned, f"add to the lock with ./scripts/lock: {unpinned}"


def test_the_lock_pins_torch_to_the_cpu_build() -> None:
    assert lock()["torch"] == "2.13.0+cpu"


def test_the_environment_matches_the_lock() -> None:
    pins = lock()
    drift = {}
    for name, version in pins.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "(not installed)"
        if installed != version:
            drift[name] = f"locked {version}, installed {installed}"
    assert not drift, f"run ./scripts/bootstrap (or ./scripts/lock after a change): {drift}"


def test_bootstrap_installs_both_distributions_through_the_lock() -> None:
    script = (REPO_ROOT / "scripts" / "bootstrap").read_text()
    assert "-c constraints.txt" in script
    assert "-e './agent/zkdv[jax,torch,hf,peft,lightning,jit]'" in script
    assert "-e './agent/dvbench[jax,torch,hf,peft,lightning,jit,signing,examples]'" in script
    # The stamp must change when either agent project does.
    assert "agent/zkdv/pyproject.toml agent/dvbench/pyproject.toml" in script


# --- Wheels, built and installed offline -----------------------------------------------


def pip_environment() -> dict[str, str]:
    """pip without this machine's configuration (indexes, find-links, constraints, cache),
    and Python without PYTHONPATH (the tests put agent/*/src on it, which would hide what a
    fresh environment really installed)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PIP_")}
    env.pop("PYTHONPATH", None)
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PIP_NO_CACHE_DIR="1",
    )
    return env


def run(command: list[str | Path], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    completed = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=pip_environment(),
        capture_output=True,
        text=True,
        **kwargs,  # type: ignore[call-overload]
    )
    assert completed.returncode == 0, (
        f"{' '.join(map(str, command))} exited {completed.returncode}:\n"
        f"{completed.stdout}\n{completed.stderr}"
    )
    return completed


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def compressed_tag(wheel_file: str) -> str:
    tags = [
        line.split(":", 1)[1].strip() for line in wheel_file.splitlines() if line.startswith("Tag:")
    ]
    parts = zip(*(tag.split("-") for tag in tags), strict=True)
    return "-".join(".".join(sorted(set(part))) for part in parts)


def repack(dist: metadata.Distribution, into: Path, *, metadata_only: bool) -> Path:
    """A wheel of an installed distribution, from its RECORD: the files it installed into
    site-packages (console scripts are regenerated by pip from entry_points.txt), or only
    its METADATA and WHEEL for a resolver that reads nothing else."""
    info = Path(str(dist._path))  # type: ignore[attr-defined]
    wheel_file = (info / "WHEEL").read_text()
    site = info.parent
    skip = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}
    if metadata_only:
        names = [f"{info.name}/METADATA", f"{info.name}/WHEEL"]
    else:
        names = []
        for file in dist.files or ():
            name = file.as_posix()
            if name.startswith("../") or "__pycache__" in file.parts:
                continue
            if file.parts[0] == info.name and file.name in skip:
                continue
            if (site / name).is_file():
                names.append(name)
    project_name = re.sub(r"[^\w.]+", "_", dist.metadata["Name"])
    target = into / f"{project_name}-{dist.version}-{compressed_tag(wheel_file)}.whl"
    record = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
        for name in names:
            data = (site / name).read_bytes()
            archive.writestr(name, data)
            record.append(f"{name},{record_hash(data)},{len(data)}")
        record.append(f"{info.name}/RECORD,,")
        archive.writestr(f"{info.name}/RECORD", "\n".join(record) + "\n")
    return target


def installed_closure(roots: Iterable[Requirement]) -> list[metadata.Distribution]:
    """The installed distributions that ``roots`` need on this platform, extras included."""
    found: dict[str, metadata.Distribution] = {}
    pending = list(roots)
    while pending:
        requirement = pending.pop()
        name = canonical(requirement.name)
        if name in DISTRIBUTIONS or name in found:
            continue
        dist = metadata.distribution(name)
        found[name] = dist
        for item in dist.requires or ():
            nested = Requirement(item)
            wanted = {""} | requirement.extras
            if nested.marker is None or any(nested.marker.evaluate({"extra": e}) for e in wanted):
                pending.append(nested)
    return list(found.values())


def names(distributions: Iterable[metadata.Distribution]) -> set[str]:
    return {canonical(dist.metadata["Name"]) for dist in distributions}


@pytest.fixture(scope="module")
def built_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    setuptools = metadata.version("setuptools")
    assert Version(setuptools) >= Version("77"), f"setuptools {setuptools}: run ./scripts/bootstrap"
    work = tmp_path_factory.mktemp("build")
    # Built from a copy: an in-tree build leaves build/ and *.egg-info in the checkout, and
    # a build/lib left over from an earlier build would carry deleted modules into the wheel.
    shutil.copytree(
        AGENT, work / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    )
    out = work / "wheels"
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    projects = [work / "agent" / name for name in DISTRIBUTIONS]
    run([*pip_wheel, "--no-index", "--wheel-dir", out, *projects], cwd=work)
    wheels = {name: next(out.glob(f"{name}-*.whl")) for name in DISTRIBUTIONS}
    assert len(list(out.iterdir())) == 2
    return wheels


@pytest.mark.slow
def test_each_wheel_holds_its_own_package_and_nothing_else(built_wheels: dict[str, Path]) -> None:
    for name, wheel in built_wheels.items():
        info = f"{name}-{project(name)['version']}.dist-info"
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
        assert {entry.split("/")[0] for entry in names} == {name, info}
        expected = {
            path.relative_to(sources(name)).as_posix()
            for path in (sources(name) / name).rglob("*")
            if path.suffix == ".py" or path.name == "py.typed"
        }
        packaged = {entry for entry in names if not entry.startswith(f"{info}/")}
        assert packaged == expected, name


@pytest.mark.slow
def test_each_wheel_declares_what_its_project_does(built_wheels: dict[str, Path]) -> None:
    scripts = {"zkdv": "zkdv = zkdv.__main__:main", "dvbench": "dvbench = dvbench._cli:main"}
    for name, wheel in built_wheels.items():
        table = project(name)
        info = f"{name}-{table['version']}.dist-info"
        with zipfile.ZipFile(wheel) as archive:
            fields = email.parser.Parser().parsestr(archive.read(f"{info}/METADATA").decode())
            entry_points = archive.read(f"{info}/entry_points.txt").decode()
        assert (fields["Name"], fields["Version"]) == (name, table["version"])
        assert fields["License-Expression"] == "Apache-2.0"
        assert set(fields.get_all("Provides-Extra")) == set(table["optional-dependencies"])
        declared = {str(item) for item in requirements(table, extras=False)}
        for extra, group in table["optional-dependencies"].items():
            declared |= {f'{Requirement(item)}; extra == "{extra}"' for item in group}
        assert set(fields.get_all("Requires-Dist")) == declared
        assert scripts[name] in entry_points.splitlines()


@pytest.mark.slow
def test_the_wheels_install_offline_into_a_fresh_environment(
    built_wheels: dict[str, Path], tmp_path: Path
) -> None:
    # A wheelhouse: the two wheels and, re-packed from this environment, the locked
    # versions of what they need without extras.
    house = tmp_path / "wheelhouse"
    house.mkdir()
    for wheel in built_wheels.values():
        shutil.copy(wheel, house)
    roots = requirements(project("zkdv"), extras=False) + requirements(
        project("dvbench"), extras=False
    )
    for dist in installed_closure(roots):
        repack(dist, house, metadata_only=False)
    venv.EnvBuilder(with_pip=True).create(tmp_path / "env")
    python = tmp_path / "env" / "bin" / "python"
    install = [python, "-m", "pip", "install", "--no-index", "--find-links", house]

    def installed() -> set[str]:
        listing = run([python, "-m", "pip", "list", "--format=json"], cwd=tmp_path).stdout
        return {canonical(item["name"]) for item in json.loads(listing)} - {"pip", "setuptools"}

    # pip install zkdv: the library and what numpy, blake3 and cbor2 need, nothing else ...
    run([*install, "zkdv"], cwd=tmp_path)
    assert installed() == {"zkdv"} | names(
        installed_closure(requirements(project("zkdv"), extras=False))
    )
    # ... which writes a real transcript (numpy, through ZKDVCore; the test helper is loaded
    # from its file, so the repository's other modules stay out of the environment) and
    # verifies it offline with the installed `zkdv` command, loading no framework and no
    # client library.
    probe = (
        "import importlib, importlib.util, json, sys\n"
        "import zkdv\n"
        "spec = importlib.util.spec_from_file_location('synthetic', sys.argv[2])\n"
        "synthetic = importlib.util.module_from_spec(spec)\n"
        "sys.modules['synthetic'] = synthetic\n"
        "spec.loader.exec_module(synthetic)\n"
        "synthetic.write_synthetic_transcript(sys.argv[1], steps=4)\n"
        "missing = {}\n"
        "for name in ('zkdv.jax', 'zkdv.torch', 'dvbench'):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as error:\n"
        "        missing[name] = error.name\n"
        f"heavy = {sorted(set(HEAVY) | CLIENT_ONLY)!r}\n"
        "print(json.dumps({'file': zkdv.__file__, 'missing': missing,\n"
        "                  'loaded': [m for m in heavy if m in sys.modules]}))\n"
    )
    helper = REPO_ROOT / "tests" / "synthetic.py"
    found = json.loads(run([python, "-c", probe, tmp_path / "proof", helper], cwd=tmp_path).stdout)
    assert Path(found["file"]).is_relative_to(tmp_path / "env"), found["file"]
    assert found["missing"] == {"zkdv.jax": "jax", "zkdv.torch": "torch", "dvbench": "dvbench"}
    assert found["loaded"] == []
    zkdv_command = tmp_path / "env" / "bin" / "zkdv"
    run([zkdv_command, "verify", tmp_path / "proof"], cwd=tmp_path)
    records = tmp_path / "proof" / "records.cborl"
    tampered = bytearray(records.read_bytes())
    tampered[len(tampered) // 2] ^= 0x01
    records.write_bytes(bytes(tampered))
    rejected = subprocess.run(
        [str(zkdv_command), "verify", str(tmp_path / "proof")],
        cwd=tmp_path,
        env=pip_environment(),
        capture_output=True,
        text=True,
    )
    assert rejected.returncode == 1, rejected.stdout + rejected.stderr

    # pip install dvbench: the client on top, with the zkdv already there.
    run([*install, "dvbench"], cwd=tmp_path)
    assert installed() == {"zkdv", "dvbench"} | names(installed_closure(roots))
    run([python, "-m", "pip", "check"], cwd=tmp_path)
    loaded = run(
        [
            python,
            "-c",
            "import dvbench, dvbench.attest, json, sys; print(json.dumps(list(sys.modules)))",
        ],
        cwd=tmp_path,
    ).stdout
    assert not set(json.loads(loaded)) & set(HEAVY)
    usage = run([tmp_path / "env" / "bin" / "dvbench", "--help"], cwd=tmp_path).stdout
    assert "verify-report" in usage


@pytest.fixture(scope="module")
def resolve(
    built_wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], dict[str, str]]:
    """What ``pip install REQUIREMENT`` would install, through the lock: the two wheels and,
    for everything else, the metadata of this environment's (locked) distributions."""
    index = tmp_path_factory.mktemp("metadata")
    for dist in metadata.distributions():
        name = canonical(dist.metadata["Name"])
        if (
            name in {*DISTRIBUTIONS, "dvbench-platform"}
            or not (
                Path(str(dist._path)) / "WHEEL"  # type: ignore[attr-defined]
            ).is_file()
        ):
            continue
        repack(dist, index, metadata_only=True)

    def resolved(requirement: str) -> dict[str, str]:
        report = index / "report.json"
        dry_run = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed"]
        sources = ["--no-index", "--find-links", index, "--find-links", built_wheels["zkdv"].parent]
        lock_file = ["--constraint", REPO_ROOT / "constraints.txt"]
        run([*dry_run, "--quiet", *sources, *lock_file, "--report", report, requirement], cwd=index)
        items = json.loads(report.read_text())["install"]
        return {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in items}

    return resolved


@pytest.mark.slow
def test_every_extra_resolves_to_its_framework_and_only_to_it(
    resolve: Callable[[str], dict[str, str]],
) -> None:
    pins = lock()
    versions = {name: project(name)["version"] for name in DISTRIBUTIONS}
    plans = {
        requirement: resolve(requirement)
        for requirement in ["zkdv", "dvbench"]
        + [f"{name}[{extra}]" for name in DISTRIBUTIONS for extra in EXTRAS]
    }
    for requirement, plan in plans.items():
        for name, version in plan.items():
            assert version == versions.get(name, pins.get(name)), (requirement, name, version)
    assert set(plans["zkdv"]) == {"zkdv"} | names(
        installed_closure(requirements(project("zkdv"), extras=False))
    )
    assert set(plans["dvbench"]) >= {"dvbench", "zkdv"} | CLIENT_ONLY
    assert not set(plans["dvbench"]) & FRAMEWORKS
    wanted = {
        "jax": {"jax", "jaxlib", "flax", "optax", "flatbuffers"},
        "torch": {"torch"},
        "hf": {"torch", "transformers", "accelerate"},
        "peft": {"torch", "transformers", "accelerate", "peft"},
        "lightning": {"torch", "lightning"},
        "jit": {"numba", "llvmlite"},
    }
    for extra, frameworks in wanted.items():
        zkdv = set(plans[f"zkdv[{extra}]"])
        assert zkdv >= frameworks | {"zkdv"}, extra
        assert not zkdv & (FRAMEWORKS - frameworks), extra
        assert not zkdv & (CLIENT_ONLY | {"dvbench"}), extra
        # Forwarding: dvbench[extra] is zkdv[extra] plus the client, exactly.
        assert set(plans[f"dvbench[{extra}]"]) == zkdv | set(plans["dvbench"]), extra
    assert plans["zkdv[torch]"]["torch"] == "2.13.0+cpu"
