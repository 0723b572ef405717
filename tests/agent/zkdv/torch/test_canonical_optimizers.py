"""The canonical optimizer update: its definition, its reproducibility, its optimizer.

Four claims, four kinds of test:

1. The Torch implementation is exactly zkdv-torch-canonical-v1: after several steps,
   parameters and every state entry are bitwise equal to an independent NumPy
   reference of the same formulas (float32 ufuncs, division and square root through
   float64, host scalars rounded with ``np.float32``), for every supported optimizer
   and a matrix of options, two groups each, float32, bfloat16 and float16.
2. It is reproducible: the bytes of five steps hash the same under
   ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512`` (those the CPU has) and under
   1, 2 and 4 threads.
3. It is the same optimizer as ``torch.optim``'s native step: over 20 steps of a
   training-like loop the parameters differ by at most 1e-5 of their largest magnitude.
4. It says why it does not cover a group, and refuses what it does not cover.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.processes import start, wait_all
from tests.sources import AGENT_PYTHONPATH
from zkdv.calibrate import kernel_families
from zkdv.torch.optimizers import (
    OptimizerRegistry,
    _adam_inplace,
    _arithmetic,
    canonical,
    pack_optimizer_state,
)
from zkdv.torch.optimizers.canonical import CANONICAL_VERSION, supports, update

REPO_ROOT = Path(__file__).resolve().parents[4]
STEPS = 8
NATIVE_STEPS = 20
NATIVE_RTOL = 1e-5  # of the parameter's largest magnitude; measured ~3e-7
SHAPES = ((4, 5), (7,)), ((3, 3),)
# Over 32768 elements (Torch's parallel grain) so several threads share one kernel,
# and odd sizes so every vector loop has a tail.
HASH_SHAPES = ((129, 257), (37,)), ((3, 11),)
HASH_STEPS = 5

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: Every stored NaN, as float32 bits (bfloat16 0x7FC0 and float16 0x7E00 widen to it).
CANONICAL_NAN = np.array(0x7FC00000, dtype=np.uint32).view(np.float32)

#: (optimizer, options of its two groups, parameter dtype)
CASES: list[tuple[str, tuple[dict[str, Any], dict[str, Any]], torch.dtype]] = [
    ("Adam", ({}, {"weight_decay": 0.1}), F32),
    ("Adam", ({"amsgrad": True}, {"amsgrad": True, "weight_decay": 0.05, "maximize": True}), F32),
    ("Adam", ({"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6}, {"lr": 0.1}), F32),
    ("Adam", ({"decoupled_weight_decay": True, "weight_decay": 0.1}, {}), F32),
    ("Adam", ({}, {"amsgrad": True, "weight_decay": 0.1}), BF16),
    ("Adam", ({"eps": 1e-4}, {"maximize": True}), F16),
    ("AdamW", ({}, {"weight_decay": 0.0}), F32),
    ("AdamW", ({"amsgrad": True, "maximize": True}, {"weight_decay": 0.5, "lr": 0.05}), F32),
    ("AdamW", ({"amsgrad": True}, {"weight_decay": 0.1}), BF16),
    ("SGD", ({"lr": 0.1}, {"lr": 0.05, "weight_decay": 0.01}), F32),
    ("SGD", ({"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}), F32),
    (
        "SGD",
        (
            {"lr": 0.1, "momentum": 0.9, "nesterov": True},
            {"lr": 0.1, "momentum": 0.5, "nesterov": True, "weight_decay": 0.1, "maximize": True},
        ),
        F32,
    ),
    (
        "SGD",
        (
            {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "maximize": True},
            {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        ),
        BF16,
    ),
    ("SGD", ({"lr": 0.1, "momentum": 0.9}, {"lr": 0.2, "weight_decay": 0.1}), F16),
    ("RMSprop", ({}, {"weight_decay": 0.1, "maximize": True}), F32),
    ("RMSprop", ({"centered": True}, {"momentum": 0.9}), F32),
    ("RMSprop", ({"centered": True, "momentum": 0.5, "alpha": 0.9}, {"weight_decay": 0.1}), BF16),
    ("Adagrad", ({}, {"lr_decay": 0.01, "weight_decay": 0.1}), F32),
    ("Adagrad", ({"initial_accumulator_value": 0.5, "maximize": True}, {"eps": 1e-6}), F32),
    ("Adagrad", ({"lr_decay": 0.01}, {"weight_decay": 0.1}), BF16),
    ("Adamax", ({}, {"weight_decay": 0.1}), F32),
    ("Adamax", ({"maximize": True}, {"betas": (0.5, 0.9)}), BF16),
    ("NAdam", ({}, {"weight_decay": 0.1}), F32),
    (
        "NAdam",
        (
            {"decoupled_weight_decay": True, "weight_decay": 0.1},
            {"momentum_decay": 0.01, "maximize": True},
        ),
        F32,
    ),
    ("NAdam", ({}, {"weight_decay": 0.1, "decoupled_weight_decay": True}), BF16),
    # betas (0.9, 0.9) cross RAdam's rho > 5 threshold at step 4, (0.9, 0.999) at step 6.
    ("RAdam", ({}, {"weight_decay": 0.1, "betas": (0.9, 0.9)}), F32),
    ("RAdam", ({"decoupled_weight_decay": True, "weight_decay": 0.1}, {"maximize": True}), F32),
    ("RAdam", ({"betas": (0.9, 0.9)}, {"weight_decay": 0.1}), BF16),
]


def _case_id(case: tuple[str, tuple[dict[str, Any], dict[str, Any]], torch.dtype]) -> str:
    name, options, dtype = case
    flags = "|".join(
        ",".join(f"{key}={value}" for key, value in sorted(group.items())) or "defaults"
        for group in options
    )
    return f"{name}-{str(dtype).removeprefix('torch.')}-{flags}"


# --- the NumPy reference of zkdv-torch-canonical-v1 ---------------------------------------------
# Written from the definition in the module docstring, not from the module: float32
# ufuncs (each IEEE-754 correctly rounded), division and square root through float64,
# host scalars in Python float64 rounded with np.float32. Only NAdam's libm-free real
# power is the module's own (its exact bits are pinned in test_host_scalars_are_pinned).

Entries = dict[str, Any]


def _f32(value: float) -> np.float32:
    return np.float32(value)


def _power(base: float, exponent: int) -> float:
    result, square = 1.0, base
    while exponent:
        if exponent & 1:
            result *= square
        square *= square
        exponent >>= 1
    return result


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a.astype(np.float64) / b.astype(np.float64)).astype(np.float32)


def _sqrt(a: np.ndarray) -> np.ndarray:
    return np.sqrt(a.astype(np.float64)).astype(np.float32)


def _bfloat16(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 (round to nearest, ties to even), kept in float32 storage."""
    bits = x.astype(np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    quiet = bits | np.uint32(0x00400000)  # a NaN stays a NaN (its low payload bits go)
    rounded = np.where(np.isnan(x), quiet, rounded)
    return (rounded & np.uint32(0xFFFF0000)).view(np.float32)


def _round(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if dtype == torch.bfloat16:
        return _bfloat16(x)
    if dtype == torch.float16:
        return x.astype(np.float16).astype(np.float32)
    return x.astype(np.float32)


def _gradient(grad: np.ndarray, group: dict[str, Any]) -> np.ndarray:
    return -grad if group["maximize"] else grad


def _decay(
    p: np.ndarray, g: np.ndarray, group: dict[str, Any], decoupled: bool
) -> tuple[np.ndarray, np.ndarray]:
    lr, wd = group["lr"], group["weight_decay"]
    if wd == 0:
        return p, g
    if decoupled:
        return p * _f32(1.0 - lr * wd), g
    return p, g + p * _f32(wd)


def _moments(
    entries: Entries, g: np.ndarray, group: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    b1, b2 = group["betas"]
    m = entries["exp_avg"] * _f32(b1) + g * _f32(1.0 - b1)
    v = entries["exp_avg_sq"] * _f32(b2) + (g * g) * _f32(1.0 - b2)
    return m, v


def ref_adam(
    entries: Entries, grad: np.ndarray, group: dict[str, Any], decoupled: bool
) -> dict[str, Any]:
    b1, b2 = group["betas"]
    entries["step"] += 1
    t = entries["step"]
    decoupled = decoupled or group.get("decoupled_weight_decay", False)
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, decoupled)
    m, v = _moments(entries, g, group)
    out = {"exp_avg": m, "exp_avg_sq": v}
    if group["amsgrad"]:
        v = out["max_exp_avg_sq"] = np.maximum(entries["max_exp_avg_sq"], v)
    denom = _sqrt(v) * _f32(1.0 / math.sqrt(1.0 - _power(b2, t))) + _f32(group["eps"])
    out["param"] = p - _div(m, denom) * _f32(group["lr"] / (1.0 - _power(b1, t)))
    return out


def ref_sgd(entries: Entries, grad: np.ndarray, group: dict[str, Any]) -> dict[str, Any]:
    momentum = group["momentum"]
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, decoupled=False)
    out = {}
    if momentum != 0:
        buf = entries["momentum_buffer"]
        # torch.optim's first buffer is the gradient itself
        buf = g if buf is None else buf * _f32(momentum) + g * _f32(1.0 - group["dampening"])
        out["momentum_buffer"] = buf
        g = g + buf * _f32(momentum) if group["nesterov"] else buf
    out["param"] = p - g * _f32(group["lr"])
    return out


def ref_rmsprop(entries: Entries, grad: np.ndarray, group: dict[str, Any]) -> dict[str, Any]:
    alpha = group["alpha"]
    entries["step"] += 1
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, decoupled=False)
    square_avg = entries["square_avg"] * _f32(alpha) + (g * g) * _f32(1.0 - alpha)
    out = {"square_avg": square_avg}
    if group["centered"]:
        grad_avg = entries["grad_avg"] * _f32(alpha) + g * _f32(1.0 - alpha)
        out["grad_avg"] = grad_avg
        denom = _sqrt(square_avg - grad_avg * grad_avg) + _f32(group["eps"])
    else:
        denom = _sqrt(square_avg) + _f32(group["eps"])
    if group["momentum"] > 0:
        buf = entries["momentum_buffer"] * _f32(group["momentum"]) + _div(g, denom)
        out["momentum_buffer"] = buf
        out["param"] = p - buf * _f32(group["lr"])
    else:
        out["param"] = p - _div(g, denom) * _f32(group["lr"])
    return out


