"""Framework-free test helpers: real transcripts without JAX or torch.

:func:`write_synthetic_transcript` trains a small linear model with SGD and momentum in
numpy through the real :class:`~zkdv.core.ZKDVCore` (commitments, probes, sampled
checks with an honest replay, snapshots, close), so every byte it writes is produced by
the same code path as a framework run.

Its output is a function of its arguments alone: the clock is a fixed sequence of ticks,
the probe seed derives from ``seed`` and the environment map is fixed, so two calls with
the same arguments write the same bytes, on any machine with the pinned numpy. A test
built on it draws its randomness from hypothesis alone, and a failure replays from the
hypothesis seed. (Real runs read the wall clock and draw a fresh probe seed.)

It imports nothing but ``zkdv`` and numpy: the wheel test (``tests/test_packaging.py``)
loads this file by path into an environment holding only the installed ``zkdv``.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from zkdv.config import GradientBounds, SamplingPolicy, ZKDVConfig
from zkdv.core import ZKDVCore
from zkdv.files import TREES, batch_path, gradient_path, snapshot_path, write_batch, write_state
from zkdv.gradients import leaf_name
from zkdv.merkle import LeafSpec
from zkdv.sampling import Challenge

__all__ = [
    "SYNTHETIC_ENV",
    "LinearSGD",
    "synthetic_clock",
    "synthetic_probe_seed",
    "write_synthetic_transcript",
]

#: The root's ``env`` of a synthetic transcript: fixed, so the bytes do not depend on the
#: machine (``zkdv.core.environment`` would record its Python, numpy and CPU count).
SYNTHETIC_ENV = {
    "python": "synthetic",
    "numpy": "synthetic",
    "platform": "synthetic",
    "cpu_count": 1,
}
#: 2026-01-01T00:00:00Z: the synthetic clock's first reading.
SYNTHETIC_EPOCH = 1_767_225_600.0


def synthetic_clock(start: float = SYNTHETIC_EPOCH, tick: float = 0.25) -> Callable[[], float]:
    """A clock that reads ``start``, ``start + tick``, ... on successive calls."""
    ticks = itertools.count()
    return lambda: start + tick * next(ticks)


def synthetic_probe_seed(seed: int, rerun: int = 0) -> bytes:
    """The 16-byte probe seed of the synthetic run of ``seed`` (its ``rerun``-th repeat)."""
    label = f"synthetic transcript probe seed {seed}" + (f" rerun {rerun}" if rerun else "")
    return hashlib.sha256(label.encode()).digest()[:16]


class LinearSGD:
    """``y = x @ w + b`` under squared loss, SGD with momentum: a pure init/update pair."""

    def __init__(self, features: int, *, lr: float = 0.05, momentum: float = 0.9) -> None:
        self.features = features
        self.lr = np.float32(lr)
        self.momentum = np.float32(momentum)

    def init(self, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        rng = np.random.default_rng(seed)
        params = {
            "w": rng.standard_normal((self.features, 1)).astype(np.float32) * np.float32(0.1),
            "b": np.zeros((1,), np.float32),
        }
        state = {
            "count": np.zeros((), np.int32),
            "mu_b": np.zeros((1,), np.float32),
            "mu_w": np.zeros((self.features, 1), np.float32),
        }
        return params, state

    def gradients(self, params: dict[str, np.ndarray], batch: np.ndarray) -> dict[str, np.ndarray]:
        """The gradient of the squared loss on ``batch``: the step's gradient program."""
        x = batch[:, : self.features].astype(np.float32) / np.float32(1000)
        y = batch[:, self.features :].astype(np.float32) / np.float32(1000)
        error = x @ params["w"] + params["b"] - y
        return {
            "w": (x.T @ error) * np.float32(2 / len(x)),
            "b": error.sum(axis=0) * np.float32(2 / len(x)),
        }

    def apply(
        self,
        params: dict[str, np.ndarray],
        state: dict[str, np.ndarray],
        grads: dict[str, np.ndarray],
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """SGD with momentum on ``grads``: ``(deltas, new_params, new_state)``, each value
        a separately rounded float32 operation (numpy does not fuse them), so the same
        bits everywhere: this model's canonical optimizer."""
        new_state = {
            "count": state["count"] + np.int32(1),
            "mu_b": self.momentum * state["mu_b"] + grads["b"],
            "mu_w": self.momentum * state["mu_w"] + grads["w"],
        }
        deltas = {"b": -self.lr * new_state["mu_b"], "w": -self.lr * new_state["mu_w"]}
        new_params = {k: (params[k] + deltas[k]).astype(np.float32) for k in params}
        return deltas, new_params, new_state

    def update(
        self, params: dict[str, np.ndarray], state: dict[str, np.ndarray], batch: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Return ``(deltas, new_params, new_state)`` without changing the inputs."""
        return self.apply(params, state, self.gradients(params, batch))


def _leaves(tree: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    return [(key, tree[key]) for key in sorted(tree)]


def _computed(grads: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
    """A step's computed values: its gradient, named after the parameters."""
    return [(leaf_name("params", key), value) for key, value in _leaves(grads)]


def _flat(tree: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([tree[key].reshape(-1).astype(np.float64) for key in sorted(tree)])


def write_synthetic_transcript(
    proof_dir: str | os.PathLike[str],
    *,
    steps: int = 4,
    experiment: str | None = None,
    spec_digest: str | None = None,
    seed: int = 0,
    features: int = 6,
    rows: int = 8,
    sampling: SamplingPolicy | None = None,
    rolling_window: int = 4,
    probe_ratio: float = 0.5,
    snapshot_interval: int = 2,
    prover: str = "whitebox-jax",
    forge: str | None = None,
    forge_step: int = 1,
    rerun: int = 0,
    gradients: bool = False,
) -> Path:
    """Train :class:`LinearSGD` for ``steps`` steps and write a valid transcript.

    Besides the records it writes what the platform's replay needs (``zkdv.files``):
    snapshot files at every snapshot step and every step's batch file (and with
    ``gradients`` its gradient file).

    Args:
        forge: write a *forged* run that still passes the offline verifier, so only a
            replay can catch it (for tests of the provers and the platform):
            ``"outside_step"`` changes the parameters between ``forge_step`` and the
            next step; ``"batches"`` commits other batches than it trains on from
            ``forge_step``; ``"lr"`` doubles the learning rate from ``forge_step``;
            ``"scaled_gradient"`` (with ``gradients``) trains on, and commits, the
            gradient times 1.01 from ``forge_step``. Forged runs answer their own
            sampled checks with the committed values.
        rerun: the ``rerun``-th repeat of the same training, as a real rerun records it:
            the same states and batches, but another probe seed and later timestamps
            (0, the default, is the first run).
        gradients: commit every step's gradient as its computed values (``schema.grad``,
            ``files/grad-<step>.bin``), with the float32 default bounds.

    Returns:
        ``proof_dir``, which then holds ``records.cborl``, ``probes.bin`` and ``files/``.
    """
    _check_forgery(forge, gradients)
    core = _synthetic_core(
        proof_dir,
        experiment=experiment,
        spec_digest=spec_digest,
        seed=seed,
        sampling=sampling,
        prover=prover,
        rolling_window=rolling_window,
        probe_ratio=probe_ratio,
        snapshot_interval=snapshot_interval,
        rerun=rerun,
    )
    run = _SyntheticRun(
        core,
        proof_dir,
        seed,
        steps,
        features,
        rows,
        forge,
        forge_step,
        gradients,
        snapshot_interval,
    )
    run.train()
    return Path(proof_dir)


def _check_forgery(forge: str | None, gradients: bool) -> None:
    if forge not in (None, "outside_step", "batches", "lr", "scaled_gradient"):
        raise ValueError(f"unknown forgery {forge!r}")
    if forge == "scaled_gradient" and not gradients:
        raise ValueError("the scaled_gradient forgery needs gradients=True")


class _SyntheticRun:
    """A synthetic run in progress: the core it commits through, how it trains (honestly,
    or forged from ``forge_step``), its batches and its state."""

    def __init__(
        self,
        core: ZKDVCore,
        proof_dir: str | os.PathLike[str],
        seed: int,
        steps: int,
        features: int,
        rows: int,
        forge: str | None,
        forge_step: int,
        gradients: bool,
        snapshot_interval: int,
    ) -> None:
        self.core, self.proof_dir = core, proof_dir
        self.forge, self.forge_step, self.gradients = forge, forge_step, gradients
        self.snapshot_interval = snapshot_interval
        self.flops = 6.0 * features * rows
        self.model = LinearSGD(features)
        self.forged_model = LinearSGD(features, lr=0.1) if forge == "lr" else self.model
        self.params, self.state = self.model.init(seed)
        self.rng = np.random.default_rng(seed + 1)
        self.batches = [
            self.rng.integers(0, 1000, size=(rows, features + 1), dtype=np.uint32)
            for _ in range(steps)
        ]
        # The pre-state of the latest snapshot step: a sampled check replays from it, as
        # the frontends do (the check record's ``from`` and ``replayed`` say so).
        self.snapshot = (self.params, self.state)

    def train(self) -> None:
        """Write the root, every step (with its snapshot and check), and the close."""
        core, params, state = self.core, self.params, self.state
        core.open(
            params=_leaves(params),
            opt_state=_leaves(state),
            buffers=[],
            batch_cols=self.model.features + 1,
            program=None,
            env=dict(SYNTHETIC_ENV),
            grad=[LeafSpec.of(name, array) for name, array in _computed(params)]
            if self.gradients
            else None,
            bounds=GradientBounds.default("float32"),
        )
        for step, batch in enumerate(self.batches):
            if step % self.snapshot_interval == 0 and core.last_roots is not None:
                _write_snapshot(core, self.proof_dir, step, self.params, self.state)
                self.snapshot = (self.params, self.state)
            self._step(step, batch)
        core.close()

    def _step(self, step: int, batch: np.ndarray) -> None:
        """Train step ``step`` on ``batch``, commit it, and answer its check if sampled."""
        core, forge, forge_step = self.core, self.forge, self.forge_step
        write_batch(batch_path(self.proof_dir, step), batch)
        claimed_pre = self.params  # what the probes claim the step started from
        params, trained_on = _forged_inputs(forge, forge_step, step, self.params, batch, self.rng)
        stepper = self.forged_model if step >= forge_step else self.model
        before_params = params
        grads = stepper.gradients(params, trained_on)
        if forge == "scaled_gradient" and step >= forge_step:
            grads = {k: (v * np.float32(1.01)).astype(np.float32) for k, v in grads.items()}
        deltas, self.params, self.state = stepper.apply(params, self.state, grads)
        computed = _computed(grads) if self.gradients else None
        if computed is not None:
            write_state(gradient_path(self.proof_dir, step), computed)
        # A forger keeps the probes of the steps it forges self-consistent.
        lying = forge is not None and step >= forge_step
        probes: tuple[list[np.ndarray], ...] = _probes(
            core, claimed_pre if lying else before_params, self.params, deltas, lying
        )
        if computed is not None:
            assert core.probes is not None
            probes = (*probes, core.probes.project_all([a for _, a in _leaves(grads)]))
        result = core.commit_step(
            step,
            batch=batch,
            params=_leaves(self.params),
            opt_state=_leaves(self.state),
            buffers=[],
            probes=probes,
            flops=self.flops,
            grad=computed,
        )
        if result.challenge is None:
            return
        start = step - step % self.snapshot_interval
        # A forged run answers with its committed values; an honest one replays.
        committed = (deltas, self.state)
        replayed = (
            committed
            if forge is not None
            else _replay(self.model, self.snapshot, self.batches[start : step + 1])
        )
        _record_check(core, result.challenge, start, step, committed, replayed)


def _synthetic_core(
    proof_dir: str | os.PathLike[str],
    *,
    experiment: str | None,
    spec_digest: str | None,
    seed: int,
    sampling: SamplingPolicy | None,
    prover: str,
    rolling_window: int,
    probe_ratio: float,
    snapshot_interval: int,
    rerun: int,
) -> ZKDVCore:
    """The transcript writer of a synthetic run, on the synthetic clock and probe seed
    of its ``rerun``-th repeat."""
    config = ZKDVConfig(
        name="synthetic",
        sampling_policy=sampling or SamplingPolicy.DEBUGCheckEvery(2),
        chunk_bytes=256,
    )
    bound = None
    if experiment is not None:
        bound = {"name": experiment, "spec_digest": spec_digest or ""}
    core = ZKDVCore(
        proof_dir,
        config,
        prover=prover,
        rolling_window=rolling_window,
        probe_ratio=probe_ratio,
        snapshot_interval=snapshot_interval,
        max_in_flight=2,
        experiment=bound,
    )
    core.clock = synthetic_clock(SYNTHETIC_EPOCH + 86_400.0 * rerun)
    core.probe_seed = synthetic_probe_seed(seed, rerun)
    return core


def _write_snapshot(
    core: ZKDVCore,
    proof_dir: str | os.PathLike[str],
    step: int,
    params: dict[str, np.ndarray],
    state: dict[str, np.ndarray],
) -> None:
    """The pre-state of snapshot step ``step``: its files, and its transcript record."""
    assert core.last_roots is not None
    for tree, leaves in zip(TREES, (_leaves(params), _leaves(state), []), strict=True):
        write_state(snapshot_path(proof_dir, step, tree), leaves)
    core.record_snapshot(step, core.last_roots, {})


def _forged_inputs(
    forge: str | None,
    forge_step: int,
    step: int,
    params: dict[str, np.ndarray],
    batch: np.ndarray,
    rng: np.random.Generator,
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The parameters step ``step`` really starts from and the batch it really trains on."""
    if forge == "outside_step" and step == forge_step + 1:
        params = {k: v + np.float32(0.01) for k, v in params.items()}
    trained_on = batch
    if forge == "batches" and step >= forge_step:
        trained_on = rng.integers(0, 1000, size=batch.shape, dtype=np.uint32)
    return params, trained_on


def _probes(
    core: ZKDVCore,
    pre_params: dict[str, np.ndarray],
    params: dict[str, np.ndarray],
    deltas: dict[str, np.ndarray],
    forged: bool,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The step's (pre, post, delta) probes; a forger keeps them self-consistent."""
    probes = core.probes
    assert probes is not None
    pre = probes.project_all([a for _, a in _leaves(pre_params)])
    post = probes.project_all([a for _, a in _leaves(params)])
    delta = probes.project_all([a for _, a in _leaves(deltas)])
    if forged:
        delta = [po - pr for po, pr in zip(post, pre, strict=True)]
    return pre, post, delta


def _replay(
    model: LinearSGD,
    snapshot: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
    batches: list[np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Replay from the snapshot through ``batches``; the last step's (deltas, state)."""
    params, state = snapshot
    for batch in batches[:-1]:
        _, params, state = model.update(params, state, batch)
    deltas, _, state = model.update(params, state, batches[-1])
    return deltas, state


def _record_check(
    core: ZKDVCore,
    challenge: Challenge,
    start: int,
    step: int,
    committed: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
    replayed: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
) -> None:
    """The check record of sampled step ``step``, replayed from snapshot step ``start``."""
    (deltas, state), (replay_deltas, replay_state) = committed, replayed
    core.record_check(
        challenge,
        committed_delta=float(_flat(deltas)[challenge.param_index]),
        replayed_delta=float(_flat(replay_deltas)[challenge.param_index]),
        committed_state=float(_flat(state)[challenge.state_index]),
        replayed_state=float(_flat(replay_state)[challenge.state_index]),
        replay_from=start,
        replayed_steps=step - start,
    )
