"""What committing the gradient adds to a step's commitment work, measured side by side.

    python bench/gradient_commit.py [--rounds 5] [--only lm|mlp]

A run that commits its gradients (``docs/transcript.md``, "Committed gradients") hashes
one more state tree per step, the gradient, and projects one more probe row; training
also applies the canonical optimizer update instead of ``torch.optim``'s own. For the two
workloads of ``bench/torch_overhead.py`` (the LM, and the state-heavy 10M-parameter MLP,
both with Adam) this times, in interleaved rounds on the same host arrays:

* the present per-step commitment work: the Merkle roots of the parameters, the
  optimizer state and the buffers (native BLAKE3 on every core, ``zkdv.merkle``) and the
  pre-update, post-update and delta probes (``ProbeSet.project_steps``);
* the same with the gradient committed: its root, and the probes with the gradient row;
* their ratio, against the floor the bytes hashed set: (state + gradient) / state bytes;
* the optimizer's update: ``torch.optim.Adam``'s default (foreach) step against the
  canonical one (``zkdv.torch.optimizers.canonical``), on the same tensors;
* the step record's size without probes, with and without its ``grad`` root.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_overhead import lm_loss, lm_workload, mlp_loss, mlp_workload

from zkdv.config import ZKDVConfig
from zkdv.merkle import LeafSpec, commit_state
from zkdv.probes import ProbeSet
from zkdv.records import encode
from zkdv.torch.optimizers import canonical

CHUNK = ZKDVConfig().chunk_bytes


def _leaves(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, np.ndarray]]:
    return [(name, tensor.detach().numpy()) for name, tensor in named]


def _ms(function: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(name: str, rounds: int) -> None:
    workload = {"lm": lm_workload, "mlp": mlp_workload}[name]()
    loss_of = {"lm": lm_loss, "mlp": mlp_loss}[name]
    model = workload.model
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_of(model, workload.batch(0), lambda m, *a: m(*a)).backward()
    optimizer.step()  # creates the state
    params = [(n, p) for n, p in model.named_parameters()]
    grads = [(f"params:{n}", p.grad) for n, p in params]
    state = [
        (f"{n}.{entry}", value)
        for n, p in params
        for entry, value in sorted(optimizer.state[p].items())
    ]
    buffers = list(model.named_buffers())
    host = {
        "params": _leaves(params),
        "state": _leaves(state),
        "buffers": _leaves(buffers),
        "grad": _leaves(grads),
    }
    specs = [LeafSpec.of(n, a) for n, a in host["params"]]
    probes = ProbeSet.create(specs, 0.01, bytes(16))
    rows = [probes.select(i, a) for i, (_, a) in enumerate(host["params"])]
    grad_rows = [probes.select(i, a) for i, (_, a) in enumerate(host["grad"])]

    def present() -> None:
        for tree in ("params", "state", "buffers"):
            commit_state(host[tree], CHUNK)
        probes._last_post.clear()  # every step projects pre, post and delta afresh
        probes.project_steps(rows, rows)

    def with_gradient() -> None:
        for tree in ("params", "state", "buffers", "grad"):
            commit_state(host[tree], CHUNK)
        probes._last_post.clear()
        probes.project_steps(rows, rows, grad_rows)

    present_ms, gradient_ms = [], []
    for _ in range(rounds):  # interleaved: load hits both alike
        present_ms.append(_ms(present, 3))
        gradient_ms.append(_ms(with_gradient, 3))
    state_bytes = sum(a.nbytes for tree in ("params", "state", "buffers") for _, a in host[tree])
    grad_bytes = sum(a.nbytes for _, a in host["grad"])

    # The update itself: torch.optim's default step against the canonical one.
    parameters = [p for _, p in params]
    group = optimizer.param_groups[0]
    states = [optimizer.state[p] for p in parameters]
    gradients = [p.grad for p in parameters]

    def native() -> None:
        with torch.no_grad():
            optimizer.step()

    def canonical_step() -> None:
        with torch.no_grad():
            canonical.update("Adam", parameters, gradients, states, group)

    native_ms = [_ms(native, 3) for _ in range(rounds)]
    canonical_ms = [_ms(canonical_step, 3) for _ in range(rounds)]

    record = {
        "t": "step",
        "i": 123456,
        "prev": bytes(32),
        "batch": {"root": bytes(32), "rows": 64, "cols": 1024, "win": bytes(32)},
        "post": {"p": bytes(32), "o": bytes(32), "b": bytes(32)},
        "probe": None,
        "tokens": 8192,
        "flops": 1.5e12,
        "time": [1.7e9, 1.7e9 + 0.25],
    }
    plain_bytes = len(encode(record))
    grad_record_bytes = len(encode({**record, "grad": bytes(32)}))

    parameters_count = sum(p.numel() for p in parameters)
    print(
        f"[{name}] {parameters_count / 1e6:.2f}M parameters, state {state_bytes / 2**20:.1f} MiB, "
        f"gradient {grad_bytes / 2**20:.1f} MiB; {torch.get_num_threads()} threads"
    )
    present_median = statistics.median(present_ms)
    gradient_median = statistics.median(gradient_ms)
    print(f"  commitment work, present          {present_median:8.2f} ms/step")
    print(
        f"  commitment work, with gradient    {gradient_median:8.2f} ms/step   "
        f"ratio {gradient_median / present_median:.3f}"
    )
    print(
        f"  floor of that ratio (bytes hashed: (state + gradient) / state) "
        f"{(state_bytes + grad_bytes) / state_bytes:.3f}"
    )
    print(f"  optimizer update, torch.optim     {statistics.median(native_ms):8.2f} ms/step")
    print(
        f"  optimizer update, canonical       {statistics.median(canonical_ms):8.2f} ms/step   "
        f"ratio {statistics.median(canonical_ms) / statistics.median(native_ms):.2f}"
    )
    print(
        f"  step record without probes        {plain_bytes} bytes, with its grad root "
        f"{grad_record_bytes} bytes (< 1024)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=["lm", "mlp"])
    args = parser.parse_args()
    for name in [args.only] if args.only else ["lm", "mlp"]:
        measure(name, args.rounds)


if __name__ == "__main__":
    main()
