"""Replay environments: the platform kind of a run and what changes its bits.

A step replays bit for bit only in the *replay environment* the run trained in: the
same platform kind (``cpu``, ``gpu``, ``tpu``), chip generation, library versions and
the flags that change the code the compiler or the kernels choose. The root record's
``env`` states them (written by ``zkdv.jax`` and ``zkdv.torch``), and
:func:`replay_environment` reads them back into one key. That key is the one
definition that the platform's routing (a run's replays go to workers of its kind),
its provers (exact where the keys match, bounds where they differ) and its
certificate (which environment replayed which steps) share.

Framework-free: it reads dictionaries, so the platform and the offline tools use it
without JAX or Torch. A worker describes itself as a root would (``{"prover": ...,
"env": ...}``, its prover's ``environment()``), and :func:`differences` names the keys
in which it differs from the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "PLATFORM_KINDS",
    "differences",
    "exact_keys",
    "kind_of_backend",
    "platform_kind",
    "replay_environment",
]

#: The platform kinds a run can train on; each has its own replay queue on the platform.
PLATFORM_KINDS = ("cpu", "gpu", "tpu")

#: Per prover, the root ``env`` entries that change a step's bits on every platform kind.
#: JAX: one compiled program gives the same bits only on the same backend, XLA build,
#: device kinds, CPU (model, features, the instruction set XLA compiles for), thread
#: count, ``XLA_FLAGS``, 64-bit mode and default matmul precision. Torch: eager ATen
#: kernels of one Torch version on one device kind and CPU kernel family (the replay
#: adopts the run's thread count and matmul precision itself, so they are not keys).
_KEYS: Mapping[str, tuple[str, ...]] = {
    "whitebox-jax": (
        "jax_platform",
        "jaxlib",
        "devices",
        "threads",
        "cpu_isa",
        "cpu_model",
        "cpu_features",
        "xla_flags",
        "x64",
        "matmul_precision",
    ),
    "whitebox-torch": ("torch", "device_kind", "cpu_capability"),
}

#: Per prover, the entries that change the bits on an accelerator besides those: the
#: runtime under the compiler (libtpu on a TPU, CUDA on a GPU), its version as the
#: backend reports it, and the runtime's own flags (``LIBTPU_INIT_ARGS``). Not keys of
#: a CPU run: runs recorded before them stay exact on the CPU they trained on.
_ACCELERATOR_KEYS: Mapping[str, tuple[str, ...]] = {
    "whitebox-jax": ("platform_version", "libtpu", "libtpu_init_args"),
    "whitebox-torch": ("cuda", "cudnn"),
}

_BACKEND_KINDS = {"cpu": "cpu", "tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}


def exact_keys(prover: str) -> tuple[str, ...]:
    """The root ``env`` entries that change ``prover``'s bits on every platform kind."""
    return _KEYS[prover]


def kind_of_backend(backend: str) -> str:
    """The platform kind of a JAX backend (``jax.default_backend()``) or Torch device
    type (``torch.device.type``): ``cuda`` and ``rocm`` are ``gpu``; an unknown name is
    its own kind (no worker serves it unless an operator says so)."""
    name = str(backend).lower().partition(":")[0]
    return _BACKEND_KINDS.get(name, name)


def platform_kind(root: Mapping[str, Any]) -> str:
    """The platform kind a run trained on, from its root record.

    ``env.platform_kind`` where recorded; a root written before it is read from the
    backend it names (``env.jax_platform``, Torch's ``env.device``); a root that names
    neither (a framework-free synthetic run) trained on a CPU.
    """
    env = root.get("env") if isinstance(root, Mapping) else None
    env = env if isinstance(env, Mapping) else {}
    recorded = env.get("platform_kind")
    if isinstance(recorded, str) and recorded:
        return recorded
    for backend in (env.get("jax_platform"), env.get("device")):
        if isinstance(backend, str) and backend:
            return kind_of_backend(backend)
    return "cpu"


def replay_environment(root: Mapping[str, Any]) -> dict[str, Any]:
    """The replay environment key of a root record (or of a worker, described as one).

    Args:
        root: the root record, or ``{"prover": name, "env": values}``.

    Returns:
        ``{"prover", "platform_kind", ...}`` and every ``env`` entry that changes the
        prover's bits on that kind (module docstring); an entry the record lacks is None.
        Two runs (or a run and a worker) with equal keys compute the same bits.
    """
    prover = str(root.get("prover"))
    env = root.get("env")
    env = env if isinstance(env, Mapping) else {}
    kind = platform_kind(root)
    names = _KEYS.get(prover, ())
    if kind != "cpu":
        names += _ACCELERATOR_KEYS.get(prover, ())
    key: dict[str, Any] = {"prover": prover, "platform_kind": kind}
    key.update({name: env.get(name) for name in names})
    return key


def differences(root: Mapping[str, Any], worker: Mapping[str, Any]) -> list[str]:
    """The keys of :func:`replay_environment` in which ``worker`` differs from ``root``.

    Empty exactly when a replay on ``worker`` reproduces the run's bits. A key the root
    does not record counts as a difference (a run from before it was recorded is never
    claimed exact), except a kind derived from the backend the root names.

    Args:
        root: the run's root record.
        worker: the worker, described as a root (``{"prover": ..., "env": ...}``).

    Returns:
        The differing key names, in the key's order.
    """
    ours, theirs = replay_environment(root), replay_environment(worker)
    env = root.get("env")
    env = env if isinstance(env, Mapping) else {}
    derived = {"prover", "platform_kind"}
    names = list(dict.fromkeys([*ours, *theirs]))
    return [
        name
        for name in names
        if ours.get(name) != theirs.get(name) or (name not in derived and name not in env)
    ]