def ref_adagrad(entries: Entries, grad: np.ndarray, group: dict[str, Any]) -> dict[str, Any]:
    entries["step"] += 1
    t = entries["step"]
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, decoupled=False)
    total = entries["sum"] + g * g
    clr = _f32(group["lr"] / (1.0 + (t - 1) * group["lr_decay"]))
    param = p - _div(g, _sqrt(total) + _f32(group["eps"])) * clr
    return {"sum": total, "param": param}


def ref_adamax(entries: Entries, grad: np.ndarray, group: dict[str, Any]) -> dict[str, Any]:
    b1, b2 = group["betas"]
    entries["step"] += 1
    t = entries["step"]
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, decoupled=False)
    m = entries["exp_avg"] * _f32(b1) + g * _f32(1.0 - b1)
    norm = np.maximum(entries["exp_inf"] * _f32(b2), np.abs(g) + _f32(group["eps"]))
    param = p - _div(m, norm) * _f32(group["lr"] / (1.0 - _power(b1, t)))
    return {"exp_avg": m, "exp_inf": norm, "param": param}


def ref_nadam(entries: Entries, grad: np.ndarray, group: dict[str, Any]) -> dict[str, Any]:
    b1, b2 = group["betas"]
    lr, psi = group["lr"], group["momentum_decay"]
    entries["step"] += 1
    t = entries["step"]
    mu = b1 * (1.0 - 0.5 * _arithmetic.real_power(0.96, t * psi))
    mu_next = b1 * (1.0 - 0.5 * _arithmetic.real_power(0.96, (t + 1) * psi))
    mu_product = float(np.float32(entries["mu_product"]) * _f32(mu))
    entries["mu_product"] = mu_product
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, group["decoupled_weight_decay"])
    m, v = _moments(entries, g, group)
    denom = _sqrt(v * _f32(1.0 / (1.0 - _power(b2, t)))) + _f32(group["eps"])
    p = p - _div(g, denom) * _f32(lr * (1.0 - mu) / (1.0 - mu_product))
    p = p - _div(m, denom) * _f32(lr * mu_next / (1.0 - mu_product * mu_next))
    return {"exp_avg": m, "exp_avg_sq": v, "param": p}


