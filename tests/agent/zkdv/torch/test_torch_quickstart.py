"""The documented Torch quick start and the commented example run on this machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sources import AGENT_PYTHONPATH
from zkdv.verify import verify_transcript

REPO_ROOT = Path(__file__).resolve().parents[4]


def _quick_start() -> str:
    """The Torch quick start code block (README when it has one, else docs/torch.md)."""
    for document in (REPO_ROOT / "README.md", REPO_ROOT / "docs" / "torch.md"):
        text = document.read_text()
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            if "zkdv.torch.ZKDV" in block and "proof.transaction" in block:
                return block
    raise AssertionError("no Torch quick start found")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            AGENT_PYTHONPATH,
            env.get("PYTHONPATH", ""),
        ]
    )
    return env


@pytest.mark.slow
def test_quick_start_runs_on_cpu_with_the_device_changed(tmp_path: Path) -> None:
    code = _quick_start()
    assert ".cuda()" in code and 'device="cuda"' in code
    code = code.replace(".cuda()", ".cpu()").replace('device="cuda"', 'device="cpu"')
    script = tmp_path / "quick_start.py"
    script.write_text(code)
    env = _env()
    env.pop("ZKDV_TORCH_PROGRAM", None)  # the documented default: eager kernels
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert report.root["program"]["kind"] == "torch.export"
    assert report.root["prover"] == "whitebox-torch"


@pytest.mark.slow
def test_commented_example_runs(tmp_path: Path) -> None:
    env = _env()
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "torch" / "basic_training.py"), "proof"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = verify_transcript(tmp_path / "proof")
    assert report.ok, report.summary()
    assert report.checks >= 1
