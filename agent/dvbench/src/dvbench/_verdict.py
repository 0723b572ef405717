"""What a proof's certificate says, in words and as an exit status.

A filed proof ends in one of these states, and every command that reports on a proof
(``finish()``, ``dvbench sync``, ``dvbench proofs show``, ``dvbench download-report``,
``dvbench verify-report``) says which, with the same words:

* ``PASSED``: the certificate is signed and records PASSED.
* ``FAILED``: the certificate is signed and records FAILED; the failed claims (each
  declared limit the run broke, from the signed ``limit_violations`` claim) and the
  proof's own verdict when it was rejected are listed.
* ``pending``: no certificate yet (the proof is being verified, waits for challenge
  answers or replays, or the certificate is being signed).
* ``error``: the platform's verifier failed on the proof; no certificate will come.

Only PASSED is success: the others make the scripted commands exit 1 (``--allow-failed``
accepts a FAILED certificate where inspecting it is the point).

Plain Python: used by the SDK and by ``dvbench.attest``'s offline verifier alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ERROR", "FAILED", "PASSED", "PENDING", "Verdict", "failed_claims"]

PASSED = "PASSED"
FAILED = "FAILED"
PENDING = "pending"
ERROR = "error"

#: Proof statuses after which the verdict does not change.
FINAL_PROOF_STATUSES = ("valid", "rejected", "error")


def failed_claims(
    claims: Iterable[Mapping[str, Any]],
    filings: Mapping[str, Any] | None = None,
    *,
    proof_id: int | None = None,
    transcript_digest: str | None = None,
) -> list[str]:
    """Why a certificate records FAILED, one line per reason.

    Args:
        claims: the signed claims (``{name, value, ...}`` each, as in the statement).
        filings: the signed ``filings`` (``{count, proofs: [...]}``), if any.
        proof_id: the certified proof, to find its own verdict among the filings.
        transcript_digest: else the certified transcript's digest (the first filing of
            it is the certified one; later ones are duplicates).

    Returns:
        ``"<limit>: <message>"`` for each broken limit, preceded by the proof's own
        verdict (``"proof 5 rejected (replay_mismatch)"``) when it was not valid.
    """
    reasons: list[str] = []
    for claim in claims:
        if claim.get("name") != "limit_violations":
            continue
        for violation in claim.get("value") or []:
            if isinstance(violation, Mapping):
                limit = violation.get("limit") or "limit"
                reasons.append(f"{limit}: {violation.get('message') or 'broken'}")
    for filing in (filings or {}).get("proofs") or []:
        if not isinstance(filing, Mapping):
            continue
        if proof_id is not None:
            mine = filing.get("proof") == proof_id
        else:
            mine = bool(transcript_digest) and filing.get("transcriptDigest") == transcript_digest
        if not mine:
            continue
        status = str(filing.get("status") or "")
        if status and status != "valid":
            reason = str(filing.get("reason") or "")
            text = f"proof {filing.get('proof')} {status}" + (f" ({reason})" if reason else "")
            reasons.insert(0, text)
        break
    return reasons


@dataclass(frozen=True)
class Verdict:
    """Where a filed proof stands: PASSED, FAILED (and why), pending, or error.

    Attributes:
        proof_id: the platform's proof id.
        state: ``"PASSED"``, ``"FAILED"``, ``"pending"`` or ``"error"``.
        proof_status: the proof's status (``pending`` ... ``valid``, ``rejected``, ``error``).
        failed: for FAILED, the failed claims and the proof's verdict (see
            :func:`failed_claims`); for error, the verifier's message.
        certificate_id: the certificate's id, once signed.
        url: the proof's page in the web UI.
    """

    proof_id: int
    state: str
    proof_status: str | None = None
    failed: tuple[str, ...] = field(default=())
    certificate_id: int | None = None
    url: str | None = None

    @property
    def passed(self) -> bool:
        return self.state == PASSED

    @property
    def final(self) -> bool:
        """Whether it can still change: a certificate is signed, or none will come."""
        return self.state != PENDING

    @classmethod
    def from_api(
        cls,
        proof: Mapping[str, Any],
        certificate: Mapping[str, Any] | None,
        *,
        url: str | None = None,
    ) -> Verdict:
        """From ``GET proofs/{id}/`` and ``GET proofs/{id}/certificate/`` (None: 404)."""
        proof_id = int(proof["id"])
        status = str(proof.get("status") or "") or None
        if certificate is not None:
            result = str(certificate.get("result"))
            failed: tuple[str, ...] = ()
            if result != PASSED:
                failed = tuple(
                    failed_claims(
                        [
                            {
                                "name": "limit_violations",
                                "value": certificate.get("limit_violations"),
                            }
                        ],
                        certificate.get("filings"),
                        proof_id=proof_id,
                    )
                )
                if not failed and status and status != "valid":
                    reason = proof.get("reason") or ""
                    failed = (f"proof {proof_id} {status}" + (f" ({reason})" if reason else ""),)
            return cls(
                proof_id,
                PASSED if result == PASSED else FAILED,
                status,
                failed,
                int(certificate["id"]) if certificate.get("id") is not None else None,
                url,
            )
        if status == "error":
            message = str(proof.get("message") or proof.get("reason") or "verifier error")
            return cls(proof_id, ERROR, status, (message,), None, url)
        return cls(proof_id, PENDING, status, (), None, url)

    def summary(self) -> str:
        """One line (FAILED: one line per failed claim after it)."""
        where = f" ({self.url})" if self.url else ""
        if self.state == PASSED:
            return f"proof {self.proof_id}: certificate PASSED{where}"
        if self.state == FAILED:
            lines = [f"proof {self.proof_id}: certificate FAILED{where}; failed claims:"]
            lines += [f"  {reason}" for reason in self.failed or ("(none listed)",)]
            return "\n".join(lines)
        if self.state == ERROR:
            reason = f": {self.failed[0]}" if self.failed else ""
            return (
                f"proof {self.proof_id}: verifier error{reason}; no certificate will be "
                f"issued{where}"
            )
        return (
            f"proof {self.proof_id}: certificate pending (proof {self.proof_status}){where}; "
            f"`dvbench proofs show {self.proof_id} --wait` waits for it"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "proof": self.proof_id,
            "verdict": self.state,
            "proof_status": self.proof_status,
            "failed": list(self.failed),
            "certificate": self.certificate_id,
            "url": self.url,
        }