def ref_radam(entries: Entries, grad: np.ndarray, group: dict[str, Any]) -> dict[str, Any]:
    b1, b2 = group["betas"]
    lr = group["lr"]
    entries["step"] += 1
    t = entries["step"]
    g = _gradient(grad, group)
    p, g = _decay(entries["param"], g, group, group["decoupled_weight_decay"])
    m, v = _moments(entries, g, group)
    bc1, b2t = 1.0 - _power(b1, t), _power(b2, t)
    bc2 = 1.0 - b2t
    rho_inf = 2.0 / (1.0 - b2) - 1.0
    rho = rho_inf - 2.0 * t * b2t / bc2
    if rho > 5.0:
        rect = math.sqrt(
            (rho - 4.0) * (rho - 2.0) * rho_inf / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho)
        )
        scale = _f32(lr * rect * math.sqrt(bc2) / bc1)
        p = p - _div(m, _sqrt(v) + _f32(group["eps"])) * scale
    else:
        p = p - m * _f32(lr / bc1)
    return {"exp_avg": m, "exp_avg_sq": v, "param": p}


REFERENCES: dict[str, Callable[[Entries, np.ndarray, dict[str, Any]], dict[str, Any]]] = {
    "Adam": lambda e, g, group: ref_adam(e, g, group, decoupled=False),
    "AdamW": lambda e, g, group: ref_adam(e, g, group, decoupled=True),
    "SGD": ref_sgd,
    "RMSprop": ref_rmsprop,
    "Adagrad": ref_adagrad,
    "Adamax": ref_adamax,
    "NAdam": ref_nadam,
    "RAdam": ref_radam,
}


