"""Server-side replay: challenges, the files that answer them, and the replay verdicts.

One name for the whole life of a proof after the offline verifier accepted its
transcript; each step is a module of its own, and this one re-exports them all:

1. :mod:`~attestations.challenges.draw`: the seed and the challenged steps; the proof is
   ``challenged``.
2. :mod:`~attestations.challenges.answers`: the trainer attaches the files the challenges
   read, each checked against what the transcript commits for it before it is stored; a
   challenge whose files are all there is ``ready`` and queued.
3. :mod:`~attestations.challenges.execution`: the ``replay`` queue's task claims a ready
   challenge (a conditional update, so it completes once), materialises the proof
   directory (:mod:`~attestations.challenges.workspace`) and runs
   :func:`provers.verify_challenge`.
4. :mod:`~attestations.challenges.verdicts`: the proof's verdict once every challenge is
   final, and the deadlines that expire unanswered ones.

The transcript's index and the proof directory's names are in
:mod:`~attestations.challenges.index`; the challenge policy in
:mod:`~attestations.challenges.policy`.
"""

from __future__ import annotations

from attestations.challenges.answers import (
    FileClaim,
    _commitment_check,
    _in_layout,
    _needed,
    _owned_blobs,
    attach,
    check_name,
    enqueue,
    mark_ready,
)
from attestations.challenges.draw import (
    RUN_CONTEXT,
    SEED_CONTEXT,
    _absorb,
    challenge_seed,
    draw,
    earlier_plans,
    filing_target,
    replayable,
    run_digest,
)
from attestations.challenges.execution import (
    _PROBES_CHECKED,
    _PROBES_KEPT,
    _TRANSITIONS,
    _TRANSITIONS_KEPT,
    _TRANSITIONS_LOCK,
    _transition,
    check_probes,
    claim,
    record_error,
    record_verdict,
    release_claim,
    replay_one,
)
from attestations.challenges.index import (
    COPY_CHUNK,
    FILES_DIR,
    MAX_NAME,
    PROBES,
    REPLAY_DIR,
    TRANSCRIPT,
    TranscriptIndex,
)
from attestations.challenges.policy import (
    ChallengePolicy,
    replay_time_limit,
)
from attestations.challenges.verdicts import (
    _progress,
    expire,
    expire_if_due,
    expire_proof,
    requeue_lost,
    settle,
)
from attestations.challenges.workspace import (
    BlobCorruptError,
    _empty_trees,
    _materialise,
    data_dir,
    proof_directory,
    release_directory,
)

__all__ = [
    "COPY_CHUNK",
    "FILES_DIR",
    "MAX_NAME",
    "PROBES",
    "REPLAY_DIR",
    "RUN_CONTEXT",
    "SEED_CONTEXT",
    "TRANSCRIPT",
    "_PROBES_CHECKED",
    "_PROBES_KEPT",
    "_TRANSITIONS",
    "_TRANSITIONS_KEPT",
    "_TRANSITIONS_LOCK",
    "BlobCorruptError",
    "ChallengePolicy",
    "FileClaim",
    "TranscriptIndex",
    "_absorb",
    "_commitment_check",
    "_empty_trees",
    "_in_layout",
    "_materialise",
    "_needed",
    "_owned_blobs",
    "_progress",
    "_transition",
    "attach",
    "challenge_seed",
    "check_name",
    "check_probes",
    "claim",
    "data_dir",
    "draw",
    "earlier_plans",
    "enqueue",
    "expire",
    "expire_if_due",
    "expire_proof",
    "filing_target",
    "mark_ready",
    "proof_directory",
    "record_error",
    "record_verdict",
    "release_claim",
    "release_directory",
    "replay_one",
    "replay_time_limit",
    "replayable",
    "requeue_lost",
    "run_digest",
    "settle",
]
