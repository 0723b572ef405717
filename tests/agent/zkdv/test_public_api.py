"""What the API reference and the platform rely on is public, and where the docs say."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
API_DOCS = REPO_ROOT / "docs" / "api"


def _documented_members() -> list[tuple[str, str]]:
    """``(module, member)`` for every member a ``::: module`` block of docs/api lists."""
    out = []
    for page in sorted(API_DOCS.glob("*.md")):
        module = None
        in_members = False
        for line in page.read_text(encoding="utf-8").splitlines():
            directive = re.match(r"^::: ([\w.]+)$", line)
            if directive:
                module, in_members = directive.group(1), False
            elif line.strip() == "members:":
                in_members = True
            elif in_members and re.match(r"^\s+- \w+$", line):
                assert module is not None
                out.append((module, line.strip()[2:]))
            elif line and not line.startswith(" "):
                in_members = False
    return out


DOCUMENTED = _documented_members()


def test_the_api_reference_lists_members() -> None:
    assert ("zkdv", "ZKDVConfig") in DOCUMENTED and ("zkdv.torch", "ZKDV") in DOCUMENTED


@pytest.mark.parametrize(("module", "member"), DOCUMENTED)
def test_every_documented_member_is_exported(module: str, member: str) -> None:
    if module.startswith(("zkdv.jax", "zkdv.torch")):
        pytest.importorskip(module.split(".")[1])
    exported = importlib.import_module(module)
    assert member in exported.__all__, f"docs/api documents {module}.{member}"
    assert getattr(exported, member) is not None


@pytest.mark.parametrize(
    ("module", "names"),
    [
        # What provers/ and the server use (issue 20): public names, not private modules.
        ("zkdv.files", ["PROGRAM_FILES", "program_file", "TREES"]),
        ("dvbench", ["SPEC_SCHEMA", "spec_digest", "spec_document", "check_final_parameters"]),
        ("dvbench.attest", ["canonical_json", "format_time", "to_seconds"]),
        # The contracts between the shared driver and a frontend.
        ("zkdv.driver", ["Driver", "Runtime", "Submission", "PendingUpdate", "ReplayOutcome"]),
    ],
)
def test_what_the_platform_and_frontends_use_is_exported(module: str, names: list[str]) -> None:
    exported = importlib.import_module(module)
    for name in names:
        assert name in exported.__all__, f"{module}.{name}"


def test_the_torch_host_array_is_public() -> None:
    torch = pytest.importorskip("torch")
    import zkdv.torch

    assert "host_array" in zkdv.torch.__all__
    value = torch.arange(4, dtype=torch.bfloat16)
    assert zkdv.torch.host_array(value).view("uint16").tolist() == (
        value.view(torch.int16).numpy().view("uint16").tolist()
    )


def test_program_file_names_the_program_of_every_kind() -> None:
    from zkdv.files import program_file

    assert program_file("jax.export") == "program.jaxexport"
    assert program_file("aot-inductor") == "program.pt2"
    assert program_file("torch.export") == "program.bin"


def test_the_driver_satisfies_the_runtime_protocol(tmp_path: Path) -> None:
    """Every Runtime member exists on Driver.runtime, with the driver's state behind it."""
    import zkdv
    from zkdv.driver import Driver, Runtime

    driver = Driver(
        tmp_path, zkdv.ZKDVConfig(), backend="jax", max_in_flight=2, replay_snapshot_interval=3
    )
    runtime: Runtime = driver.runtime
    members = {name for name in vars(Runtime) if not name.startswith("_")}
    assert members <= set(dir(runtime))
    assert (runtime.core, runtime.closed, runtime.world_size, runtime.multi_process) == (
        None,
        False,
        1,
        False,
    )
    with pytest.raises(zkdv.ZKDVError, match="start"):
        runtime.check_started()
    driver.start(rolling_window=1)
    assert runtime.core is not None and runtime.snapshot_due(3) and not runtime.snapshot_due(4)
    driver.close()
    assert runtime.closed
