"""Batch commitments and rolling-window fingerprints for data-content queries."""

from __future__ import annotations

import numpy as np
import pytest

from zkdv.batch import commit_batch, contains_window, sorted_fingerprints, window_fingerprints


def _batch() -> np.ndarray:
    return np.random.default_rng(3).integers(0, 50_000, size=(4, 64), dtype=np.uint32)


def test_every_word_is_bound() -> None:
    batch = _batch()
    commitment = commit_batch(batch, 8)
    changed = batch.copy()
    changed[3, 63] ^= 1
    assert commit_batch(changed, 8).root != commitment.root
    assert commit_batch(changed, 8).windows != commitment.windows
    # Swapping rows changes the root too: the order of examples is committed.
    assert commit_batch(batch[::-1], 8).root != commitment.root


def test_rolling_window_is_validated_against_the_row_width() -> None:
    with pytest.raises(
        ValueError, match="rolling_window=65 exceeds the committed batch row width of 64"
    ):
        commit_batch(_batch(), 65)
    with pytest.raises(ValueError, match="positive integer"):
        commit_batch(_batch(), 0)


def test_batch_must_be_rectangular_uint32() -> None:
    with pytest.raises(TypeError, match="uint32"):
        commit_batch(np.zeros((2, 4), np.int64), 2)
    with pytest.raises(ValueError, match="2-D"):
        commit_batch(np.zeros((2, 2, 2), np.uint32), 2)


def test_fingerprints_match_a_direct_computation() -> None:
    batch = _batch()
    fingerprints = window_fingerprints(batch, 5)
    assert fingerprints.shape == (4, 60)
    # The same window anywhere gets the same fingerprint; different windows differ.
    window = batch[2, 10:15]
    single = window_fingerprints(window.reshape(1, -1), 5)[0, 0]
    assert fingerprints[2, 10] == single
    assert len(np.unique(fingerprints)) == fingerprints.size


def test_membership_queries_find_the_rows() -> None:
    batch = _batch()
    batch[0, 20:24] = [1, 2, 3, 4]
    batch[3, 0:4] = [1, 2, 3, 4]
    assert contains_window(batch, [1, 2, 3, 4]) == [0, 3]
    assert contains_window(batch, [9, 9, 9, 9]) == []


def test_the_windows_commit_the_multiset_of_fingerprints() -> None:
    # The rows' order is the root's (test_every_word_is_bound), not the windows'.
    batch = _batch()
    assert commit_batch(batch[::-1], 8).windows == commit_batch(batch, 8).windows
    got = sorted_fingerprints(batch, 8)
    assert got.dtype == np.uint64
    assert got.tolist() == sorted(window_fingerprints(batch, 8).ravel().tolist())
