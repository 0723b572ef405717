"""Public configuration: validation, defaults and the record form."""

from __future__ import annotations

import warnings

import pytest

import zkdv


def test_a_sampling_policy_warns_of_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zkdv.SamplingPolicy(update_check_probability=0.03).probability == 0.03
        assert zkdv.SamplingPolicy().probability == 0.01


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), float("inf")])
def test_probabilities_are_validated(value: float) -> None:
    with pytest.raises(ValueError, match="update_check_probability"):
        zkdv.SamplingPolicy(update_check_probability=value)


def test_debug_check_every_validates_n() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        zkdv.SamplingPolicy.DEBUGCheckEvery(0)


def test_tolerance() -> None:
    tol = zkdv.FloatTolerance(absolute=1e-6, relative=1e-3)
    assert tol.close(1.0005, 1.0)
    assert not tol.close(1.01, 1.0)
    assert tol.close(float("nan"), float("nan"))
    assert not tol.close(float("inf"), 1.0)
    with pytest.raises(ValueError, match="relative"):
        zkdv.FloatTolerance(relative=-1)


def test_config_round_trips_through_its_record_form() -> None:
    config = zkdv.ZKDVConfig(
        name="pretraining",
        sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(4),
        tolerance=zkdv.FloatTolerance(absolute=0.0, relative=1e-5),
    )
    assert zkdv.ZKDVConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="power of two"):
        zkdv.ZKDVConfig(chunk_bytes=1000)


def test_public_api_is_a_deliberate_list() -> None:
    assert set(zkdv.__all__) == {
        "PROTOCOL_VERSION",
        "FloatTolerance",
        "GradientBounds",
        "SamplingPolicy",
        "ZKDVConfig",
        "ZKDVError",
        "ZKDVPoisonedError",
        "ZKDVVerificationError",
        "jax",
        "overlap",
        "torch",
    }
    assert issubclass(zkdv.ZKDVPoisonedError, zkdv.ZKDVError)
    assert issubclass(zkdv.ZKDVError, RuntimeError)
    assert [p.name for p in zkdv.overlap.Policy] == ["ALWAYS", "UNCHECKED", "NEVER"]


def test_the_commitment_path_is_validated_and_not_in_the_transcript() -> None:
    # The transcript is byte-identical on both paths, so the choice is not recorded.
    assert zkdv.ZKDVConfig(commitments="device").to_dict() == zkdv.ZKDVConfig().to_dict()
    assert zkdv.ZKDVConfig().commitments == "auto"
    with pytest.raises(ValueError, match="commitments='gpu' must be one of 'auto', 'host'"):
        zkdv.ZKDVConfig(commitments="gpu")
