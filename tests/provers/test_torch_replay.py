"""The whitebox-torch prover on real zkdv.torch runs: honest runs pass, forgeries fail.

Each run is made once per module: a small ``nn.Sequential`` MLP and AdamW with two
parameter groups, ``prepare``/``attest``/``transaction``, ``replay_snapshot_interval=3``,
8 steps, no SDK-side checks (so forged runs complete as a forger would submit them).
The runs seal a ``torch.export`` program, which replays Torch's eager kernels and so
reproduces the committed roots bit for bit; the one test marked ``aot`` seals the real
AOT Inductor package, which the platform refuses to load (native code, issue 59).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# Shared with tests/agent/zkdv/torch: a warm Inductor cache makes the AOT test's compile faster.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(REPO_ROOT / ".data" / "torchinductor"))

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional  # noqa: E402

import provers  # noqa: E402
import zkdv  # noqa: E402
from provers import torch_replay  # noqa: E402
from provers.replay import Transcript, windows  # noqa: E402
from zkdv import untrusted  # noqa: E402
from zkdv.files import batch_path, snapshot_path  # noqa: E402
from zkdv.records import iter_records  # noqa: E402
from zkdv.torch import forgery  # noqa: E402
from zkdv.torch.forgery import hide_learning_rate  # noqa: E402
from zkdv.torch.optimizers.bridge import OPTIONS_CHANGED  # noqa: E402
from zkdv.verify import verify_transcript  # noqa: E402

STEPS = 8
FORGED_STEP = 4  # inside the window [3, 5]

#: ``between(proof, model, optimizer)`` runs just before step 4's transaction;
#: ``inside(x)`` may edit the batch after the transaction committed it.
Between = Callable[[Any, nn.Module, Any], None]


def _train(
    path: Path,
    *,
    kind: str = "torch.export",
    between: Between | None = None,
    inside: Callable[[torch.Tensor], None] | None = None,
) -> Path:
    torch.manual_seed(0)
    proof = zkdv.torch.ZKDV(
        path,
        zkdv.ZKDVConfig(sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0)),
        replay_snapshot_interval=3,
    )
    proof.program_kind = kind
    proof.start(rolling_window=4, probe_ratio=0.5)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.01
    )
    model, optimizer = proof.prepare(model, optimizer)

    @proof.attest
    def attested(model: nn.Module, optimizer: Any, batch: Any) -> None:
        inputs, targets = batch
        loss = functional.mse_loss(proof.forward(model, inputs)[:, 0], targets)
        proof.backward(loss)
        optimizer.step()
        optimizer.zero_grad()

    generator = torch.Generator().manual_seed(1)
    try:
        for index in range(STEPS):
            inputs = torch.randn(4, 6, generator=generator)
            targets = torch.randn(4, generator=generator)
            if index == FORGED_STEP and between is not None:
                between(proof, model, optimizer)
            with proof.transaction(batch=(inputs, targets)):
                if index == FORGED_STEP and inside is not None:
                    inside(inputs)
                loss = functional.mse_loss(model(inputs)[:, 0], targets)
                proof.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    finally:
        proof.close()
    return path


def _bump(proof: Any, model: nn.Module, optimizer: Any) -> None:
    # Step 3's commitment reads the live parameters asynchronously; an edit racing it
    # would be committed as part of step 3's update (and fail step 3's replay). Waiting
    # makes the edit land between the steps, where the probes see it.
    proof.join()
    with torch.no_grad():
        model[0].weight.add_(0.05)


def _racing(proof: Any, model: nn.Module, optimizer: Any) -> None:
    with torch.no_grad():  # no join(): races step 3's asynchronous commitment
        model[0].weight.add_(1e-3)


def _invisible(proof: Any, model: nn.Module, optimizer: Any) -> None:
    """Change the first weight only along directions its probe cannot see."""
    proof.join()
    probes = proof._core.probes
    leaf = next(i for i, spec in enumerate(probes.specs) if spec.path == "0.weight")
    matrix = probes.matrices[leaf].astype(np.float64)  # (6, kept)
    assert probes.rows[leaf] is None or len(probes.rows[leaf]) == 16
    null = np.linalg.svd(matrix.T)[2][matrix.shape[1] :]
    change = np.random.default_rng(7).standard_normal((16, len(null))) @ null * 0.05
    with torch.no_grad():
        model[0].weight.add_(torch.from_numpy(change).float())


def _double_lr(proof: Any, model: nn.Module, optimizer: Any) -> None:
    # What a scheduler does between steps: legitimate, committed from step 4 on.
    optimizer.param_groups[0]["lr"] *= 2


def _hidden_lr(proof: Any, model: nn.Module, optimizer: Any) -> None:
    """Step with twice the learning rate while the record says once."""
    hide_learning_rate(optimizer, 2.0, group=0)


def _toggle_amsgrad(proof: Any, model: nn.Module, optimizer: Any) -> None:
    optimizer.param_groups[0]["amsgrad"] = True


def _trained_on_other_data(inputs: torch.Tensor) -> None:
    inputs.mul_(-1)  # after the transaction packed (committed) the batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("torch-runs")
    return {
        "honest": _train(base / "honest"),
        "visible": _train(base / "visible", between=_bump),
        "racing": _train(base / "racing", between=_racing),
        "invisible": _train(base / "invisible", between=_invisible),
        "lr": _train(base / "lr", between=_double_lr),
        "hidden-lr": _train(base / "hidden-lr", between=_hidden_lr),
        "data": _train(base / "data", inside=_trained_on_other_data),
    }


@pytest.fixture
def honest_copy(runs: dict[str, Path], tmp_path: Path) -> Path:
    return Path(shutil.copytree(runs["honest"], tmp_path / "copy"))


def test_root_record_commits_the_optimizer_and_its_groups(runs: dict[str, Path]) -> None:
    root = next(iter_records(runs["honest"])).data
    optimizer = root["env"]["optimizer"]
    assert optimizer["contract"] == "AdamW"
    assert optimizer["group_parameters"] == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]
    assert [group["weight_decay"] for group in optimizer["groups"]] == [0.01, 0.0]


def test_honest_run_replays_every_window_bit_for_bit(runs: dict[str, Path]) -> None:
    path = runs["honest"]
    transcript = Transcript.load(path)
    assert windows(transcript) == [(0, 2), (3, 5), (6, 7)]
    assert torch_replay.exact_environment(transcript.root)
    transition = torch_replay.load_transition(path)
    for first, last in windows(transcript):
        verdict = torch_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok, verdict.message
        assert [e.step for e in verdict.evidence] == list(range(first, last + 1))
        # torch.export replays eager kernels: the committed roots, bit for bit.
        assert all(e.exact for e in verdict.evidence)
    assert provers.verify_challenge(path, 7).ok


def test_the_replay_recounts_every_step_records_flops(runs: dict[str, Path]) -> None:
    path = runs["honest"]
    transcript = Transcript.load(path)
    transition = torch_replay.load_transition(path)
    # The committed program, counted again, is what the SDK counted at sealing.
    assert transition.flops == transcript.root["env"]["flops"]["per_rank"] > 0
    assert {record["flops"] for record in transcript.steps.values()} == {transition.flops}


@pytest.mark.parametrize("factor", [0.5, 0.98, 1.02])
def test_a_misstated_flop_count_fails_every_replay(factor: float, tmp_path: Path) -> None:
    # A modified SDK commits a count off by 2 % or more: the chain, the probes and the
    # replayed states are honest, and the offline verifier has no program to count.
    restore = forgery.scaled_flops(factor)
    try:
        path = _train(tmp_path / "misstated")
    finally:
        restore()
    assert verify_transcript(path).ok
    for step in (0, 7):
        verdict = provers.verify_challenge(path, step)
        assert (verdict.ok, verdict.reason) == (False, "flops_mismatch")
        assert "step 0: the record claims" in str(verdict.message)
        assert "off by more than 1%" in str(verdict.message)


def test_an_estimated_flop_count_is_recomputed(tmp_path: Path) -> None:
    # A program the SDK's counter cannot run: it estimates 6 x parameters x tokens, and
    # says so in the root; the replay recomputes the same estimate.
    restore = forgery.uncounted_flops()
    try:
        path = _train(tmp_path / "estimated")
    finally:
        restore()
    transcript = Transcript.load(path)
    assert transcript.root["env"]["flops"]["method"] == "6 x parameters x tokens"
    parameters = 6 * 16 + 16 + 16 + 1  # Linear(6, 16), Linear(16, 1)
    tokens = transcript.steps[0]["tokens"]
    assert torch_replay.load_transition(path).flops == 6.0 * parameters * tokens
    assert provers.verify_challenge(path, 0).ok


def test_a_flop_count_within_one_percent_passes(tmp_path: Path) -> None:
    # Another Torch release may count an operator a little differently: not a forgery.
    restore = forgery.scaled_flops(1.005)
    try:
        path = _train(tmp_path / "close")
    finally:
        restore()
    assert provers.verify_challenge(path, 0).ok


def test_batch_file_that_differs_from_the_committed_batch(honest_copy: Path) -> None:
    file = batch_path(honest_copy, 5)
    data = bytearray(file.read_bytes())
    data[-1] ^= 1
    file.write_bytes(bytes(data))
    verdict = torch_replay.verify_challenge(honest_copy, 5)
    assert (verdict.ok, verdict.reason) == (False, "batch_mismatch")
    assert "batch-00000005.u32 does not hash to step 5" in str(verdict.message)


def test_snapshot_that_does_not_hash_to_its_commitment(honest_copy: Path) -> None:
    file = snapshot_path(honest_copy, 6, "params")
    data = bytearray(file.read_bytes())
    data[0] ^= 1
    file.write_bytes(bytes(data))
    verdict = torch_replay.verify_challenge(honest_copy, 7)
    assert (verdict.ok, verdict.reason, verdict.snapshot_ok) == (False, "snapshot_mismatch", False)


def test_program_artifact_that_differs(honest_copy: Path) -> None:
    file = honest_copy / "program.bin"
    file.write_bytes(file.read_bytes() + b"\0")
    verdict = provers.verify_challenge(honest_copy, 0)
    assert (verdict.ok, verdict.reason) == (False, "program_mismatch")
    assert "does not hash to the program digest" in str(verdict.message)


def test_frontend_rejects_a_static_option_changed_mid_run(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=OPTIONS_CHANGED):
        _train(tmp_path / "amsgrad", between=_toggle_amsgrad)


def test_a_learning_rate_changed_between_steps_is_committed_and_replays(
    runs: dict[str, Path],
) -> None:
    path = runs["lr"]
    steps = [r.data for r in iter_records(path) if r.data["t"] == "step"]
    assert [step["hp"][0]["lr"] for step in steps] == [0.01] * FORGED_STEP + [0.02] * (
        STEPS - FORGED_STEP
    )
    assert all(step["hp"][1]["lr"] == 0.01 for step in steps)
    assert steps[0]["hp"][0] == {
        "betas": [0.9, 0.999],
        "eps": 1e-08,
        "lr": 0.01,
        "weight_decay": 0.01,
    }
    transition = torch_replay.load_transition(path)
    for first, last in windows(Transcript.load(path)):
        verdict = torch_replay.verify_challenge(path, first, through=last, transition=transition)
        assert verdict.ok and all(e.exact for e in verdict.evidence), verdict.message


def test_learning_rate_used_but_not_committed_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["hidden-lr"]
    assert verify_transcript(path).ok  # the transcript itself is consistent
    verdict = torch_replay.verify_challenge(path, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 4:")
    assert [(e.step, e.ok) for e in verdict.evidence] == [(3, True), (4, False)]
    # The canonical update of the committed gradient with the committed rate is not the
    # committed state, on any hardware: no tolerance covers it.
    loose = torch_replay.verify_challenge(path, 4, exact=False)
    assert loose.reason == "replay_mismatch"
    assert "does not give the committed post-update state" in str(loose.message)


def test_visible_parameter_change_is_caught_by_the_offline_probe_check(
    runs: dict[str, Path],
) -> None:
    report = verify_transcript(runs["visible"])
    assert not report.ok and "step 4" in report.summary()
    assert torch_replay.verify_challenge(runs["visible"], 4).reason == "invalid_transcript"


def test_parameter_change_racing_the_commitment_is_caught(runs: dict[str, Path]) -> None:
    # Where the edit lands depends on the commit thread, and so on the machine's load:
    # usually in step 3's committed update, within the probes' tolerance, where the exact
    # replay names the step; when the commitment of step 3 has already read the weights,
    # between steps 3 and 4, where the offline verifier sees the probes jump (seen once,
    # at load 4, with a CI run beside it). Either way the forgery is caught.
    path = runs["racing"]
    report = verify_transcript(path)
    if not report.ok:
        assert report.reason == "probe_discontinuity", report
        assert "step 4" in str(report.message)
        return
    verdict = torch_replay.verify_challenge(path, 3, through=5)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith(("step 3:", "step 4:"))


def test_parameter_change_the_probes_cannot_see_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["invisible"]
    assert verify_transcript(path).ok
    verdict = torch_replay.verify_challenge(path, 4)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert str(verdict.message).startswith("step 4:")
    assert torch_replay.verify_challenge(path, 6, through=7).ok


def test_run_trained_on_other_data_than_committed_fails_replay(runs: dict[str, Path]) -> None:
    path = runs["data"]
    assert verify_transcript(path).ok
    verdict = torch_replay.verify_challenge(path, 4, exact=False)
    assert (verdict.ok, verdict.reason) == (False, "replay_mismatch")
    assert "step 4" in str(verdict.message)


@pytest.mark.slow
@pytest.mark.aot
@pytest.mark.timeout(600)  # two AOT Inductor compiles: 100 s each on two busy cores
def test_an_aot_inductor_run_is_compiled_by_the_platform_and_replays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run commits its torch.export program; the platform compiles it itself (issue
    59): no compiled code crosses from the lab, and the replay passes within bounds (the
    training was eager, the replay compiled)."""
    path = _train(tmp_path / "aot", kind="aot-inductor")
    transcript = Transcript.load(path)
    assert transcript.root["program"]["kind"] == "aot-inductor"
    material = (path / "program.pt2").read_bytes()
    untrusted.safe_export_archive(material)  # a torch.export archive, no shared object
    assert not torch_replay.exact_environment(transcript.root)
    compiled: list[str] = []
    compile_package = torch._inductor.aoti_compile_and_package

    def compiling(*arguments: Any, **options: Any) -> str:
        compiled.append(str(options["package_path"]))
        return str(compile_package(*arguments, **options))

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compiling)
    monkeypatch.setenv("ZKDV_AOTI_CACHE", str(tmp_path / "cache"))
    first, last = next(iter(windows(transcript)))
    verdict = torch_replay.verify_challenge(path, first, through=last)
    assert verdict.ok, verdict.message
    # Compiled here once, then found in the cache by the program's digest.
    assert len(compiled) == 1
    assert torch_replay.verify_challenge(path, first, through=last).ok
    assert len(compiled) == 1
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".pt2"]
