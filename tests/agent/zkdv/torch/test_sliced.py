"""Sliced challenges (docs/scale.md): the platform checks one block of one step from an opened
slice of the LM recipe's model, honest runs pass, and the forgeries the design names fail.

The lab is :class:`zkdv.sliced.TorchLab` (hooks record each block's boundaries per
micro-batch; AdamW through the canonical update) on ``examples/torch/lm.py``'s model in
float32 without dropout; the platform is :func:`provers.sliced.verify_slice`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.nn import functional

from provers.sliced import SliceVerdict, replay_whole_step, verify_slice
from tests.examples import torch_example
from tests.sources import AGENT_PYTHONPATH
from zkdv import sliced

REPO_ROOT = Path(__file__).resolve().parents[4]

lm = torch_example("lm")
CONFIG = lm.LMConfig(width=16, heads=2, layers=2, context=8, dropout=0.0)
MICRO, ROWS, STEPS, OPENED = 2, 4, 3, 2
GROUP = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
PLATFORM_SEED = bytes(range(32))  # the platform's secret seed, where a test draws with it
#: What maps a batch row to boundary 0 (the input check): the recipe's two embeddings.
INPUTS = ("tokens.weight", "positions.weight")


def _embed(tables: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    ids = tokens[:-1]  # the recipe's model reads all but the last token of a row
    return tables["tokens.weight"][ids] + tables["positions.weight"][: ids.shape[0]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    # Tiny tensors: a second intra-op thread only spins, and these tests share two cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _loss(model: Any, micro: torch.Tensor) -> torch.Tensor:
    logits = model(micro[:, :-1])
    loss = functional.cross_entropy(logits.reshape(-1, CONFIG.vocab), micro[:, 1:].reshape(-1))
    return loss / MICRO


def _train(seed: int, tamper: dict[str, Callable[..., None]] | None = None) -> sliced.TorchLab:
    torch.manual_seed(seed)
    model = lm.TinyLM(CONFIG)
    lab = sliced.TorchLab(
        model,
        [(f"blocks.{i}", block) for i, block in enumerate(model.blocks)],
        dict(GROUP),
        inputs=INPUTS,
        tamper=tamper or {},
    )
    for batch in lm.token_batches(CONFIG, steps=STEPS, micro_batches=MICRO, rows=ROWS, seed=seed):
        lab.step(batch, _loss)
    return lab


def _check(
    lab: sliced.TorchLab,
    challenge: sliced.SliceChallenge,
    *,
    sequences: Sequence[tuple[int, int]] | None = None,
    lie: Callable[[np.ndarray], None] | None = None,
    edit: Callable[[sliced.SliceOpening], sliced.SliceOpening] | None = None,
    platform_seed: bytes = PLATFORM_SEED,
    input_check: bool = True,
) -> SliceVerdict:
    """One sliced challenge end to end: answer, draw (unless given), open, verify."""
    answer = lab.answer(challenge, lie=lie)
    if sequences is None:
        sequences = sliced.draw_sequences(
            platform_seed, challenge, answer.digest(), micro_batches=MICRO, rows=ROWS, count=OPENED
        )
    opening = lab.open(challenge, sequences)
    if not input_check:  # a slice as the prototype first had it: the block alone
        rows = tuple(
            r for r in opening.rows if r.boundary in (challenge.block, challenge.block + 1)
        )
        opening = sliced.SliceOpening(
            **{**opening.__dict__, "inputs": (), "batch_rows": (), "rows": rows}
        )
    if edit is not None:
        opening = edit(opening)
    structure = lm.TinyLM(CONFIG).blocks[challenge.block]  # the platform's own copy
    return verify_slice(
        lab.steps[challenge.step].commitment,
        challenge,
        answer,
        sequences,
        opening,
        names=lab.names,
        layout=lab.layout,
        block=structure,
        chunk_bytes=lab.chunk_bytes,
        inputs=INPUTS if input_check else (),
        embed=_embed,
    )


def _challenge(step: int, block: int, seed: int = 7) -> sliced.SliceChallenge:
    return sliced.SliceChallenge(step, block, bytes([seed]) * 32)


@pytest.mark.parametrize("seed", range(10))
def test_honest_runs_pass_drawn_sliced_challenges(seed: int) -> None:
    lab = _train(seed)
    digest = lab.digest()
    platform_seed = bytes([seed + 1]) * 32
    for index in range(2):
        challenge = sliced.draw_challenge(
            platform_seed, digest, index=index, steps=STEPS, blocks=CONFIG.layers
        )
        verdict = _check(lab, challenge, platform_seed=platform_seed)
        assert verdict.ok, (challenge, verdict.reason, verdict.message)
        # Honest rounding uses at most a small share of every bound.
        assert max(verdict.margins.values()) < 0.1, verdict.margins


def test_every_block_of_every_step_passes() -> None:
    lab = _train(0)
    for step in range(STEPS):
        for block in range(CONFIG.layers):
            verdict = _check(lab, _challenge(step, block), sequences=[(0, 1), (1, 3)])
            assert verdict.ok, (step, block, verdict.message)


def test_a_nudged_block_fails_its_update_check_and_only_its_own() -> None:
    def nudge(step: int, params: dict[str, torch.Tensor]) -> None:
        if step == 1:
            params["blocks.1.up.weight"][0, 0] += 1e-3

    lab = _train(0, {"post": nudge})
    verdict = _check(lab, _challenge(1, 1))
    assert (verdict.ok, verdict.reason) == (False, "update")
    assert "blocks.1.up.weight" in verdict.message
    # The other block of the forged step, and the same block a step later (whose
    # pre-state is the nudged one, consistently), pass: docs/scale.md's 1 / B.
    assert _check(lab, _challenge(1, 0)).ok
    assert _check(lab, _challenge(2, 1)).ok


def test_a_replaced_micro_batch_boundary_fails_when_one_of_its_sequences_is_opened() -> None:
    def replace(step: int, boundaries: list[list[dict[str, np.ndarray]]]) -> None:
        if step == 1:
            act = boundaries[1][1][sliced.ACTIVATION]  # micro-batch 1, between blocks 0 and 1
            act[:] = np.random.default_rng(0).standard_normal(act.shape).astype(np.float32)

    lab = _train(0, {"boundaries": replace})
    for block in (0, 1):  # the block that writes the boundary, and the one that reads it
        verdict = _check(lab, _challenge(1, block), sequences=[(1, 2)])
        assert (verdict.ok, verdict.reason) == (False, "forward"), verdict.message
    # Opened sequences all from the other micro-batch: block 0 cannot see it (its inputs,
    # output gradients and so its projections are honest) ...
    assert _check(lab, _challenge(1, 0), sequences=[(0, 0), (0, 3)]).ok
    # ... while block 1's projections over every sequence were computed from the forged
    # inputs and no longer sum to the committed (honest) gradient.
    verdict = _check(lab, _challenge(1, 1), sequences=[(0, 0), (0, 3)])
    assert (verdict.ok, verdict.reason) == (False, "freivalds")


def test_training_on_other_data_fails_the_input_check_of_any_block() -> None:
    """The lab trains on one batch and commits another. Every boundary it commits is the
    real run's, so the blocks' own checks pass; only boundary 0 against the committed
    batch shows it, which is why every slice also checks the input."""

    def substitute(step: int, batch: np.ndarray) -> None:
        if step == 1:
            batch[0, 2] = (batch[0, 2] + 1) % CONFIG.vocab  # one sequence's tokens

    lab = _train(0, {"batch": substitute})
    for block in (0, 1):
        verdict = _check(lab, _challenge(1, block), sequences=[(0, 2), (1, 0)])
        assert (verdict.ok, verdict.reason) == (False, "input"), verdict.message
        # Without the input check, the block's own checks all pass.
        assert _check(lab, _challenge(1, block), sequences=[(0, 2)], input_check=False).ok
    # An unopened substituted sequence is not seen: 1 - miss(n, j, k) (docs/scale.md).
    assert _check(lab, _challenge(1, 1), sequences=[(0, 1), (1, 0)]).ok


def _scale_block(factor: float, block: int = 1, at: int = 1) -> Callable[..., None]:
    def scale(step: int, gradients: dict[str, torch.Tensor]) -> None:
        if step == at:
            for name, gradient in gradients.items():
                if name.startswith(f"blocks.{block}."):
                    gradient.mul_(factor)

    return scale


@pytest.mark.parametrize("factor", [1.01, 2.0])
def test_a_scaled_block_gradient_fails_the_freivalds_check(factor: float) -> None:
    lab = _train(0, {"gradient": _scale_block(factor)})
    verdict = _check(lab, _challenge(1, 1))
    assert (verdict.ok, verdict.reason) == (False, "freivalds"), verdict.message
    assert verdict.margins["freivalds"] > 10
    assert _check(lab, _challenge(1, 0)).ok  # the honest block of the same step


def test_a_gradient_lie_hidden_in_one_sequence_is_caught_only_when_it_is_opened() -> None:
    """The limit docs/scale.md states: the sum is checked exactly, each c_i only if opened."""
    lab = _train(0, {"gradient": _scale_block(1.05)})
    challenge = _challenge(1, 1)
    record = lab.steps[1]
    names = lab.layout.names(1)
    gradient = [g.astype(np.float64) for n, g in record.grad if n[len("params:") :] in names]
    specs = [s for s in record.pre[0].specs if s.path in names]
    directions = sliced.projection_directions(challenge.seed, specs, challenge.projections)

    def lie(c: np.ndarray) -> None:
        for q, direction in enumerate(directions):
            target = sum(sliced.inner(r, g) for r, g in zip(direction, gradient, strict=True))
            c[q, 1, 3] += target - c[q].sum()

    verdict = _check(lab, challenge, sequences=[(1, 3), (0, 0)], lie=lie)
    assert (verdict.ok, verdict.reason) == (False, "projection")
    assert _check(lab, challenge, sequences=[(0, 0), (1, 2)], lie=lie).ok


def test_openings_that_do_not_hash_to_the_commitment_are_rejected() -> None:
    lab = _train(0)
    challenge = _challenge(2, 0)

    def flip_tensor(opening: sliced.SliceOpening) -> sliced.SliceOpening:
        first = opening.params[0]
        data = bytearray(first.data)
        data[5] ^= 1
        params = (
            sliced.TensorOpening(**{**first.__dict__, "data": bytes(data)}),
            *opening.params[1:],
        )
        return sliced.SliceOpening(**{**opening.__dict__, "params": params})

    def swap_rows(opening: sliced.SliceOpening) -> sliced.SliceOpening:
        rows = list(opening.rows)
        other = rows[4]
        rows[0] = sliced.RowOpening(**{**rows[0].__dict__, "data": other.data})
        return sliced.SliceOpening(**{**opening.__dict__, "rows": tuple(rows)})

    def drop_row(opening: sliced.SliceOpening) -> sliced.SliceOpening:
        return sliced.SliceOpening(**{**opening.__dict__, "rows": opening.rows[1:]})

    for edit, reason in (
        (flip_tensor, "tensor_opening"),
        (swap_rows, "row_opening"),
        (drop_row, "row_opening"),
    ):
        verdict = _check(lab, challenge, sequences=[(0, 0), (1, 1)], edit=edit)
        assert (verdict.ok, verdict.reason) == (False, reason), edit.__name__


def test_the_sequences_drawn_depend_on_the_answer() -> None:
    challenge = _challenge(0, 0)
    draws = {
        sliced.draw_sequences(
            PLATFORM_SEED, challenge, bytes([i]) * 32, micro_batches=8, rows=8, count=4
        )
        for i in range(20)
    }
    # The lab knows the challenge (and its directions' seed) but not the platform's seed:
    # another seed draws other sequences for the same answer.
    answer = bytes(32)
    assert sliced.draw_sequences(
        PLATFORM_SEED, challenge, answer, micro_batches=8, rows=8, count=4
    ) != sliced.draw_sequences(bytes(32), challenge, answer, micro_batches=8, rows=8, count=4)
    assert len(draws) > 15
    for draw in draws:
        assert len(set(draw)) == 4 and all(0 <= m < 8 and 0 <= r < 8 for m, r in draw)


def test_a_slice_moves_less_than_a_whole_step_and_the_whole_step_replay_agrees() -> None:
    lab = _train(0)
    whole = lab.whole_step(1)
    model = lm.TinyLM(CONFIG)
    verdict = replay_whole_step(
        lab.steps[1].commitment, whole, model=model, loss=_loss, chunk_bytes=lab.chunk_bytes
    )
    assert verdict.ok, verdict.message
    challenge = _challenge(1, 1)
    answer = lab.answer(challenge)
    opening = lab.open(challenge, [(0, 0), (1, 1)])
    # Exactly the block's tensors: float32 weights, both Adam moments and the gradient, plus
    # one step counter per tensor; then the boundary rows, the answer and the audit paths.
    block_params = sum(t.spec.size for t in opening.params)
    tensor_bytes = sum(len(t.data) for t in (*opening.params, *opening.opt_state, *opening.grad))
    assert tensor_bytes == 16 * block_params + 4 * len(opening.params)
    total_params = sum(a.size for _, a in whole["params"])
    assert block_params < 0.4 * total_params
    # With the input check's whole embedding tables (this model's are a fifth of it; at
    # scale only the opened tokens' rows would be read), still well under the whole step.
    assert opening.nbytes + answer.nbytes < 0.75 * whole["nbytes"]


def test_detection_probabilities_and_challenge_counts() -> None:
    f = 0.01
    step = sliced.detection_probability(
        "step", forged_fraction=f, blocks=160, sequences=1024, opened=4
    )
    assert step == f and sliced.challenges_needed(step) == 299
    block = sliced.detection_probability(
        "block", forged_fraction=f, blocks=160, sequences=1024, opened=4
    )
    assert block == pytest.approx(f / 160)
    micro = sliced.detection_probability(
        "micro-batch", forged_fraction=f, blocks=160, sequences=1024, opened=4, per_micro_batch=4
    )
    # 1 - C(1020, 4) / C(1024, 4): about 4 * 4 / 1024.
    assert micro == pytest.approx(
        f * 2 / 160 * (1 - (1020 * 1019 * 1018 * 1017) / (1024 * 1023 * 1022 * 1021))
    )
    data = sliced.detection_probability(
        "data", forged_fraction=f, blocks=160, sequences=1024, opened=4, per_micro_batch=4
    )
    assert data == pytest.approx(micro * 160 / 2)  # any block's input check sees it
    assert sliced.challenges_needed(data) == 19256  # bench/scale_model.py's 70B row
    assert sliced.challenges_needed(1.0) == 1
    with pytest.raises(ValueError, match="unknown forgery"):
        sliced.detection_probability("layer", forged_fraction=f, blocks=1, sequences=1, opened=1)


def test_programs_carry_structure_and_no_weights_and_refuse_what_they_cannot_carry() -> None:
    blocks = [
        lm.TinyLM(lm.LMConfig(width=w, heads=2, layers=1, dropout=0.0)).blocks[0] for w in (16, 64)
    ]
    small, large = (
        sliced.export_program(b, (torch.zeros(1, 7, w),))
        for b, w in zip(blocks, (16, 64), strict=True)
    )
    # No weight in the archive: 16x the parameters, about the same bytes.
    assert abs(len(large) - len(small)) < 1024, (len(small), len(large))
    module = sliced.load_program(small)
    weights = {n: p.detach().double() for n, p in blocks[0].named_parameters()}
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    ours = torch.func.functional_call(module, weights, (x,))
    eager = torch.func.functional_call(blocks[0].double(), weights, (x,))
    assert torch.equal(ours, eager)

    class WithBuffer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    with pytest.raises(ValueError, match="'scale' is a buffer"):
        sliced.export_program(WithBuffer(), (torch.zeros(4),))

    class FixedDevice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.positions = torch.nn.Embedding(8, 4)

        def forward(self, row: torch.Tensor) -> torch.Tensor:
            return self.positions(torch.arange(row.shape[0], device=row.device))

    with pytest.raises(ValueError, match="new tensor on a fixed device"):
        sliced.export_program(FixedDevice(), (torch.zeros(5, dtype=torch.int64),))


def test_the_wire_formats_round_trip_and_name_what_is_malformed() -> None:
    lab = _train(0)
    run_file = lab.run_file(("ab" * 32,) * CONFIG.layers, "cd" * 32)
    again = sliced.RunFile.from_bytes(run_file.to_bytes())
    assert again == run_file and again.digest() == run_file.digest()
    challenge = _challenge(1, 1)
    opening = lab.open(challenge, [(0, 1), (1, 3)])
    read = sliced.opening_from_bytes(sliced.opening_to_bytes(opening))
    assert sliced.opening_to_bytes(read) == sliced.opening_to_bytes(opening)
    structure = lm.TinyLM(CONFIG).blocks[1]
    answer = lab.answer(challenge)
    projections = sliced.answer_from_bytes(
        sliced.answer_to_bytes(answer.projections), answer.projections.shape
    )
    verdict = verify_slice(
        lab.steps[1].commitment,
        challenge,
        sliced.SliceAnswer(projections),
        [(0, 1), (1, 3)],
        read,
        names=lab.names,
        layout=lab.layout,
        block=structure,
        chunk_bytes=lab.chunk_bytes,
        inputs=INPUTS,
        embed=_embed,
    )
    assert verdict.ok, verdict.message

    import cbor2

    body = cbor2.loads(run_file.to_bytes())
    cases = [
        ({**body, "chunk_bytes": 3}, "chunk_bytes"),
        ({**body, "programs": body["programs"][:1]}, "programs"),
        ({**body, "embed": "zz"}, "embed"),
        ({**body, "steps": [{**body["steps"][0], "grad": b"short"}]}, "steps[0].grad"),
        ({**body, "steps": body["steps"][1:]}, "steps[0].i"),
        ({**body, "inputs": ["nope"]}, "inputs[0]"),
    ]
    for changed, field in cases:
        with pytest.raises(sliced.SlicedFormatError) as caught:
            sliced.RunFile.from_bytes(cbor2.dumps(changed, canonical=True))
        assert caught.value.field == field, (field, caught.value)
    with pytest.raises(sliced.SlicedFormatError, match="expected 256 bytes"):
        sliced.answer_from_bytes(b"\0" * 8, (4, 2, 4))


# --- Trained on one CPU kernel family, checked on another ---------------------------------------

#: Every (step, block) of the run, checked on the same two sequences.
EVERY_SLICE = [(step, block) for step in range(STEPS) for block in range(CONFIG.layers)]
CROSS_SEQUENCES = [(0, 1), (1, 3)]


def _lab_files(out: Path) -> None:
    """The lab's side, as bytes: the run file, and each slice's answer and opening."""
    lab = _train(11)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run").write_bytes(lab.run_file(("ab" * 32,) * CONFIG.layers, "cd" * 32).to_bytes())
    for step, block in EVERY_SLICE:
        challenge = _challenge(step, block)
        answer = lab.answer(challenge)
        (out / f"answer-{step}-{block}").write_bytes(sliced.answer_to_bytes(answer.projections))
        opening = lab.open(challenge, CROSS_SEQUENCES)
        (out / f"opening-{step}-{block}").write_bytes(sliced.opening_to_bytes(opening))


def _platform_verdicts(out: Path) -> dict[str, Any]:
    """The platform's side, from those bytes alone: each slice's verdict and margins."""
    run = sliced.RunFile.from_bytes((out / "run").read_bytes())
    verdicts = {}
    for step, block in EVERY_SLICE:
        challenge = _challenge(step, block)
        answer = sliced.answer_from_bytes(
            (out / f"answer-{step}-{block}").read_bytes(),
            (challenge.projections, MICRO, ROWS),
        )
        verdict = verify_slice(
            run.steps[step],
            challenge,
            sliced.SliceAnswer(answer),
            CROSS_SEQUENCES,
            sliced.opening_from_bytes((out / f"opening-{step}-{block}").read_bytes()),
            names=run.names,
            layout=run.layout,
            block=lm.TinyLM(CONFIG).blocks[block],
            chunk_bytes=run.chunk_bytes,
            inputs=INPUTS,
            embed=_embed,
        )
        verdicts[f"{step}-{block}"] = {
            "ok": verdict.ok,
            "message": verdict.message,
            "margins": verdict.margins,
        }
    return {"capability": torch.backends.cpu.get_cpu_capability(), "verdicts": verdicts}


def _families() -> list[tuple[str, str]]:
    from zkdv.calibrate import kernel_families

    families = kernel_families()
    # Each family trains once and is checked by another (the platform's workers are
    # never the lab's machines): default -> avx2 -> avx512 -> default.
    return [(a, families[(i + 1) % len(families)]) for i, a in enumerate(families)]


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 kernel families")
@pytest.mark.timeout(900)  # a lab run and a verification per pair of kernel families, 300 s each
def test_honest_slices_pass_when_the_platform_runs_other_cpu_kernels(tmp_path: Path) -> None:
    pairs = _families()
    if len(pairs) < 2:
        pytest.skip("this CPU runs one Torch kernel family")
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), AGENT_PYTHONPATH]),
        "OMP_WAIT_POLICY": "PASSIVE",
    }

    def run(mode: str, capability: str, out: Path) -> dict[str, Any]:
        done = subprocess.run(
            [sys.executable, __file__, mode, str(out)],
            env={**environment, "ATEN_CPU_CAPABILITY": capability},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1]) if mode == "--verify" else {}

    for lab_family, platform_family in pairs:
        out = tmp_path / lab_family
        run("--lab", lab_family, out)
        result = run("--verify", platform_family, out)
        assert result["capability"] == platform_family.upper()
        for where, verdict in result["verdicts"].items():
            assert verdict["ok"], (lab_family, platform_family, where, verdict["message"])
            # Another family's rounding still uses a small share of every bound.
            assert max(verdict["margins"].values()) < 0.1, (where, verdict["margins"])


if __name__ == "__main__" and sys.argv[1:2] == ["--lab"]:
    torch.set_num_threads(1)
    _lab_files(Path(sys.argv[2]))
if __name__ == "__main__" and sys.argv[1:2] == ["--verify"]:
    torch.set_num_threads(1)
    print(json.dumps(_platform_verdicts(Path(sys.argv[2]))))