def reference_step(
    entries: Entries, grad: np.ndarray, group: dict[str, Any], name: str, dtype: torch.dtype
) -> None:
    """One reference step of one parameter: compute at float32, then round to storage."""
    with np.errstate(all="ignore"):  # NaN and infinity are values like any other
        new = REFERENCES[name](entries, grad, group)
    for key, value in new.items():
        rounded = _round(value, dtype)
        entries[key] = np.where(np.isnan(rounded), CANONICAL_NAN, rounded)


# --- harness --------------------------------------------------------------------------------
class Run:
    """A torch.optim optimizer whose state the bridge's contracts created eagerly."""

    def __init__(self, name: str, options, dtype: torch.dtype, shapes=SHAPES) -> None:
        self.name, self.dtype = name, dtype
        rng = np.random.default_rng(1234)
        self.values = [
            [_round(rng.standard_normal(shape).astype(np.float32), dtype) for shape in group]
            for group in shapes
        ]
        self.params = [
            [torch.from_numpy(value).to(dtype).requires_grad_() for value in group]
            for group in self.values
        ]
        self.optimizer = getattr(torch.optim, name)(
            [{"params": params, **opts} for params, opts in zip(self.params, options, strict=True)]
        )
        contract = OptimizerRegistry().resolve(self.optimizer)
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                self.optimizer.state[param].update(contract.initialize(param.detach(), group))

    def canonical_step(self, grads: Sequence[Sequence[np.ndarray | None]]) -> None:
        for group, group_grads in zip(self.optimizer.param_groups, grads, strict=True):
            update(
                self.name,
                group["params"],
                [None if g is None else torch.from_numpy(g).to(self.dtype) for g in group_grads],
                [self.optimizer.state[param] for param in group["params"]],
                group,
            )

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and state entry, by a stable name."""
        out = {}
        for g, group in enumerate(self.optimizer.param_groups):
            for index, param in enumerate(group["params"]):
                out[f"{g}.{index}.param"] = param
                for key, value in sorted(self.optimizer.state[param].items()):
                    if isinstance(value, torch.Tensor):
                        out[f"{g}.{index}.{key}"] = value
        return out


def _gradients(rng: np.random.Generator, shapes, dtype: torch.dtype) -> list[list[np.ndarray]]:
    """Gradients over a wide range of magnitudes: squares reach float32's subnormals."""
    out = []
    for group in shapes:
        grads = []
        for shape in group:
            scale = 10.0 ** rng.uniform(-24, 1, size=shape)
            grads.append(_round((rng.standard_normal(shape) * scale).astype(np.float32), dtype))
        out.append(grads)
    return out


def _numpy(tensor: torch.Tensor | None) -> np.ndarray:
    assert tensor is not None
    return tensor.detach().numpy()


def _tensor(values: Any) -> torch.Tensor:
    """A float32 tensor of ``values``, a 0-d array included."""
    return torch.from_numpy(np.asarray(values, dtype=np.float32))


def _bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().float().numpy().view(np.uint32)


# --- 1. bitwise equal to the reference ---------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_it_equals_the_numpy_reference_bit_for_bit(case) -> None:
    name, options, dtype = case
    run = Run(name, options, dtype)
    reference = []
    for group, values in zip(run.optimizer.param_groups, run.values, strict=True):
        entries = []
        for param, value in zip(group["params"], values, strict=True):
            state = run.optimizer.state[param]
            entry: Entries = {"param": value.copy()}
            for key, item in state.items():
                if key == "step":
                    entry[key] = int(item.item())
                elif key == "mu_product":
                    entry[key] = float(item.item())
                else:
                    entry[key] = None if item is None else item.detach().float().numpy().copy()
            entries.append(entry)
        reference.append(entries)

    rng = np.random.default_rng(99)
    for step in range(STEPS):
        grads: list[list[np.ndarray | None]] = [list(g) for g in _gradients(rng, SHAPES, dtype)]
        if step == 3:
            grads[1][0] = None  # skipped, as torch.optim skips a parameter without gradient
        run.canonical_step(grads)
        for group, entries, group_grads in zip(
            run.optimizer.param_groups, reference, grads, strict=True
        ):
            for entry, grad in zip(entries, group_grads, strict=True):
                if grad is not None:
                    reference_step(entry, grad, group, name, dtype)

    assert reference[1][0].get("step", STEPS - 1) == STEPS - 1  # one step was skipped
    for group, entries in zip(run.optimizer.param_groups, reference, strict=True):
        for param, entry in zip(group["params"], entries, strict=True):
            state = run.optimizer.state[param]
            assert param.dtype == dtype
            np.testing.assert_array_equal(_bits(param), entry["param"].view(np.uint32))
            assert set(state) == set(entry) - {"param"}
            for key, value in state.items():
                if key == "step":
                    assert value.dtype == torch.float32 and value.device.type == "cpu"
                    assert value.item() == entry["step"]
                elif key == "mu_product":
                    assert value.dtype == torch.float32 and value.item() == entry[key]
                else:
                    assert value.dtype == dtype, key
                    np.testing.assert_array_equal(
                        _bits(value), entry[key].view(np.uint32), err_msg=key
                    )


