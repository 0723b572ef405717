"""Errors of filing a transcript as a proof (kinds: ``attestations.core.errors``)."""

from __future__ import annotations

from attestations.core.errors import ConflictError, UnprocessableError


class TooManyProofsError(ConflictError):
    """The experiment holds as many proofs as ``DVBENCH_MAX_PROOFS_PER_EXPERIMENT`` allows."""

    default_code = "too_many_proofs"


class TranscriptRejectedError(UnprocessableError):
    """A transcript whose root names another experiment, spec or framework."""

    default_message = "The transcript was rejected."
    default_code = "transcript_rejected"
