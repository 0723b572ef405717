"""Drawing a proof's challenges: a seed the trainer cannot predict or re-roll, and the steps.

:func:`draw` derives the seed (HMAC under the platform's challenge key of the committed
run's digest: the same in every organisation), derives the challenged steps from it
(:func:`provers.challenges.draw_challenges`: step 0, every step the trainer self-checked,
random steps up to this filing's detection target, never fewer than any earlier filing of
the same run anywhere was drawn for), stores only the seed's SHA-256 where users can see
it, and lists for each challenge the proof-directory files its replay reads. The proof is
``challenged``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

from django.db import transaction
from django.utils import timezone

from attestations.audit.models import AuditEvent
from attestations.challenges.answers import mark_ready
from attestations.challenges.index import TranscriptIndex
from attestations.challenges.models import (
    Challenge,
    ChallengeOrigin,
    CommittedState,
)
from attestations.challenges.policy import ChallengePolicy
from attestations.challenges.secret import challenge_key
from attestations.experiments.models import Experiment
from attestations.proofs.models import (
    DUPLICATE_TRANSCRIPT,
    Job,
    Proof,
    ProofStatus,
)

log = logging.getLogger(__name__)


def replayable(root: Mapping[str, Any] | None) -> bool:
    """Whether a transcript commits a program a replay prover can run."""
    from provers import PROVERS

    if not isinstance(root, Mapping) or root.get("prover") not in PROVERS:
        return False
    program = root.get("program")
    return isinstance(program, Mapping) and bool(program.get("kind"))


#: What the seed of a committed run is derived with (HMAC-SHA256 under the platform's
#: challenge key). v2 was keyed per organisation; v3 is one key for the whole platform.
SEED_CONTEXT = b"dvbench-challenge-seed-v3\0"
#: Prefix of the committed-run digest.
RUN_CONTEXT = b"dvbench-run-v1\0"


def _absorb(h: Any, value: object) -> None:
    """Feed one field, unambiguously: a type tag, a length, the bytes."""
    if isinstance(value, bytes | bytearray):
        data, tag = bytes(value), b"B"
    elif value is None:
        data, tag = b"", b"N"
    else:
        data, tag = repr(value).encode("utf-8"), b"R"
    h.update(tag + len(data).to_bytes(8, "little") + data)


def run_digest(index: TranscriptIndex) -> str:
    """SHA-256 (hex) of what a run computed, and nothing the trainer may write freely.

    It covers the committed program, the initial state roots, and for every step in order
    its index, batch root and post-state roots. It leaves out timestamps, environment,
    configuration, probes, token and FLOP counts, check records and the experiment's name:
    a transcript re-written in any of those (or a deterministic rerun, which differs only
    in its timestamps) is the same committed run, and gets the same challenges
    (:func:`draw`). To change it, the trainer must change the computation it claims.
    """
    h = hashlib.sha256(RUN_CONTEXT)
    program = index.root.get("program")
    _absorb(h, program.get("digest") if isinstance(program, Mapping) else None)
    initial = index.root.get("initial")
    for tree in ("p", "o", "b"):
        _absorb(h, initial.get(tree) if isinstance(initial, Mapping) else None)
    for step in sorted(index.steps):
        record = index.steps[step]
        h.update(step.to_bytes(8, "little"))
        batch, post = record.get("batch"), record.get("post")
        _absorb(h, batch.get("root") if isinstance(batch, Mapping) else None)
        for tree in ("p", "o", "b"):
            _absorb(h, post.get(tree) if isinstance(post, Mapping) else None)
    return h.hexdigest()


#: Every how many steps a challenged proof's committed state is indexed (and always its
#: last step): a near copy that shares fewer steps than this with a filing elsewhere is
#: not found, and it then trained all but those few again itself.
STATE_STRIDE = 16


def indexed_states(index: TranscriptIndex) -> dict[int, str]:
    """The post-step parameter roots (hex) a proof's filing is indexed by: after steps
    ``STATE_STRIDE - 1``, ``2 x STATE_STRIDE - 1``, ... and after its last step.

    Never the initial state: runs from one initialisation (a sweep from one seed, the
    fine-tunes of one parent) share it without sharing any computation.
    """
    steps = sorted(index.steps)
    last = steps[-1] if steps else None
    out: dict[int, str] = {}
    for step in steps:
        if (step + 1) % STATE_STRIDE and step != last:
            continue
        post = index.steps[step].get("post")
        root = post.get("p") if isinstance(post, Mapping) else None
        if isinstance(root, bytes | bytearray) and len(root) == 32:
            out[step] = bytes(root).hex()
    return out


def shared_state_filings(proof: Proof) -> list[tuple[Proof, int]]:
    """Other challenged proofs, anywhere, that committed a state this one committed, with
    how many of its indexed states they share (most first): near copies and refilings of
    its run (``CommittedState``)."""
    from django.db.models import Count

    roots = CommittedState.objects.filter(proof=proof).values("root")
    shared = (
        CommittedState.objects.filter(root__in=roots)
        .exclude(proof=proof)
        .values("proof")
        .annotate(steps=Count("step"))
    )
    counts = {row["proof"]: row["steps"] for row in shared}
    proofs = Proof.objects.filter(pk__in=counts).select_related("experiment__owner")
    return sorted(((p, counts[p.pk]) for p in proofs), key=lambda item: (-item[1], item[0].created))


def filing_target(target: float, filing: int) -> float:
    """The detection target of the ``filing``-th challenged proof of one experiment.

    Filing ``n`` may miss a run with the policy's forged fraction with probability at most
    ``(1 - target) / 2**n``. These sum to less than ``1 - target``, so by the union bound a
    forged run escapes *every* filing of its experiment together with at most the
    probability one filing was allowed before (docs/provers.md, "Challenges cannot be
    ground"). A target of 0 (no random challenges) stays 0.
    """
    if filing < 1:
        raise ValueError(f"filing {filing!r} must be 1 or more")
    if target <= 0.0:
        return 0.0
    return 1.0 - (1.0 - target) / 2.0**filing


def challenge_seed(key: bytes, digest: str) -> bytes:
    """The seed of a committed run: HMAC-SHA256(platform key, context || run digest).

    Unpredictable without the key (:func:`~attestations.challenges.secret.challenge_key`),
    which never leaves the platform; the same for every transcript of the same run in
    every organisation, so re-filing a run, here or in another lab, never buys a fresh draw.
    """
    import hmac

    return hmac.new(key, SEED_CONTEXT + bytes.fromhex(digest), hashlib.sha256).digest()


def earlier_plans(digest: str, proof: Proof) -> tuple[bytes | None, float]:
    """The seed and largest target of the same run's earlier plans, in any organisation.

    The seed of the earliest plan stands for the run: one drawn under an earlier key (the
    per-organisation keys before v3, or a key since rotated) is reused, not replaced, so
    a change of key never gives a known run a fresh draw. Returns ``(None, 0.0)`` for a
    run never drawn.
    """
    earlier = (
        Proof.objects.filter(challenge_run_digest=digest, challenges_drawn__isnull=False)
        .exclude(pk=proof.pk)
        .exclude(challenge_seed="")
        .order_by("challenges_drawn", "pk")
        .values_list("challenge_seed", "challenge_target")
    )
    seed, floor = None, 0.0
    for stored, target in earlier:
        if seed is None:
            seed = bytes.fromhex(stored)
        floor = max(floor, target or 0.0)
    return seed, floor


def draw(proof: Proof, *, policy: ChallengePolicy | None = None) -> list[Challenge]:
    """Draw and store the challenges of a proof the offline verifier accepted.

    Called inside :func:`~attestations.proofs.ingest.ingest` (the ingest task). Idempotent: a proof that has
    its challenges keeps them. Grinding is closed three ways (docs/provers.md):

    * a transcript that already has a plan in this experiment is not drawn again: the
      newcomer is rejected as ``duplicate_transcript``, naming the proof it repeats;
    * the seed derives from the committed run and the platform's key alone
      (:func:`run_digest`, :func:`challenge_seed`), never from the organisation, and the
      steps from the seed, so every transcript of the same run, filed in any lab, faces
      the same steps (a later filing draws more of the same stream, never fewer: its
      target is at least the largest any earlier filing of the run was drawn for);
    * the ``n``-th challenged proof of the experiment is drawn for the target
      :func:`filing_target` gives, so all filings together keep the policy's bound.
    """
    from provers.challenges import draw_challenges

    if proof.challenges_drawn is not None:
        return list(proof.challenges.all())
    policy = policy or ChallengePolicy.from_settings()
    index = TranscriptIndex.of(proof)
    report = proof.report or {}
    with transaction.atomic():
        # The experiment's row is the lock that numbers its filings.
        Experiment.objects.select_for_update().filter(pk=proof.experiment_id).exists()
        siblings = Proof.objects.filter(experiment_id=proof.experiment_id).exclude(pk=proof.pk)
        earlier = (
            siblings.filter(
                challenges_drawn__isnull=False, transcript_digest=proof.transcript_digest
            )
            .order_by("pk")
            .first()
        )
        if earlier is not None:
            proof.record_verdict(
                ProofStatus.REJECTED,
                DUPLICATE_TRANSCRIPT,
                f"this transcript was filed before as proof {earlier.pk}, whose challenges "
                "stand; a transcript is challenged once per experiment",
                record=None,
                field="transcript",
            )
            return []
        filing = siblings.filter(challenges_drawn__isnull=False).count() + 1
        digest = run_digest(index)
        # The same run filed before (another experiment, another lab) fixes the seed and
        # sets a floor on the target: its plan here extends every earlier one. Two labs
        # drawing the same new run at the same moment both derive the same seed, so they
        # differ at most in how far along the one stream they draw.
        seed, floor = earlier_plans(digest, proof)
        if seed is None:
            seed = challenge_seed(challenge_key(), digest)
        target = max(filing_target(policy.target, filing), floor)
        plan = draw_challenges(
            steps=max(1, len(index.steps)),
            # Bound to the committed run, not to the transcript's bytes: see run_digest.
            transcript_digest=digest,
            self_checked=[int(s) for s in report.get("sampled") or []],
            seed=seed,
            target=target,
            forged_fraction=policy.forged_fraction,
        )
        now = timezone.now()
        rows = _challenges(proof, plan, index, now)
        created = Challenge.objects.bulk_create(rows)
        CommittedState.objects.bulk_create(
            CommittedState(proof=proof, step=step, root=root)
            for step, root in indexed_states(index).items()
        )
        _record_plan(proof, plan, policy, filing=filing, digest=digest, rows=rows, now=now)
        # Files attached before the draw (an "upload everything" client) answer at once.
        mark_ready(proof)
    return created


def _challenges(proof: Proof, plan: Any, index: TranscriptIndex, now: Any) -> list[Challenge]:
    """One challenge per drawn step, named by where it came from, with what it needs."""
    own = set(plan.self_checked)
    rows = []
    for step in plan.steps:
        origin = (
            ChallengeOrigin.GENESIS
            if step == plan.genesis
            else ChallengeOrigin.SELF_CHECKED
            if step in own
            else ChallengeOrigin.RANDOM
        )
        rows.append(
            Challenge(
                proof=proof,
                step=step,
                origin=origin,
                needed_files=index.files_for(step, None),
                steps_total=index.steps_to_replay(step, None),
                created=now,
            )
        )
    return rows


def _record_plan(
    proof: Proof,
    plan: Any,
    policy: ChallengePolicy,
    *,
    filing: int,
    digest: str,
    rows: list[Challenge],
    now: Any,
) -> None:
    """The proof challenged: its plan stored, its replay job opened, the draw audited."""
    proof.challenge_seed = plan.seed.hex()
    proof.challenge_seed_commitment = plan.commitment
    proof.challenge_target = plan.target
    proof.challenge_forged_fraction = plan.forged_fraction
    proof.challenge_filing = filing
    proof.challenge_run_digest = digest
    proof.challenges_drawn = now
    proof.challenge_deadline = now + policy.ttl
    proof.status = ProofStatus.CHALLENGED
    proof.save()
    Job.objects.create(
        kind="replay",
        organization_id=proof.experiment.owner_id,
        proof=proof,
        steps_total=sum(row.steps_total for row in rows),
    )
    AuditEvent.record(
        "proof.challenged",
        organization=proof.experiment.owner,
        target=proof,
        detail={
            "experiment": proof.experiment.full_name,
            "challenges": len(rows),
            "steps": list(plan.steps),
            "seed_commitment": plan.commitment,
            "target": plan.target,
            "forged_fraction": plan.forged_fraction,
            "filing": filing,
            "run_digest": digest,
            "deadline": proof.challenge_deadline.isoformat(),
        },
    )
