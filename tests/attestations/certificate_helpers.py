"""Shared helpers for the certificate, log and regulator tests.

``certify(proof)`` gives a proof a real transcript (a synthetic ZKDV run of the proof's
experiment, written once per session), the verifier's report on it and a final verdict,
then issues its certificate through the service, as the task does.
"""

from __future__ import annotations

import functools
import hashlib
import tempfile
from pathlib import Path
from typing import Any

from django.core.files.base import ContentFile
from django.core.files.storage import default_storage

from attestations.certificates import issuance
from attestations.certificates.models import Certificate
from attestations.experiments.models import Experiment
from attestations.proofs.models import Proof, ProofStatus
from attestations.uploads.models import Blob
from tests.synthetic import write_synthetic_transcript
from zkdv.verify import verify_transcript

_SCRATCH = Path(tempfile.mkdtemp(prefix="dvbench-certificate-tests-"))


@functools.cache
def _transcript(
    experiment: str, spec_digest: str, seed: int, steps: int
) -> tuple[bytes, dict[str, Any]]:
    folder = _SCRATCH / f"{experiment.replace('/', '-')}-{spec_digest[:8]}-{seed}-{steps}"
    write_synthetic_transcript(
        folder, steps=steps, experiment=experiment, spec_digest=spec_digest, seed=seed
    )
    report = verify_transcript(folder / "records.cborl")
    assert report.ok, report.summary()
    return (folder / "records.cborl").read_bytes(), report.to_dict()


def stored_transcript(
    experiment: Experiment, seed: int = 0, steps: int = 4
) -> tuple[Blob, dict[str, Any]]:
    """A real transcript of ``experiment`` in storage, and the verifier's report on it."""
    assert experiment.current_spec is not None
    data, report = _transcript(experiment.full_name, experiment.current_spec.digest, seed, steps)
    digest = hashlib.sha256(data).hexdigest()
    blob = Blob.objects.filter(sha256=digest).first()
    if blob is None:
        name = default_storage.save(Blob.address(digest), ContentFile(data))
        blob = Blob.objects.create(sha256=digest, size=len(data), storage_name=name)
    return blob, report


#: The synthetic run trains with plain SGD; a spec declaring it keeps the run in its limits.
SGD = "optax.sgd(0.1)"


def declare_sgd(experiment: Experiment) -> None:
    """Make the experiment's current spec declare what the synthetic run does."""
    assert experiment.current_spec is not None
    if experiment.current_spec.optimizer != SGD:
        experiment.revise_spec({**experiment.current_spec.to_dict(), "optimizer": SGD})
        experiment.refresh_from_db()


def finalize(
    proof: Proof,
    *,
    status: str = ProofStatus.VALID,
    seed: int = 0,
    steps: int = 4,
    within_limits: bool = True,
) -> Proof:
    """Give ``proof`` a real transcript, its report and the verdict ``status``.

    ``within_limits`` first declares the synthetic run's optimizer in the spec, so its
    claims break no limit; False keeps the spec (which declares Adam: a violation).
    """
    if within_limits:
        declare_sgd(proof.experiment)
    blob, report = stored_transcript(proof.experiment, seed, steps)
    Proof.objects.filter(pk=proof.pk).update(
        spec=proof.experiment.current_spec,
        status=status,
        transcript=blob,
        report=report,
        transcript_digest=report["digest"],
        steps=report["steps"],
        checks=report["checks"],
        prover="whitebox-jax",
    )
    proof.refresh_from_db()
    return proof


def new_proof(experiment: Experiment, **kwargs: Any) -> Proof:
    declare_sgd(experiment)
    blob, _ = stored_transcript(experiment)
    assert experiment.current_spec is not None
    proof = Proof.objects.create(
        experiment=experiment, spec=experiment.current_spec, transcript=blob
    )
    return finalize(proof, **kwargs)


def certify(proof: Proof, **kwargs: Any) -> Certificate:
    """Finalize (unless already final with a report) and issue the certificate."""
    if kwargs or proof.status not in issuance.CERTIFIED_STATUSES or not proof.report:
        finalize(proof, **kwargs)
    return issuance.issue_certificate(proof.pk)
