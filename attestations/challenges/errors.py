"""Errors of attaching the files that answer a proof's challenges.

Each refusal stores nothing of the request. Which kind it is says how it went wrong: a
malformed list, a name already attached with other bytes, or a file that does not match
what the transcript commits for it.
"""

from __future__ import annotations

from attestations.core.errors import ConflictError, InvalidRequestError, UnprocessableError


class ArtifactRejectedError(InvalidRequestError):
    """A file list that cannot be accepted as it is (a bad name, kind, size or digest)."""

    default_code = "artifact_rejected"


class ArtifactConflictError(ConflictError):
    """A name already attached to the proof with other bytes: a proof's files never change."""

    default_code = "artifact_conflict"


class ArtifactMismatchError(UnprocessableError):
    """A file that does not match what the transcript (or its final root) commits for it."""

    default_code = "artifact_mismatch"