def test_division_and_square_root_are_correctly_rounded() -> None:
    """div32 and sqrt32 equal NumPy's IEEE float32 divide and sqrt, subnormals included."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 0x7F800000, size=300_000, dtype=np.uint32).view(np.float32)
    b = rng.integers(0, 0x7F800000, size=300_000, dtype=np.uint32).view(np.float32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        quotient = a / b
    kept = np.isfinite(quotient) & (b != 0)
    got = _arithmetic.div32(torch.from_numpy(a[kept]), torch.from_numpy(b[kept])).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), quotient[kept].view(np.uint32))
    got = _arithmetic.sqrt32(torch.from_numpy(a)).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), np.sqrt(a).view(np.uint32))


def test_host_scalars_are_pinned() -> None:
    """The host scalars are part of the definition: their bits must never change."""
    assert _arithmetic.power(0.999, 1000) == _power(0.999, 1000)
    assert _arithmetic.power(0.999, 1000).hex() == "0x1.788526411edacp-2"  # ** gives ...ed72
    assert math.isclose(_arithmetic.power(0.999, 12345), 0.999**12345, rel_tol=1e-12)
    for exponent in (0.004, 0.4, 4.0, 1234.5 * 0.004):
        assert math.isclose(_arithmetic.real_power(0.96, exponent), 0.96**exponent, rel_tol=1e-14)
    assert _arithmetic.real_power(0.96, 0.004).hex() == "0x1.ffea9969757dbp-1"
    assert _arithmetic.real_power(0.96, 4.0).hex() == "0x1.b2dd8d6457178p-1"
    assert _arithmetic.f32(0.1) == float(np.float32(0.1))


@pytest.mark.parametrize(
    ("dtype", "integer", "bits"),
    [(F32, torch.int32, 0x7FC00000), (BF16, torch.int16, 0x7FC0), (F16, torch.int16, 0x7E00)],
)
@pytest.mark.parametrize("name", ["Adam", "SGD", "RMSprop"])
def test_it_stores_one_canonical_nan(name: str, dtype, integer, bits) -> None:
    """NaN signs and payloads differ by kernel; the stored NaN is always the same one."""
    options = {"Adam": {}, "SGD": {"lr": 0.1, "momentum": 0.9}, "RMSprop": {"centered": True}}
    run = Run(name, (options[name], options[name]), dtype)
    rng = np.random.default_rng(3)
    for _ in range(2):
        grads = _gradients(rng, SHAPES, F32)
        flat = grads[0][0].reshape(-1)
        flat[:3] = np.array([0xFFC00000, 0x7FC00001, 0xFF800001], dtype=np.uint32).view(np.float32)
        run.canonical_step([[_round(g, dtype) for g in group] for group in grads])
    stored = [t for t in run.tensors().values() if t.dtype == dtype]
    assert any(torch.isnan(t).any() for t in stored)
    for tensor in stored:
        raw = tensor.detach().view(integer)[torch.isnan(tensor)]
        assert (raw == bits).all(), raw


def test_it_updates_state_views_in_place() -> None:
    """The bridge packs state into shared buffers: the update must write through views."""
    run = Run("Adam", ({"amsgrad": True}, {}), F32)
    pack_optimizer_state(run.optimizer)
    before = {name: (id(t), t.data_ptr()) for name, t in run.tensors().items()}
    run.canonical_step(_gradients(np.random.default_rng(0), SHAPES, F32))
    after = {name: (id(t), t.data_ptr()) for name, t in run.tensors().items()}
    assert before == after
    assert all(run.optimizer.state[p]["step"].item() == 1 for p in run.optimizer.state)


# --- 2. identical bits across CPU kernel families and thread counts -----------------------------
def fingerprints() -> dict[str, Any]:
    """SHA-256 of every case's tensors after HASH_STEPS steps, per thread count."""
    import hashlib

    out: dict[str, Any] = {"capability": torch.backends.cpu.get_cpu_capability()}
    rng = np.random.default_rng(2024)
    steps = {
        dtype: [_gradients(rng, HASH_SHAPES, dtype) for _ in range(HASH_STEPS)]
        for dtype in (F32, BF16, F16)
    }
    for threads in (1, 2, 4):
        torch.set_num_threads(threads)
        digest = hashlib.sha256()
        for name, options, dtype in CASES:
            run = Run(name, options, dtype, HASH_SHAPES)
            for grads in steps[dtype]:
                run.canonical_step(grads)
            for key, tensor in run.tensors().items():
                digest.update(key.encode())
                digest.update(
                    tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                )
        out[str(threads)] = digest.hexdigest()
    return out


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 kernel families")
@pytest.mark.timeout(600)  # its processes have 300 s
def test_it_is_identical_across_cpu_kernels_and_threads(tmp_path: Path) -> None:
    environment = {
        **os.environ,
        # The repository too: this file runs as the script, and imports tests.sources.
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), AGENT_PYTHONPATH]),
        # Three processes of up to four OpenMP threads share the CPUs: threads that
        # spin while they wait would take twice as long (the results are the same).
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    processes = {
        capability: start(
            [sys.executable, __file__, "--fingerprints"],
            folder=tmp_path,
            name=capability,
            env={**environment, "ATEN_CPU_CAPABILITY": capability},
        )
        # Only the families this CPU has: a forced family it lacks dies of SIGILL.
        for capability in kernel_families()
    }
    wait_all(list(processes.values()), timeout=300)
    results = {}
    for capability, process in processes.items():
        assert process.returncode == 0, process.tail()
        results[capability] = json.loads(process.stdout().strip().splitlines()[-1])
    hashes = {r[threads] for r in results.values() for threads in ("1", "2", "4")}
    assert len(hashes) == 1, results
    ran = {r["capability"] for r in results.values()}
    assert ran == {c.upper() for c in kernel_families()}, results


