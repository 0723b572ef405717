"""Probes are seeded, orthonormal and linear."""

from __future__ import annotations

import numpy as np

from zkdv.merkle import LeafSpec
from zkdv.probes import MAX_PROBE_ROWS, ProbeSet


def test_probe_matrices_are_orthonormal_and_seeded() -> None:
    specs = [
        LeafSpec("w", "float32", (300, 257)),
        LeafSpec("b", "float32", (7,)),
        LeafSpec("s", "float32", ()),
    ]
    probes = ProbeSet.create(specs, 0.01, b"seed" * 4)
    assert [m.shape for m in probes.matrices] == [(257, 3), (7, 1), (1, 1)]
    q = probes.matrices[0].astype(np.float64)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-6)
    again = ProbeSet.create(specs, 0.01, b"seed" * 4)
    assert all(np.array_equal(a, b) for a, b in zip(probes.matrices, again.matrices, strict=True))
    other = ProbeSet.create(specs, 0.01, b"SEED" * 4)
    assert not np.array_equal(probes.matrices[0], other.matrices[0])


def test_probes_are_linear_and_bounded_in_rows() -> None:
    rng = np.random.default_rng(0)
    spec = LeafSpec("w", "float32", (300, 64))
    probes = ProbeSet.create([spec], 0.1, bytes(16))
    pre = rng.standard_normal((300, 64)).astype(np.float32)
    delta = rng.standard_normal((300, 64)).astype(np.float32) * 1e-3
    post = pre + delta
    p_pre, p_post, p_delta = (probes.project(0, a) for a in (pre, post, delta))
    assert p_pre.shape == (MAX_PROBE_ROWS, 7)
    np.testing.assert_allclose(p_post, p_pre + p_delta, rtol=1e-4, atol=1e-5)
    assert probes.floats == MAX_PROBE_ROWS * 7
