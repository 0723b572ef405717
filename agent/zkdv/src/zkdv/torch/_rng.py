"""Random operators in the attested step, drawn from a committed seed.

Dropout is on by default in most transformer configurations, so the attested step may
draw random numbers, on one condition: a replay must draw exactly the same ones. ZKDV
therefore owns the generator of every random operator in the step:

* the root record commits a run seed (``env.rng``, derived from ``torch.initial_seed()``
  when the program is sealed, so a script that seeds Torch reruns identically);
* each step's seed is :func:`step_seed` of the run seed, the step index and the rank;
* in training, :class:`StepGenerators` seeds Torch's default generator of the model's
  device (and the CPU's) with the step seed when the transaction opens, and gives the
  caller's generator state back when it closes, so the caller's own random stream
  (shuffling, augmentation outside the transaction) is untouched;
* a sampled check and the platform's replay run the sealed program with every random
  operator's ``generator`` argument bound to a private generator seeded with the same
  step seed (:func:`bind_generator`), so they draw the same numbers in the same order
  as the eager step did, without touching the global generators that training, on
  another thread, is using.

Only random operators whose schema takes a generator (``bernoulli_``, ``rand``,
``normal``, ``multinomial``, ...: everything CPU dropout and the math attention path
use) can be bound. Operators that draw from a global generator with no such argument
(CUDA's fused ``native_dropout``, attention kernels with a positive ``dropout_p``) are
refused at sealing (:func:`random_kind`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx

from zkdv.hashing import Domain, hash_bytes

__all__ = [
    "DETERMINISTIC",
    "GENERATOR_ATTRIBUTE",
    "RESTORED",
    "RNG_VERSION",
    "SEEDABLE",
    "UNSEEDABLE",
    "StepGenerators",
    "bind_generator",
    "random_kind",
    "run_seed",
    "step_seed",
    "watch_restores",
]

#: ``env.rng.derivation`` of :func:`step_seed`.
RNG_VERSION = "zkdv-torch-rng-v1"
#: :func:`random_kind` of a node: no randomness, a generator ZKDV can seed, or neither.
DETERMINISTIC, SEEDABLE, UNSEEDABLE = "deterministic", "seedable", "unseedable"
#: The attribute of a bound program holding its private generator.
GENERATOR_ATTRIBUTE = "_zkdv_generator"

_RANDOM_MARKERS = (
    "bernoulli",
    "dropout",
    "exponential",
    "multinomial",
    "normal",
    "rand",
    "uniform",
)
# Torch seeds are 64-bit; keep them positive so every API accepts them.
_SEED_MASK = (1 << 63) - 1


def _schema(node: fx.Node) -> Any:
    if node.op != "call_function":
        return None
    return getattr(node.target, "_schema", None)


def random_kind(node: fx.Node) -> str:
    """Whether ``node`` draws random numbers, and whether ZKDV can seed what it draws.

    A random operator whose schema takes a ``generator`` can be given ZKDV's per-step
    generator; a random operator without one (CUDA's fused ``native_dropout``, attention
    kernels with a positive ``dropout_p``) draws from a global generator that a replay
    on another thread cannot share.
    """
    schema = _schema(node)
    if schema is None:
        return DETERMINISTIC
    names = [argument.name for argument in schema.arguments]
    if "generator" in names:
        return SEEDABLE
    if "dropout_p" in names:
        position = names.index("dropout_p")
        value = node.kwargs.get(
            "dropout_p", node.args[position] if position < len(node.args) else 0.0
        )
        return UNSEEDABLE if value else DETERMINISTIC
    if any(marker in str(schema.name) for marker in _RANDOM_MARKERS):
        return UNSEEDABLE
    return DETERMINISTIC


def run_seed() -> int:
    """The run seed committed in the root record: Torch's initial seed, as the user set it."""
    return int(torch.initial_seed()) & _SEED_MASK


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed of one step's random operators on one rank (``RNG_VERSION``)."""
    material = b"".join(value.to_bytes(8, "little") for value in (seed, step, rank))
    return int.from_bytes(hash_bytes(Domain.RNG, material)[:8], "little") & _SEED_MASK


class StepGenerators:
    """Seed Torch's default generators for one eager step; restore them afterwards.

    Args:
        seed: the step seed (:func:`step_seed`).
        devices: the devices whose default generator the step may draw from (the CPU's
            is always included).
    """

    def __init__(self, seed: int, devices: Iterable[torch.device]) -> None:
        self.seed = seed
        self.cuda = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self._saved: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def __enter__(self) -> StepGenerators:
        cuda_states = [torch.cuda.get_rng_state(index) for index in self.cuda]
        self._saved = (torch.get_rng_state(), cuda_states)
        torch.default_generator.manual_seed(self.seed)
        for index in self.cuda:
            torch.cuda.default_generators[index].manual_seed(self.seed)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is None:
            return
        cpu, cuda_states = self._saved
        torch.set_rng_state(cpu)
        for index, state in zip(self.cuda, cuda_states, strict=True):
            torch.cuda.set_rng_state(state, index)
        self._saved = None


RESTORED = (
    "the attested step sets a random generator's state back while it draws random "
    "numbers ({where}); activation checkpointing does so to redraw dropout's masks when it "
    "recomputes, which a replay drawing every random operator from one seeded stream "
    "cannot reproduce. Turn dropout off in checkpointed blocks, or do not checkpoint"
)


@contextlib.contextmanager
def watch_restores(found: list[str]) -> Iterator[None]:
    """Note in ``found`` every ``set_rng_state`` call inside the block (during tracing)."""
    modules = [(torch, "set_rng_state"), (torch.random, "set_rng_state")]
    if torch.cuda.is_available():
        modules.append((torch.cuda, "set_rng_state"))
    originals = [(module, name, getattr(module, name)) for module, name in modules]

    def noting(original: Any, where: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            found.append(where)
            return original(*args, **kwargs)

        return call

    for module, name, original in originals:
        setattr(module, name, noting(original, f"{module.__name__}.{name}"))
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def bind_generator(module: fx.GraphModule) -> bool:
    """Route every seedable random operator of ``module`` through its own generator.

    Each random node gets ``generator=self._zkdv_generator``; the caller sets that
    attribute to a seeded ``torch.Generator`` before each call. Returns whether the
    module draws random numbers at all.
    """
    nodes = [node for node in module.graph.nodes if random_kind(node) == SEEDABLE]
    if not nodes:
        return False
    setattr(module, GENERATOR_ATTRIBUTE, None)
    first = next(node for node in module.graph.nodes if node.op != "placeholder")
    with module.graph.inserting_before(first), warnings.catch_warnings():
        # FX warns that the attribute is not a submodule, parameter or buffer: it is a
        # plain attribute on purpose, set before every call.
        warnings.simplefilter("ignore", UserWarning)
        generator = module.graph.get_attr(GENERATOR_ATTRIBUTE)
    for node in nodes:
        node.update_kwarg("generator", generator)
    module.recompile()
    return True
