"""Shared ZKDV configuration: sampling policy, float tolerance, run configuration."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "COMMITMENT_PATHS",
    "GRADIENT_FILES",
    "PRECISIONS",
    "FloatTolerance",
    "GradientBounds",
    "SamplingPolicy",
    "ZKDVConfig",
    "resolve_gradient_files",
]

# 1 MiB: opening one coordinate discloses one chunk, and smaller chunks cost Python
# overhead per chunk that drops commitment throughput below 0.85 of raw BLAKE3 on two
# cores (bench/commit_throughput.py: 0.62 at 64 KiB, 0.78 at 256 KiB, 0.90 at 1 MiB).
DEFAULT_CHUNK_BYTES = 1 << 20

#: Where state commitments, probes and challenged values are computed (ZKDVConfig).
COMMITMENT_PATHS = ("auto", "host", "device")

#: Whether a run keeps each step's committed computed values as a file (ZKDVConfig).
GRADIENT_FILES = ("auto", "always", "never")


def resolve_gradient_files(setting: str, platform_kind: str) -> str:
    """``ZKDVConfig.gradient_files`` for a run on ``platform_kind``: ``"always"`` or
    ``"never"``. ``"auto"`` keeps no files on a TPU, whose runs are replayed on TPUs and
    bit for bit, and keeps them elsewhere, for replays on other hardware."""
    if setting == "auto":
        return "never" if platform_kind == "tpu" else "always"
    return setting


#: ``SamplingPolicy.state_check_probability`` when it is not configured. The seeds' core
#: reference names this sentinel as the argument's only valid value, and their README
#: passes 0.01, so both are released API (STYLE.md rule 25): kept, without effect.
STATE_CHECK_SENTINEL = -1.0
STATE_CHECK_DEPRECATED = (
    "SamplingPolicy(state_check_probability=...) is deprecated and has no effect: every "
    "sampled check covers one update coordinate and one optimizer-state coordinate, "
    "drawn with update_check_probability. Leave state_check_probability unset."
)


def _probability(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r} must be a probability in [0, 1]")
    return value


def _deprecated_state_check(policy: SamplingPolicy) -> float:
    """The deprecated argument as a float, checked as it always was (a probability)."""
    value = policy.state_check_probability
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"state_check_probability={value!r} must be a number (deprecated: leave it unset)"
        )
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(
            f"state_check_probability={value!r} must be a probability in [0, 1] or the "
            f"sentinel {STATE_CHECK_SENTINEL} (deprecated: leave it unset)"
        )
    return float(value)


@dataclass(frozen=True)
class SamplingPolicy:
    """Configure transcript-derived update sampling.

    The decision for step ``t`` and the challenged coordinates derive from the hash of
    step ``t``'s record (Fiat-Shamir), so a verifier recomputes every decision.

    Args:
        update_check_probability: probability that a step is re-executed and checked
            (0.01 when not given). Every sampled check covers one update coordinate and
            one optimizer-state coordinate.
        state_check_probability: deprecated; kept for backwards compatibility and should
            not be configured. Its only meaningful value is the default sentinel,
            ``-1.0``. Any other probability in [0, 1] is accepted with a
            ``DeprecationWarning`` and has no effect: it changes neither the sampling
            nor the transcript (the root record does not hold it), and a policy that
            sets it equals one that does not.
    """

    update_check_probability: float | None = None
    # compare=False: the argument has no effect, so two policies that differ only here
    # sample the same steps and must compare equal (a config read back from its record
    # equals the one that wrote it). repr=False: the sentinel is noise in a repr.
    state_check_probability: float = field(default=STATE_CHECK_SENTINEL, compare=False, repr=False)
    check_every: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        update = self.update_check_probability
        if self.state_check_probability != STATE_CHECK_SENTINEL:
            object.__setattr__(self, "state_check_probability", _deprecated_state_check(self))
            # stacklevel 3: __post_init__ <- the dataclass __init__ <- the caller's line.
            warnings.warn(STATE_CHECK_DEPRECATED, DeprecationWarning, stacklevel=3)
        object.__setattr__(
            self,
            "update_check_probability",
            _probability("update_check_probability", 0.01 if update is None else update),
        )
        if self.check_every is not None and (
            isinstance(self.check_every, bool) or int(self.check_every) < 1
        ):
            raise ValueError(f"DEBUGCheckEvery(n) needs n >= 1, got {self.check_every!r}")

    @classmethod
    def DEBUGCheckEvery(cls, n: int) -> SamplingPolicy:  # noqa: N802 - documented public name
        """Check every ``n``-th step (steps 0, n, 2n, ...): deterministic, for tests."""
        return cls(update_check_probability=0.0, check_every=int(n))

    @property
    def probability(self) -> float:
        assert self.update_check_probability is not None
        return self.update_check_probability

    def to_dict(self) -> dict[str, Any]:
        if self.check_every is not None:
            return {"kind": "every", "n": int(self.check_every)}
        return {"kind": "bernoulli", "p": self.probability}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingPolicy:
        if data.get("kind") == "every":
            return cls.DEBUGCheckEvery(int(data["n"]))
        if data.get("kind") == "bernoulli":
            return cls(update_check_probability=float(data["p"]))
        raise ValueError(f"unknown sampling policy {data!r}")


@dataclass(frozen=True)
class FloatTolerance:
    """How far a replayed float may be from the committed one: ``|a - b| <= abs + rel*|b|``.

    Compiled code is never bitwise equal to eager code, and results change with the
    number of CPU threads, so replays compare within this tolerance. Exact-bit claims
    hold only for the same artifact on the same thread count.
    """

    absolute: float = 1e-6
    relative: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("absolute", "relative"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"FloatTolerance {name}={value!r} must be finite and >= 0")
            object.__setattr__(self, name, value)

    def close(self, replayed: float, committed: float) -> bool:
        if math.isnan(replayed) or math.isnan(committed):
            return math.isnan(replayed) and math.isnan(committed)
        if math.isinf(replayed) or math.isinf(committed):
            return replayed == committed
        return abs(replayed - committed) <= self.absolute + self.relative * abs(committed)

    def to_dict(self) -> dict[str, float]:
        return {"abs": self.absolute, "rel": self.relative}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FloatTolerance:
        return cls(absolute=float(data["abs"]), relative=float(data["rel"]))


#: What a gradient program computes in: float32 throughout, or with reduced precision
#: somewhere (bfloat16 or float16 autocast or parameters, TF32 matrix products).
PRECISIONS = ("float32", "reduced")


@dataclass(frozen=True)
class GradientBounds:
    """How far a verifier's recomputed gradient may be from the committed one.

    A run that commits its gradients (:mod:`zkdv.gradients`) is replayed on the
    platform's own hardware: the verifier recomputes each challenged step's gradient
    from the committed pre-state and batch and compares it with the committed gradient.
    With ``r`` a replayed leaf, ``c`` the committed one, ``d = c - r`` and ``g`` the
    whole replayed gradient (every leaf together), each leaf passes when (L2 norms)

        |d|                 <= tensor * |r| + total * |g|
        |<d, r>| / |r|      <= scale  * |r| + total * |g|

    and the whole gradient when ``|<d, g>| / |g| <= scale * |g|``. Honest runs differ
    only by rounding, which is small relative to these norms and points anywhere, so
    its part along the gradient itself is smaller still; a forger's systematic change (a
    scaled gradient) is all along it. The optimizer is then applied to the committed
    gradient exactly, so this budget is all a forger has per step
    (``docs/transcript.md``, "Gradient bounds": the measured honest maxima, the margins,
    and what the budget buys a forger).

    Args:
        tensor: bound on a leaf's divergence, relative to its own norm.
        total: bound relative to the norm of the whole gradient; covers leaves whose
            true gradient is (nearly) zero, whose computed value is rounding noise.
        scale: bound on the part of the divergence along the gradient itself,
            relative to its norm (a leaf's, and the whole gradient's).
    """

    tensor: float
    total: float
    scale: float

    def __post_init__(self) -> None:
        for name in ("tensor", "total", "scale"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or not 0.0 <= value < 1.0:
                raise ValueError(f"GradientBounds {name}={value!r} must be in [0, 1)")
            object.__setattr__(self, name, value)

    @classmethod
    def default(cls, precision: str, *, compiled: bool = False) -> GradientBounds:
        """The default bounds of a gradient program of ``precision`` (:data:`PRECISIONS`).

        Set from the honest divergence measured across CPU kernel families, thread counts,
        and compiled against eager programs (``docs/reliability.md``, "Cross-hardware
        replay"), with a margin of at least 10x. ``compiled``: the replay's gradient
        program is compiled code while training ran eager kernels (an AOT Inductor
        program), which rounds reduced precision further apart.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r} must be one of {', '.join(PRECISIONS)}")
        if precision == "float32":
            return cls(tensor=1e-4, total=2e-5, scale=1e-5)
        if compiled:
            return cls(tensor=8e-2, total=3e-3, scale=6e-2)
        return cls(tensor=2.5e-2, total=1e-3, scale=3e-3)

    def to_dict(self) -> dict[str, float]:
        return {"tensor": self.tensor, "total": self.total, "scale": self.scale}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GradientBounds:
        return cls(
            tensor=float(data["tensor"]), total=float(data["total"]), scale=float(data["scale"])
        )


