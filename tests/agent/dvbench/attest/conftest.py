"""Named actors for the attestation tests: the platform's keys, log and issued bundles.

``platform`` signs with ``key_2026a`` from 2026-01-01 until it rotates to ``key_2026b``
on 2026-07-01; ``log`` is its transparency log, holding a few unrelated entries before
each certificate so that proofs are not trivial.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from dvbench.attest import (
    Checkpoint,
    Claim,
    Evidence,
    LogEntryRef,
    MerkleTree,
    ReplayEvidence,
    Result,
    SigningKey,
    TrainingCertificate,
    TrustRoot,
    envelope_leaf_hash,
    leaf_hash,
    make_bundle,
    sign_certificate,
    sign_checkpoint,
)

ORIGIN = "dvbench.example/log"
START = datetime(2026, 1, 1, tzinfo=UTC)
ROTATION = datetime(2026, 7, 1, tzinfo=UTC)
ISSUED = datetime(2026, 3, 14, 15, 9, 26, tzinfo=UTC)


def certificate_for(
    trust_root: TrustRoot,
    *,
    index: int,
    issued_at: datetime = ISSUED,
    transcript_digest: str = "ab" * 32,
    final_parameter_root: str = "cd" * 32,
    result: Result = Result.PASSED,
) -> TrainingCertificate:
    return TrainingCertificate(
        transcript_digest=transcript_digest,
        final_parameter_root=final_parameter_root,
        verifier_id="https://dvbench.example",
        verifier_version="0.1.0",
        issued_at=issued_at,
        policy_digest="ef" * 32,
        result=result,
        claims=(
            Claim("steps", 1000, Evidence.COMMITTED),
            Claim("flops", 3.25e18, Evidence.REPLAYED, "FLOP"),
            Claim("optimizer", {"name": "adamw", "lr": 3e-4}, Evidence.REPORTED),
        ),
        replay=ReplayEvidence("5e" * 32, (0, 17, 512), {"rtol": 1e-5, "atol": 1e-6}),
        log=LogEntryRef(ORIGIN, index),
        trust_root_version=trust_root.version,
        trust_root_digest=trust_root.digest(),
        experiment="acme/run-7",
    )


@dataclass
class Platform:
    """Issues certificates the way the server will: reserve, sign, append, checkpoint."""

    signer: SigningKey
    trust_root: TrustRoot
    log: MerkleTree = field(default_factory=MerkleTree)

    def issue(
        self,
        *,
        checkpoint_at: datetime | None = None,
        checkpoint_signer: SigningKey | None = None,
        padding: int = 3,
        **certificate: Any,
    ) -> dict[str, Any]:
        for number in range(padding):
            self.log.append(leaf_hash(b"unrelated entry %d" % (self.log.size + number)))
        index = self.log.size
        issued = certificate.pop("issued_at", ISSUED)
        body = certificate_for(self.trust_root, index=index, issued_at=issued, **certificate)
        envelope = sign_certificate(body, self.signer)
        assert self.log.append(envelope_leaf_hash(envelope)) == index
        self.log.append(leaf_hash(b"a later entry"))
        moment = checkpoint_at or issued + timedelta(seconds=2)
        note = sign_checkpoint(
            Checkpoint(ORIGIN, self.log.size, self.log.root(), moment),
            checkpoint_signer or self.signer,
        )
        return make_bundle(
            envelope,
            log_index=index,
            inclusion_proof=self.log.inclusion_proof(index),
            checkpoint=note,
            tree_size=self.log.size,
            trust_root=self.trust_root,
        )


@pytest.fixture(scope="session")
def key_2026a() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="session")
def key_2026b() -> SigningKey:
    return SigningKey.generate()


@pytest.fixture(scope="session")
def outsider_key() -> SigningKey:
    """A key that no trust root lists."""
    return SigningKey.generate()


@pytest.fixture
def trust_root_v1(key_2026a: SigningKey) -> TrustRoot:
    return TrustRoot.initial(key_2026a.public_key, not_before=START)


@pytest.fixture
def trust_root_v2(trust_root_v1: TrustRoot, key_2026b: SigningKey) -> TrustRoot:
    """After the rotation: 2026a valid [START, ROTATION), 2026b from ROTATION."""
    return trust_root_v1.rotate(key_2026b.public_key, at=ROTATION)


@pytest.fixture
def platform(key_2026a: SigningKey, trust_root_v1: TrustRoot) -> Platform:
    return Platform(signer=key_2026a, trust_root=trust_root_v1)


@pytest.fixture
def bundle(platform: Platform) -> dict[str, Any]:
    return platform.issue()


@pytest.fixture
def make_certificate() -> Any:
    """:func:`certificate_for`, for tests that sign certificates by hand."""
    return certificate_for
