"""The SDK answers the platform's challenges: only the challenged files leave the lab.

A real zkdv.torch run (from ``tests/attestations/challenges/test_replay.py``) is synced to the live
platform with the default ``DVBENCH_UPLOAD_FILES=challenged``: the transcript, program
and probes go up, the platform draws its challenges (here with a low detection target,
so that some steps are not challenged), and the SDK sends the snapshot and batch files
those challenges name, and nothing else. The replays (run in-process) pass.
"""

from __future__ import annotations

import json
import shutil
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from dvbench import Client
from dvbench._manifest import MANIFEST
from dvbench._sync import sync_directory
from tests.attestations.challenges.test_replay import TORCH_SPEC, train_torch

NAME = "acme/torch-run"


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_torch(tmp_path_factory.mktemp("sdk-torch") / "run", "torch-run")


def test_sync_sends_only_the_challenged_files_and_the_proof_passes(
    platform: Any, torch_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    from attestations.challenges.models import Challenge
    from attestations.proofs.models import Proof
    from attestations.uploads.models import Blob

    monkeypatch.setenv("DVBENCH_UPLOAD_FILES", "challenged")
    settings.DVBENCH = {**settings.DVBENCH, "DETECTION_TARGET": 0.3}
    directory = Path(shutil.copytree(torch_run, tmp_path / "run"))
    with Client(platform.url, api_key=platform.key("alice")) as client:
        client.experiment(NAME, spec=TORCH_SPEC)
        result = sync_directory(client, directory, progress=False, experiment=NAME)
        assert result.complete and result.proof_id is not None, result.notes
        proof = client.wait_for_proof(result.proof_id, timeout=120, interval=0.2)
    assert proof["status"] == "valid", proof
    challenged = Challenge.objects.filter(proof_id=result.proof_id)
    needed = {name for c in challenged for name in c.needed_files}
    assert 0 < challenged.count() < 8  # the low target leaves some steps unchallenged
    local = {f"files/{p.name}" for p in (directory / "files").iterdir() if p.stat().st_size > 0}
    stored = set(Blob.objects.values_list("sha256", flat=True))
    sent = {name for name in local if sha256((directory / name).read_bytes()).hexdigest() in stored}
    # Exactly the challenged files left the lab, the rest never did. How many that
    # leaves behind depends on the platform's random draw: usually some, but a draw may
    # challenge the last step of every window, which needs every batch file.
    assert sent == {name for name in needed if name.startswith("files/")}
    assert result.challenged_files == len(needed)
    manifest = json.loads((directory / MANIFEST).read_text())
    assert manifest["synced"] and manifest["attached"] is True
    assert set(manifest["attached_files"]) == needed
    assert Proof.objects.get(pk=result.proof_id).artifacts.count() == len(needed)
    # Syncing again sends nothing and attaches nothing new.
    with Client(platform.url, api_key=platform.key("alice")) as client:
        again = sync_directory(client, directory, progress=False)
    assert again.bytes_sent == 0 and again.proof_id == result.proof_id