# --- 3. the same optimizer as torch.optim -------------------------------------------------------
@pytest.mark.parametrize("case", [c for c in CASES if c[2] == F32], ids=_case_id)
def test_it_stays_close_to_torch_optim(case) -> None:
    name, options, _ = case
    canonical_run, native_run = Run(name, options, F32), Run(name, options, F32)
    rng = np.random.default_rng(11)
    targets = [[rng.standard_normal(s).astype(np.float32) for s in group] for group in SHAPES]
    for _ in range(NATIVE_STEPS):
        noise = [[rng.standard_normal(s).astype(np.float32) * 0.1 for s in g] for g in SHAPES]
        for run in (canonical_run, native_run):
            for params, group_targets, group_noise in zip(run.params, targets, noise, strict=True):
                for param, target, extra in zip(params, group_targets, group_noise, strict=True):
                    # a quadratic loss's gradient, so rounding differences feed back
                    param.grad = (param.detach() - torch.from_numpy(target)) * 0.5
                    param.grad += torch.from_numpy(extra)
        canonical_run.canonical_step(
            [[_numpy(param.grad) for param in params] for params in canonical_run.params]
        )
        native_run.optimizer.step()
    for ours, theirs in zip(
        (p for group in canonical_run.params for p in group),
        (p for group in native_run.params for p in group),
        strict=True,
    ):
        scale = theirs.detach().abs().max().item()
        difference = (ours - theirs).detach().abs().max().item()
        assert difference <= NATIVE_RTOL * scale, (difference, scale)


# --- 4. what it does not cover ------------------------------------------------------------------
def _group(name: str, **options: Any) -> dict[str, Any]:
    parameter = torch.zeros(2, requires_grad=True)
    kind = getattr(torch.optim, name)
    extra = {"lr": 0.1} if name == "SGD" else {}
    group = kind([parameter], **{**extra, **options}).param_groups[0]
    return {key: value for key, value in group.items() if key != "params"}


@pytest.mark.parametrize("name", sorted(canonical._UPDATES))
@pytest.mark.parametrize("dtype", [F32, BF16, F16])
def test_it_supports_torch_optim_groups(name: str, dtype: torch.dtype) -> None:
    options = {"foreach": True} if name != "SGD" else {"momentum": 0.9, "nesterov": True}
    assert supports(name, _group(name, **options), [dtype]) is None


