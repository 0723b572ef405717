"""Issue 59: a lab's program never runs the lab's code on the platform, through the API.

The security round's exploits, each filed the way a lab that means harm would file it,
through the upload and challenge API with tasks run in-process (the embedded default,
where the task runs inside the web request):

* a whole-step Torch run whose committed ``torch.export`` program carries a pickled
  weight, an ``expr_str`` that calls ``os.system``, or a node calling a Python function;
* a whole-step Torch run that commits an AOT Inductor package (native code; marked
  ``aot``: one compile);
* a whole-step JAX run whose committed program names a foreign custom-call target;
* a sliced run whose block programs carry the pickle or the ``expr_str`` payload (the
  reproduction in the issue: upload, file, answer, open).

Every challenge fails with ``program_unsafe``, and the payload's marker file never
appears. The malicious programs are the project's own exports with members edited
(``tests/untrusted_programs.py``); the transcript commits them (re-chained by the lab).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import cbor2
from rest_framework.test import APIClient

from attestations.challenges.models import ChallengeStatus, SlicedRun, SliceStatus
from attestations.proofs.models import Proof, ProofStatus
from tests import untrusted_programs as payloads
from tests.attestations.challenges.test_replay import (
    ORG,
    answer,
    file_transcript,
    platform,  # noqa: F401 - a fixture
    train_jax,
    train_torch,
)

TORCH_PAYLOADS: dict[str, Callable[[bytes, Path], bytes]] = {
    "pickle": payloads.pickled_weight,
    "expr_str": payloads.evaluated_expression,
    "target": lambda archive, marker: payloads.foreign_target(archive),
}


@pytest.fixture(scope="module")
def honest_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("unsafe-runs")
    return {"torch": train_torch(base / "torch", "torch-run")}


def _file_forged(
    client: APIClient, run: Path, experiment: str, capture: Any
) -> tuple[Proof, list[tuple[str, str, str]]]:
    """File and answer a forged run; the proof and its challenges' outcomes."""
    with capture(execute=True):
        filed = file_transcript(client, run, experiment)
    assert filed.status_code == 200, filed.content
    proof = Proof.objects.get(pk=filed.json()["proof"])
    assert proof.status == ProofStatus.CHALLENGED, (proof.status, proof.reason, proof.message)
    with capture(execute=True):
        attached = answer(client, proof.pk, run, experiment)
    assert attached.status_code == 201, attached.content
    proof.refresh_from_db()
    outcomes = [(c.status, c.reason, c.message) for c in proof.challenges.order_by("step")]
    return proof, outcomes


@pytest.mark.parametrize("payload", sorted(TORCH_PAYLOADS))
def test_a_malicious_torch_program_is_refused_and_never_runs(
    payload: str,
    platform: APIClient,  # noqa: F811 - the fixture imported above
    honest_runs: dict[str, Path],
    django_capture_on_commit_callbacks: Any,
    tmp_path: Path,
) -> None:
    run = Path(shutil.copytree(honest_runs["torch"], tmp_path / "forged"))
    marker = tmp_path / "marker"
    honest = (run / "program.bin").read_bytes()
    payloads.forge_program(run, TORCH_PAYLOADS[payload](honest, marker))
    proof, outcomes = _file_forged(
        platform, run, f"{ORG}/torch-run", django_capture_on_commit_callbacks
    )
    assert outcomes, "no challenge was drawn"
    assert {(status, reason) for status, reason, _ in outcomes} == {
        (ChallengeStatus.FAILED, "program_unsafe")
    }
    assert "the torch.export program artifact" in outcomes[0][2]
    assert proof.status == ProofStatus.REJECTED, (proof.status, proof.reason)
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.aot
def test_an_aot_inductor_package_is_refused_as_native_code(
    platform: APIClient,  # noqa: F811 - the fixture imported above
    honest_runs: dict[str, Path],
    django_capture_on_commit_callbacks: Any,
    tmp_path: Path,
) -> None:
    run = Path(shutil.copytree(honest_runs["torch"], tmp_path / "aot"))
    (run / "program.bin").unlink()
    payloads.forge_program(run, payloads.aot_inductor_package(), kind="aot-inductor")
    proof, outcomes = _file_forged(
        platform, run, f"{ORG}/torch-run", django_capture_on_commit_callbacks
    )
    assert {(status, reason) for status, reason, _ in outcomes} == {
        (ChallengeStatus.FAILED, "program_unsafe")
    }
    assert "native code the platform never loads" in outcomes[0][2]
    assert proof.status == ProofStatus.REJECTED


def test_a_jax_program_with_a_foreign_custom_call_is_refused(
    platform: APIClient,  # noqa: F811 - the fixture imported above
    django_capture_on_commit_callbacks: Any,
    tmp_path: Path,
) -> None:
    pytest.importorskip("jax")
    run = train_jax(tmp_path / "jax", "jax-run")
    envelope = cbor2.loads((run / "program.jaxexport").read_bytes())
    assert "production" in envelope, "the run does not commit its gradients"
    envelope["production"] = bytes(payloads.jax_custom_call_program())
    payloads.forge_program(run, cbor2.dumps(envelope))
    proof, outcomes = _file_forged(
        platform, run, f"{ORG}/jax-run", django_capture_on_commit_callbacks
    )
    assert {(status, reason) for status, reason, _ in outcomes} == {
        (ChallengeStatus.FAILED, "program_unsafe")
    }
    assert "custom call target 'lab_payload'" in outcomes[0][2]
    assert proof.status == ProofStatus.REJECTED


# --- Sliced runs: the reproduction of the issue ----------------------------------------


@pytest.mark.parametrize("payload", ["pickle", "expr_str"])
def test_a_sliced_run_with_a_malicious_block_program_is_refused(
    payload: str,
    world: Any,
    api: Any,
    settings: Any,
    django_capture_on_commit_callbacks: Any,
    tmp_path: Path,
) -> None:
    from tests.attestations.challenges import test_sliced_runs as flow

    settings.DVBENCH = {**settings.DVBENCH, "SLICED_CHALLENGES": 2, "SLICED_OPENED": 2}
    marker = tmp_path / "marker"
    client = api("alice")
    lab = flow.train(0)
    blocks, embed, archives = lab.programs(flow.LMInput(lab.model))
    # Every block's program carries the payload, so every drawn slice loads one.
    forged = {d: TORCH_PAYLOADS[payload](archives[d], marker) for d in set(blocks)}
    for data in (*forged.values(), archives[embed]):
        flow.upload(client, data)
    programs = tuple(flow.hashlib.sha256(forged[d]).hexdigest() for d in blocks)
    digest = flow.upload(client, lab.run_file(programs, embed).to_bytes())
    response = client.post(flow.RUNS, {"run_file": digest}, format="json")
    assert response.status_code == 201, response.content
    run = response.json()
    with django_capture_on_commit_callbacks(execute=True):
        flow.answer_and_open(client, run, lab)
    done = flow.settled(client, run)
    assert done["status"] == "failed", done
    assert done["reason"] == "program_unsafe"
    for challenge in done["challenges"]:
        assert challenge["status"] == SliceStatus.FAILED
        assert challenge["reason"] == "program_unsafe"
    assert SlicedRun.objects.get(pk=run["id"]).reason == "program_unsafe"
    assert not marker.exists()
