"""What a certificate states of the platforms: where the run trained, where each step
was replayed, how each replay was judged, and which steps no worker could replay.

Read from the root record (``zkdv.environments``) and the challenges' stored verdicts
(``provers.ReplayVerdict.to_dict``: the worker's ``environment``, its ``judgement``,
``exact`` in the run's own replay environment or ``within_bounds`` elsewhere, and the
keys it ``differences`` in), for the ``detection_guarantee`` claim
(``attestations.certificates.subjects.guarantee_claim``, ``docs/certificates.md``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from attestations.challenges.models import ChallengeStatus
from provers.drift import combine
from zkdv.environments import platform_kind

__all__ = [
    "TRAINING_ENVIRONMENT",
    "drift",
    "judgements",
    "not_replayed",
    "tolerance_steps",
    "training",
    "update_path",
    "workers",
]

#: What the certificate says of the training machine, from the root record's ``env``.
TRAINING_ENVIRONMENT = (
    "torch",
    "jax",
    "jaxlib",
    "jax_platform",
    "platform_kind",
    "device_kind",
    "devices",
    "cpu_capability",
    "cpu_isa",
    "cpu_model",
    "cpu_features",
    "cpu_affinity",
    "threads",
    "platform_version",
    "libtpu",
    "libtpu_init_args",
    "cuda",
    "cudnn",
    "xla_flags",
    "x64",
    "matmul_precision",
    "precision",
)

#: One challenge as :func:`guarantee_claim` reads it: step, through, status, evidence.
Row = tuple[int, int | None, str, Any]


def _span(step: int, through: int | None) -> range:
    return range(step, (through if through is not None else step) + 1)


def training(root: Mapping[str, Any]) -> dict[str, Any]:
    """The training machine: the root's environment entries that the certificate states
    (:data:`TRAINING_ENVIRONMENT`, which hold its replay environment key,
    :func:`zkdv.environments.replay_environment`) and its platform kind (read from the
    backend for a root from before it was recorded)."""
    env = root.get("env") or {}
    stated = {key: env[key] for key in TRAINING_ENVIRONMENT if key in env}
    stated["platform_kind"] = platform_kind(root)
    return stated


def workers(challenges: Sequence[Row]) -> list[dict[str, Any]]:
    """The workers that replayed passed challenges: each environment as the worker stated
    it, with its ``judgement``, the keys it ``differs_in`` from the run, its steps, and
    those of them whose state it passed only ``within_tolerance`` (:func:`tolerance_steps`)."""
    found: dict[str, dict[str, Any]] = {}
    for step, through, status, evidence in challenges:
        if status != ChallengeStatus.PASSED or not isinstance(evidence, Mapping):
            continue
        environment = evidence.get("environment")
        if not isinstance(environment, Mapping):
            continue
        judgement = evidence.get("judgement")
        differs = [str(key) for key in evidence.get("differences") or []]
        key = json.dumps([environment, judgement, differs], sort_keys=True, default=str)
        entry = found.setdefault(
            key,
            {
                **dict(environment),
                "judgement": judgement,
                "differs_in": differs,
                "steps": [],
                "within_tolerance": [],
            },
        )
        entry["steps"].extend(_span(step, through))
        entry["within_tolerance"].extend(tolerance_steps(evidence))
    for entry in found.values():
        entry["steps"] = sorted(set(entry["steps"]))
        entry["within_tolerance"] = sorted(set(entry["within_tolerance"]))
    return list(found.values())


def judgements(challenges: Sequence[Row]) -> dict[str, list[int]]:
    """The replayed steps by judgement: ``exact`` (replayed in the run's own replay
    environment, where nothing but the committed bits passes), ``within_bounds``
    (another environment: the gradient within the run's bounds, the state exact) and
    ``within_tolerance`` (another environment, and the post-update state judged only by
    the probes' tolerance: a step that commits no gradient, or whose update is not
    canonical; never the exact guarantee). A step replayed under several keeps the
    loosest."""
    exact: set[int] = set()
    bounded: set[int] = set()
    tolerated: set[int] = set()
    for step, through, status, evidence in challenges:
        if status != ChallengeStatus.PASSED or not isinstance(evidence, Mapping):
            continue
        judged = evidence.get("judgement")
        if judged in ("exact", "within_bounds"):
            (exact if judged == "exact" else bounded).update(_span(step, through))
        tolerated.update(tolerance_steps(evidence))
    return {
        "exact": sorted(exact - bounded - tolerated),
        "within_bounds": sorted(bounded - tolerated),
        "within_tolerance": sorted(tolerated),
    }


def tolerance_steps(evidence: Mapping[str, Any]) -> list[int]:
    """The steps of one verdict whose post-update state passed only within the probes'
    tolerance (``StepEvidence.state``; for a verdict stored before it was recorded: a
    step not reproduced bit for bit that commits no gradient)."""
    steps = []
    for item in evidence.get("evidence") or []:
        if not isinstance(item, Mapping) or not isinstance(item.get("step"), int):
            continue
        state = item.get("state")
        if state == "tolerance" or (
            state is None and not item.get("exact") and not item.get("gradient")
        ):
            steps.append(item["step"])
    return steps


def update_path(root: Mapping[str, Any]) -> dict[str, Any]:
    """How the replay judges every step's post-update state, from the root record.

    ``state`` is ``exact`` where the run commits its gradients and its update is
    canonical (the same bits on any hardware), else ``within_tolerance``, with the
    ``reason``: the run commits no gradient (its transition is replayed whole), or the
    root's ``env.update.reason`` (an update without canonical form).
    """
    commits = bool((root.get("schema") or {}).get("grad"))
    update = (root.get("env") or {}).get("update")
    reason = None
    if not commits:
        reason = (
            "the run commits no gradient: each step's whole transition is replayed and "
            "judged by the probes' tolerance on other hardware"
        )
    elif isinstance(update, Mapping) and update.get("canonical") is False:
        reason = f"the update has no canonical form: {update.get('reason')}"
    return {
        "commits_gradient": commits,
        "state": "exact" if reason is None else "within_tolerance",
        "reason": reason,
    }


def not_replayed(challenges: Sequence[Row], kind: str) -> dict[str, Any] | None:
    """The challenged steps no worker of the run's platform kind replayed (status
    ``unreplayed``), with the reason; None when every challenge had a replay."""
    steps: set[int] = set()
    for step, through, status, _ in challenges:
        if status == ChallengeStatus.UNREPLAYED:
            steps.update(_span(step, through))
    if not steps:
        return None
    return {
        "reason": "no_replay_worker",
        "platform_kind": kind,
        "steps": sorted(steps),
        "message": f"no replay worker of platform kind {kind!r} was available: these "
        "steps were not replayed, and no bounds of another platform were applied to them",
    }


def drift(challenges: Sequence[Row]) -> dict[str, Any] | None:
    """The drift test (:mod:`provers.drift`) per replayed window and over the run: each
    window's steps, inexact steps, alignment z, exact sign-flip p-value and mean cosine
    (a window replayed by several challenges once, by the one that replayed furthest),
    and the run's combined z against its threshold. None when no window had two steps
    that differed from the replay (every replay bit for bit)."""
    entries = [
        evidence["drift"]
        for _, _, status, evidence in challenges
        if status == ChallengeStatus.PASSED
        and isinstance(evidence, Mapping)
        and isinstance(evidence.get("drift"), Mapping)
    ]
    run = combine(entries)
    if not run["windows"]:
        return None
    furthest: dict[int, Mapping[str, Any]] = {}
    for entry in entries:
        kept = furthest.get(entry["first"])
        if kept is None or kept["last"] < entry["last"]:
            furthest[entry["first"]] = entry
    keys = ("first", "last", "inexact_steps", "z", "p", "window_p", "cosine")
    return {
        "windows": [{key: furthest[f].get(key) for key in keys} for f in sorted(furthest)],
        "run": run,
    }