@pytest.mark.parametrize(
    ("name", "group", "dtypes", "expected"),
    [
        ("Rprop", {}, [F32], "no canonical update for torch.optim.Rprop"),
        ("Adam", {"differentiable": True}, [F32], "differentiable"),
        ("Adam", {"lr": torch.tensor(0.01)}, [F32], "['lr'] are tensors"),
        ("Adam", {"lr": math.nan}, [F32], "option lr as a finite number"),
        ("Adam", {}, [torch.float64], "not torch.float64"),
        ("SGD", {}, [F32, torch.complex64], "not torch.complex64"),
    ],
)
def test_it_says_why_it_does_not_cover_a_group(name, group, dtypes, expected) -> None:
    base = _group(name if name != "Rprop" else "Adam")
    reason = supports(name, {**base, **group}, dtypes)
    assert reason is not None and expected in reason


def test_it_refuses_what_it_does_not_cover() -> None:
    parameter = torch.zeros(3, dtype=torch.float64)
    state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    with pytest.raises(ValueError, match=r"not torch\.float64"):
        update("Adam", [parameter], [torch.zeros(3, dtype=torch.float64)], [state], _group("Adam"))
    sparse = torch.zeros(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        update("SGD", [torch.zeros(3)], [sparse], [{}], _group("SGD"))
    with pytest.raises(ValueError, match="Rprop"):
        update("Rprop", [torch.zeros(3)], [torch.zeros(3)], [{}], _group("Adam"))
    assert CANONICAL_VERSION == "zkdv-torch-canonical-v1"


if __name__ == "__main__" and sys.argv[1:] == ["--fingerprints"]:
    print(json.dumps(fingerprints()))


def _adam_options(*, decoupled: bool, amsgrad: bool, maximize: bool) -> dict[str, Any]:
    """The in-place Adam tests' group: weight decay on, each flag as the test asks."""
    return {
        "lr": 3e-3,
        "betas": (0.9, 0.95),
        "eps": 1e-8,
        "weight_decay": 0.1,
        "amsgrad": amsgrad,
        "maximize": maximize,
        "decoupled_weight_decay": decoupled,
    }


@pytest.mark.parametrize("jit", [False, True], ids=["operators", "compiled"])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_the_in_place_adam_is_the_definition_bit_for_bit(
    decoupled: bool, amsgrad: bool, maximize: bool, jit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Adam's in-place paths (what training runs: the compiled pass where Numba is
    installed, else the operators, chunked) against the one-parameter definition, across
    chunk boundaries, with a NaN in the gradient and subnormal moments."""
    monkeypatch.setenv(_adam_inplace.JIT_ENV, "1" if jit else "0")
    monkeypatch.setattr(_adam_inplace, "SMALL_GROUP_ELEMENTS", 0)  # these small groups too
    assert (_adam_inplace._kernel() is not None) == jit  # Numba is installed here
    monkeypatch.setitem(_adam_inplace.CHUNK_ELEMENTS, "cpu", 1000)  # several chunks, one partial
    rng = np.random.default_rng(7)
    group = _adam_options(decoupled=decoupled, amsgrad=amsgrad, maximize=maximize)

    def fresh() -> tuple[torch.Tensor, dict[str, Any]]:
        parameter = torch.from_numpy(rng.standard_normal(4321).astype(np.float32))
        state: dict[str, Any] = {
            "step": torch.tensor(2.0),
            "exp_avg": torch.from_numpy((rng.standard_normal(4321) * 1e-3).astype(np.float32)),
            "exp_avg_sq": torch.from_numpy((rng.random(4321) * 1e-40).astype(np.float32)),
        }
        if amsgrad:
            state["max_exp_avg_sq"] = torch.from_numpy((rng.random(4321) * 1e-6).astype(np.float32))
        return parameter, state

    parameter, state = fresh()
    gradient = torch.from_numpy((rng.standard_normal(4321) * 1e-3).astype(np.float32))
    gradient[17] = float("nan")
    twin = parameter.clone()
    twin_state = {k: v.clone() for k, v in state.items()}
    for _ in range(3):
        assert _adam_inplace.adam_in_place(parameter, gradient, state, group, decoupled=decoupled)
        canonical._adam(twin, gradient, twin_state, group, decoupled=decoupled)
    np.testing.assert_array_equal(_bits(parameter), _bits(twin))
    for key in state:
        np.testing.assert_array_equal(_bits(state[key]), _bits(twin_state[key]), err_msg=key)
    assert _bits(parameter)[17] == 0x7FC00000  # the one canonical NaN


@pytest.mark.parametrize("jit", [False, True], ids=["operators", "compiled"])
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("maximize", [False, True])
def test_a_group_of_small_and_large_parameters_is_updated_as_the_definition(
    decoupled: bool, amsgrad: bool, maximize: bool, jit: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group as transformers have them, through ``update``: small parameters updated
    together by the foreach path, in several batches, beside parameters larger than a
    chunk, at two step counts (so two sets of host scalars) and with a NaN gradient in a
    small one, against the one-parameter definition, bit for bit."""
    monkeypatch.setenv(_adam_inplace.JIT_ENV, "1" if jit else "0")
    monkeypatch.setattr(_adam_inplace, "SMALL_GROUP_ELEMENTS", 0)  # these small groups too
    monkeypatch.setitem(_adam_inplace.CHUNK_ELEMENTS, "cpu", 1000)
    rng = np.random.default_rng(11)
    group = _adam_options(decoupled=decoupled, amsgrad=amsgrad, maximize=maximize)
    shapes = [(64,), (3, 128), (2500,), (7,), (), (40, 20), (999,), (1, 1000), (0,), (12,)]
    parameters, gradients, states = [], [], []
    for index, shape in enumerate(shapes):
        parameters.append(_tensor(rng.standard_normal(shape)))
        gradient = _tensor(rng.standard_normal(shape) * 1e-3)
        state: dict[str, Any] = {
            "step": torch.tensor(float(index % 2)),
            "exp_avg": _tensor(rng.standard_normal(shape) * 1e-3),
            "exp_avg_sq": _tensor(rng.random(shape) * 1e-6),
        }
        if amsgrad:
            state["max_exp_avg_sq"] = _tensor(rng.random(shape) * 1e-6)
        if index == 3:
            gradient.view(-1)[2] = float("nan")
        gradients.append(gradient)
        states.append(state)
    twins = [parameter.clone() for parameter in parameters]
    twin_states = [{k: v.clone() for k, v in state.items()} for state in states]
    name = "AdamW" if decoupled else "Adam"
    calls: list[int] = []
    batched = _adam_inplace._adam_lists
    monkeypatch.setattr(
        _adam_inplace,
        "_adam_lists",
        lambda s, tensors, scratch: calls.append(len(tensors[0])) or batched(s, tensors, scratch),
    )
    for _ in range(3):
        update(name, parameters, gradients, states, group)
        for twin, gradient, twin_state in zip(twins, gradients, twin_states, strict=True):
            canonical._adam(twin, gradient, twin_state, group, decoupled=decoupled)
    for index, (parameter, twin) in enumerate(zip(parameters, twins, strict=True)):
        np.testing.assert_array_equal(_bits(parameter), _bits(twin), err_msg=str(shapes[index]))
        for key in states[index]:
            np.testing.assert_array_equal(
                _bits(states[index][key]), _bits(twin_states[index][key]), err_msg=key
            )
    assert _bits(parameters[3]).reshape(-1)[2] == 0x7FC00000
    if jit and not amsgrad:
        assert calls == []  # each parameter by the compiled pass (amsgrad: the operators)
        return
    # Per step: the 2,500-element parameter in three chunks; the nine others together,
    # in batches of at most 1,000 elements, one per step count.
    assert max(calls) > 1 and sum(calls) == 3 * (3 + 9)


def test_cpu_division_is_the_float64_route() -> None:
    # What lets the in-place path divide in float32 on a CPU (checked at run time too).
    assert _adam_inplace._ieee_division(torch.device("cpu"))


SMALL_MODEL_STEP = """
import sys
import numpy as np
import torch
from zkdv.batch import commit_batch
from zkdv.merkle import LeafSpec
from zkdv.probes import ProbeSet
from zkdv.torch.optimizers import _adam_inplace

commit_batch(np.arange(28, dtype=np.uint32).reshape(4, 7), 3)
probes = ProbeSet.create([LeafSpec("w", "float32", (16, 6))], 0.5, bytes(16))
probes.project_rows(0, np.ones((16, 6), np.float32))
group = {"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
         "amsgrad": False, "maximize": False}
state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(96), "exp_avg_sq": torch.zeros(96)}
assert _adam_inplace.adam_in_place(torch.ones(96), torch.ones(96), state, group, decoupled=True)
print("numba" in sys.modules)
"""


def test_a_small_models_step_never_loads_numba(tmp_path: Path) -> None:
    """A replay child of the platform commits one batch, projects one step's probes and
    updates one state of a small model: none of the compiled passes (Numba's import and
    cached kernels, about 1.2-1.5 s each) is built for sizes under their thresholds, and
    numpy and the operators give the same bits (the tests above and test_batch.py)."""
    child = start(
        [sys.executable, "-c", SMALL_MODEL_STEP],
        folder=tmp_path,
        name="small",
        env={**os.environ, "PYTHONPATH": AGENT_PYTHONPATH},
    )
    wait_all([child], timeout=120)
    assert child.process.returncode == 0, child.tail()
    assert child.stdout().strip() == "False", child.tail()
