"""Public configuration: validation, defaults and the record form."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import zkdv
from tests.synthetic import write_synthetic_transcript


def test_a_sampling_policy_warns_of_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert zkdv.SamplingPolicy(update_check_probability=0.03).probability == 0.03
        assert zkdv.SamplingPolicy().probability == 0.01


def test_the_seeds_state_check_probability_is_accepted_with_a_deprecation_warning() -> None:
    # The seeds' README passes both arguments (STYLE.md rule 25: a released API).
    with pytest.warns(DeprecationWarning, match="state_check_probability") as caught:
        policy = zkdv.SamplingPolicy(state_check_probability=0.01, update_check_probability=0.01)
    assert len(caught) == 1
    assert caught[0].filename == __file__  # points at the caller's line, not at zkdv
    assert policy.probability == 0.01
    assert policy.state_check_probability == 0.01


def test_state_check_probability_has_no_effect() -> None:
    with pytest.warns(DeprecationWarning):
        alone = zkdv.SamplingPolicy(state_check_probability=0.5)
    # Not used as the update probability either: the default stays the default.
    assert alone.probability == zkdv.SamplingPolicy().probability == 0.01
    assert alone == zkdv.SamplingPolicy()
    assert alone.to_dict() == zkdv.SamplingPolicy().to_dict()
    with pytest.warns(DeprecationWarning):
        config = zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(
                state_check_probability=1.0, update_check_probability=0.2
            )
        )
    assert (
        config.to_dict()
        == zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.2)
        ).to_dict()
    )
    assert zkdv.ZKDVConfig.from_dict(config.to_dict()) == config


def test_the_sentinel_is_silent() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = zkdv.SamplingPolicy(state_check_probability=-1.0, update_check_probability=0.3)
    assert policy.state_check_probability == -1.0 and policy.probability == 0.3


@pytest.mark.parametrize(
    ("value", "error"),
    [(1.5, ValueError), (-0.5, ValueError), (float("nan"), ValueError), ("0.1", TypeError)],
)
def test_a_deprecated_state_check_probability_is_still_validated(
    value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=r"state_check_probability=.* \(deprecated: leave it unset\)"):
        zkdv.SamplingPolicy(state_check_probability=value)  # type: ignore[arg-type]


def test_the_deprecated_argument_leaves_the_transcript_unchanged(tmp_path: Path) -> None:
    """The same run with and without it writes the same bytes, root record first."""
    with pytest.warns(DeprecationWarning):
        deprecated = zkdv.SamplingPolicy(state_check_probability=0.7, update_check_probability=0.5)
    plain = zkdv.SamplingPolicy(update_check_probability=0.5)
    records = []
    for name, policy in (("deprecated", deprecated), ("plain", plain)):
        proof = write_synthetic_transcript(tmp_path / name, steps=6, sampling=policy)
        records.append((proof / "records.cborl").read_bytes())
    assert records[0] == records[1]
    assert b"state_check" not in records[0]
    # The root record holds the sampling policy, so it would differ if the argument did.
    other = write_synthetic_transcript(
        tmp_path / "other", steps=6, sampling=zkdv.SamplingPolicy(update_check_probability=0.4)
    )
    assert (other / "records.cborl").read_bytes() != records[0]


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


def test_gradient_files_are_validated_and_resolved_per_platform() -> None:
    from zkdv.config import resolve_gradient_files

    assert zkdv.ZKDVConfig().gradient_files == "auto"
    with pytest.raises(ValueError, match="gradient_files='some' must be one of 'auto', 'always'"):
        zkdv.ZKDVConfig(gradient_files="some")
    # A TPU's runs are replayed on TPUs, bit for bit: by default they keep no files.
    assert resolve_gradient_files("auto", "tpu") == "never"
    assert [resolve_gradient_files("auto", kind) for kind in ("cpu", "gpu")] == ["always"] * 2
    assert resolve_gradient_files("always", "tpu") == "always"
    assert resolve_gradient_files("never", "cpu") == "never"
    # Resolved for the run by the core, not recorded as "auto".
    assert "gradient_files" not in zkdv.ZKDVConfig(gradient_files="never").to_dict()