#: What a step record's ``tokens`` counts (``config.token_unit`` in the root record).
#: ``examples``: the batch's examples, the leading dimension of its first array (a
#: classifier's images, a regression's rows). ``tokens``: the token positions a sequence
#: model trains on, the elements of the batch's first integer array of rank >= 2 (its
#: token ids, ``[examples, positions]``). Both frontends count the same way
#: (:func:`zkdv.batch.count_tokens`).
TOKEN_UNITS = ("examples", "tokens")
#: The unit of a run that does not say (and of transcripts from before it was recorded).
DEFAULT_TOKEN_UNIT = TOKEN_UNITS[0]
#: ``env.flops.method`` of a Torch root: the SDK counted the sealed program with Torch's
#: FLOP counter, or estimated (the program could not run on fake tensors). A replay
#: recounts either (``flops_mismatch``), and a certificate reads which it was.
FLOPS_COUNTED = "torch.utils.flop_counter"
FLOPS_ESTIMATED = "6 x parameters x tokens"


@dataclass(frozen=True)
class ZKDVConfig:
    """Run configuration shared by both frontends.

    Args:
        name: a label for the run, recorded in the root record.
        sampling_policy: which steps are re-executed and checked.
        tolerance: how replayed floats are compared with committed ones.
        gradient_bounds: how a verifier's recomputed gradient is compared with the
            committed one (runs that commit gradients; :class:`GradientBounds`). None
            (default): :meth:`GradientBounds.default` for the precision the gradient
            program computes in, which the frontend finds when it seals the program.
        chunk_bytes: size of a Merkle leaf chunk; one coordinate is opened by
            disclosing one chunk and a logarithmic path.
        commitments: where the state is hashed and probed. ``"host"``: the state is
            read to host memory after every step and hashed there (native BLAKE3 on
            all cores). ``"device"``: chunk hashes, probes and challenged values are
            computed on the accelerator that holds the state, and the state leaves it
            only at replay snapshots. ``"auto"`` (default): the device on GPU and TPU
            backends, the host on CPU backends, where native BLAKE3 is faster. The
            transcript is byte-identical either way, so this is an execution setting
            and is not recorded in it. Both frontends honour it (single-process runs;
            ``zkdv.torch``: CUDA parameters).
        token_unit: what each step record's ``tokens`` counts, recorded in the root
            record and stated by the platform's token claim. ``"examples"`` (default):
            the batch's leading dimension. ``"tokens"``: the elements of the batch's first
            integer array of rank >= 2, the token ids a sequence model trains on. The
            FLOPs estimate ``6 x parameters x tokens`` (a step without a counted program)
            uses the same count.
        gradient_files: whether a run that commits its gradients keeps each step's
            computed values as ``files/grad-<step>.bin`` for the platform.
            ``"always"``: a replay on any hardware compares the gradient it recomputes
            with the committed one within the run's bounds, then applies the update to
            the committed one. ``"never"``: they are neither read back nor written, and
            a replay must recompute them bit for bit (their root is the step's committed
            ``grad`` root), which only workers of the training's own kernel environment
            do; elsewhere the step gets no verdict. ``"auto"`` (default): ``"never"`` on
            a TPU, whose runs are replayed on TPUs (its gradients differ from a CPU's by
            about 1 % of their norm), ``"always"`` elsewhere. The choice made is
            recorded in the root record (``config.gradient_files``).
    """

    name: str = "default"
    sampling_policy: SamplingPolicy = field(default_factory=SamplingPolicy)
    tolerance: FloatTolerance = field(default_factory=FloatTolerance)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    gradient_bounds: GradientBounds | None = None
    commitments: str = "auto"
    token_unit: str = DEFAULT_TOKEN_UNIT
    gradient_files: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ZKDVConfig name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.sampling_policy, SamplingPolicy):
            raise TypeError("ZKDVConfig sampling_policy must be a zkdv.SamplingPolicy")
        if not isinstance(self.tolerance, FloatTolerance):
            raise TypeError("ZKDVConfig tolerance must be a zkdv.FloatTolerance")
        if self.gradient_bounds is not None and not isinstance(
            self.gradient_bounds, GradientBounds
        ):
            raise TypeError("ZKDVConfig gradient_bounds must be a zkdv.GradientBounds or None")
        chunk = self.chunk_bytes
        if chunk < 64 or chunk & (chunk - 1):
            raise ValueError(f"ZKDVConfig chunk_bytes={chunk} must be a power of two >= 64")
        if self.token_unit not in TOKEN_UNITS:
            raise ValueError(
                f"ZKDVConfig token_unit={self.token_unit!r} must be one of "
                f"{', '.join(map(repr, TOKEN_UNITS))}"
            )
        if self.commitments not in COMMITMENT_PATHS:
            raise ValueError(
                f"ZKDVConfig commitments={self.commitments!r} must be one of "
                f"{', '.join(map(repr, COMMITMENT_PATHS))}"
            )
        if self.gradient_files not in GRADIENT_FILES:
            raise ValueError(
                f"ZKDVConfig gradient_files={self.gradient_files!r} must be one of "
                f"{', '.join(map(repr, GRADIENT_FILES))}"
            )

    def to_dict(self) -> dict[str, Any]:
        # ``commitments`` is left out on purpose: the transcript does not depend on it.
        # ``gradient_files`` is recorded as resolved for the run (``ZKDVCore.open``).
        return {
            "name": self.name,
            "sampling": self.sampling_policy.to_dict(),
            "tolerance": self.tolerance.to_dict(),
            "chunk_bytes": self.chunk_bytes,
            "token_unit": self.token_unit,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ZKDVConfig:
        bounds = data.get("bounds")
        return cls(
            name=str(data["name"]),
            sampling_policy=SamplingPolicy.from_dict(data["sampling"]),
            tolerance=FloatTolerance.from_dict(data["tolerance"]),
            chunk_bytes=int(data["chunk_bytes"]),
            gradient_bounds=None if bounds is None else GradientBounds.from_dict(bounds),
            token_unit=str(data.get("token_unit", DEFAULT_TOKEN_UNIT)),
        )
