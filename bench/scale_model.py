"""What a challenge costs at frontier scale: whole-step against sliced (docs/scale.md).

    python bench/scale_model.py [--opened 4] [--projections 4] [--flops 4e14]
                                [--hash-rate 50e9] [--link-gbit 10] [--forged 0.01]
                                [--target 0.95]
    python bench/scale_model.py --measure      # also the prototype, on this machine

A projection from stated assumptions (printed first), for Llama-shaped 7B, 70B and 405B
models (pre-norm blocks, grouped-query attention, SwiGLU MLP, untied embeddings):

* **whole-step challenge** (today): the platform downloads one snapshot (16 bytes per
  parameter: bf16 weights and gradient, fp32 master weights and Adam moments, the
  ZeRO accounting) and the step's batch, replays the whole step (6 x params x tokens
  FLOPs plus attention) and hashes the state before and after;
* **sliced challenge**: one *segment* (an attention or an MLP sublayer, or the
  embedding, or the final norm and head) of one step: its fp32 master weights, Adam
  moments and bf16 gradient (14 bytes per parameter; the bf16 weights are the master's
  rounding and are not moved), four boundary rows (activation and gradient, in and out,
  bf16) of each opened sequence, every sequence's Freivalds projections (float64), the
  input check's boundary-0 leaves and embedding chunks, and the audit paths; the
  platform replays the segment on the opened sequences and hashes what it opened and
  what it computed.

GPU-seconds are FLOPs over ``--flops`` (an H100-class effective rate: 989 TFLOP/s dense
bf16 at 40 % utilisation) plus hashing at ``--hash-rate`` bytes per second (device
BLAKE3). Challenge counts are for a detection probability of ``--target`` when
``--forged`` of the steps are forged, per forger (``zkdv.sliced.detection_probability``
gives the same formulas). The goal line is issue 32's: at 70B at most 1 % of the state
moved and at most 60 GPU-seconds of replay per sliced challenge.

``--measure`` also trains the prototype (``zkdv.sliced.TorchLab`` on
``examples/torch/lm.py``'s model, float32, 8 blocks) and prints the bytes moved and the
platform's seconds for one sliced challenge and for one whole-step replay of the same
step (``provers/sliced.py``), on this machine's CPU.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9


@dataclass(frozen=True)
class Model:
    name: str
    width: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    sequence: int
    tokens_per_step: int
    training_tokens: float

    @property
    def attention_params(self) -> int:
        head = self.width // self.heads
        return 2 * self.width * self.width + 2 * self.width * self.kv_heads * head + self.width

    @property
    def mlp_params(self) -> int:
        return 3 * self.width * self.ffn + self.width

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.width

    @property
    def head_params(self) -> int:
        return self.vocab * self.width + self.width

    @property
    def params(self) -> int:
        per_layer = self.attention_params + self.mlp_params
        return self.layers * per_layer + self.embedding_params + self.head_params

    @property
    def segments(self) -> list[int]:
        """Parameters of every segment a sliced challenge can draw."""
        return [self.embedding_params, self.head_params] + [
            self.attention_params,
            self.mlp_params,
        ] * self.layers

    @property
    def sequences(self) -> int:
        return self.tokens_per_step // self.sequence


# Llama 2 7B and 70B, Llama 3.1 405B shapes; tokens per step as their papers report.
MODELS = (
    Model("7B", 4096, 32, 11008, 32, 32, 32000, 4096, 4 * 2**20, 2e12),
    Model("70B", 8192, 80, 28672, 64, 8, 32000, 4096, 4 * 2**20, 24e12),
    Model("405B", 16384, 126, 53248, 128, 8, 128256, 8192, 16 * 2**20, 15.6e12),
)

STATE_BYTES = 16  # per parameter, the snapshot (issue 32)
SLICE_BYTES = 14  # per parameter opened: fp32 master, m, v (12) and the bf16 gradient (2)
POST_BYTES = 12  # per parameter the platform computes and hashes: fp32 master, m, v
ACTIVATION_BYTES = 2  # bf16 boundary rows
ROWS_PER_SEQUENCE = 4  # activation and gradient, at the segment's input and output
TENSORS_PER_SEGMENT = 4  # at most (norm, gate, up, down)
TREES = 7  # pre params, m, v, gradient; post params, m, v
INPUT_LEAF_TOKENS = 64  # boundary 0 is committed in leaves of 64 tokens (the input check)
INPUTS = ("tokens.weight", "positions.weight")  # the prototype's input check reads these


def miss(population: int, marked: int, drawn: int) -> float:
    if drawn > population - marked:
        return 0.0
    return math.comb(population - marked, drawn) / math.comb(population, drawn)


def needed(p: float, target: float) -> int:
    return 1 if p >= 1.0 else math.ceil(math.log(1.0 - target) / math.log(1.0 - p))


def attention_flops(model: Model, sequences: int) -> float:
    """Causal attention's score and value products, forward and backward (3x forward)."""
    return 3 * 2 * model.sequence**2 * model.width * sequences


def whole_step(model: Model, args: argparse.Namespace) -> tuple[float, float]:
    """Bytes moved and GPU-seconds of one whole-step challenge."""
    moved = STATE_BYTES * model.params + 4 * model.tokens_per_step
    flops = 6 * model.params * model.tokens_per_step + model.layers * attention_flops(
        model, model.sequences
    )
    hashed = 2 * STATE_BYTES * model.params
    return moved, flops / args.flops + hashed / args.hash_rate


def sliced(
    model: Model, segment: int, attention: bool, args: argparse.Namespace
) -> tuple[float, float]:
    """Bytes moved and GPU-seconds of one sliced challenge of a segment of ``segment`` params."""
    rows = args.opened * ROWS_PER_SEQUENCE * model.sequence * model.width * ACTIVATION_BYTES
    projections = args.projections * model.sequences * 8
    paths = TREES * TENSORS_PER_SEGMENT * 32 * (math.ceil(math.log2(9 * model.layers + 3)) + 1)
    row_paths = (
        args.opened
        * ROWS_PER_SEQUENCE
        * 32
        * math.ceil(math.log2(4 * (model.layers + 1) * model.sequences))
    )
    # The input check: at each of --input-positions random positions of each opened
    # sequence, one 64-token leaf of boundary 0 and the 1 MiB chunk of the embedding
    # table that holds the token's row.
    inputs = args.input_positions * args.opened * (INPUT_LEAF_TOKENS * model.width * 2 + 2**20)
    moved = SLICE_BYTES * segment + rows + projections + paths + row_paths + inputs
    flops = 6 * segment * args.opened * model.sequence
    if attention:
        flops += attention_flops(model, args.opened)
    flops += 2 * args.projections * segment  # Freivalds: <R, G> for each direction
    hashed = SLICE_BYTES * segment + POST_BYTES * segment + rows + inputs
    return moved, flops / args.flops + hashed / args.hash_rate


def project(args: argparse.Namespace) -> None:
    print("assumptions")
    print(
        f"  state {STATE_BYTES} B/param (snapshot); a slice opens {SLICE_BYTES} B/param of its segment"
    )
    print(f"  effective GPU rate {args.flops:.3g} FLOP/s (H100-class: 989e12 dense bf16 x 40 %)")
    print(f"  device hashing {args.hash_rate / GB:.0f} GB/s; link {args.link_gbit} Gbit/s")
    print(
        f"  sliced: {args.opened} opened sequences, {args.projections} Freivalds directions, "
        f"bf16 boundary rows; forged steps {args.forged:.0%}, target {args.target:.0%}"
    )
    print(
        f"  input check: {args.input_positions} positions per opened sequence, each a "
        f"{INPUT_LEAF_TOKENS}-token boundary-0 leaf and a 1 MiB embedding chunk"
    )
    print(
        f"  {args.ranks} data-parallel micro-batches per step; a lie in the projections must "
        f"spread over sqrt(n) / {args.outlier_z:g} sequences\n  to pass the outlier test "
        "(per-sequence gradients independent: the forger's best case)"
    )
    print()
    header = (
        f"{'model':>5} {'params':>8} {'state':>9} {'tok/step':>9} {'seqs':>5} {'segs':>4} "
        f"{'whole GB':>9} {'whole GPU-s':>11} {'slice GB':>9} {'% state':>7} "
        f"{'slice GPU-s':>11} {'transfer s':>10}"
    )
    print(header)
    rows = []
    for model in MODELS:
        whole_bytes, whole_seconds = whole_step(model, args)
        largest = max(
            (sliced(model, model.mlp_params, False, args), "mlp"),
            (sliced(model, model.attention_params, True, args), "attention"),
            (sliced(model, model.embedding_params, False, args), "embedding"),
            (sliced(model, model.head_params, False, args), "head"),
        )
        (slice_bytes, slice_seconds), _ = largest
        state = STATE_BYTES * model.params
        rows.append((model, whole_bytes, whole_seconds, slice_bytes, slice_seconds, state))
        print(
            f"{model.name:>5} {model.params / 1e9:>7.2f}B {state / 1e12:>7.3f}TB "
            f"{model.tokens_per_step:>9} {model.sequences:>5} {len(model.segments):>4} "
            f"{whole_bytes / GB:>9.1f} {whole_seconds:>11.0f} {slice_bytes / GB:>9.2f} "
            f"{100 * slice_bytes / state:>6.2f}% {slice_seconds:>11.2f} "
            f"{slice_bytes * 8 / (args.link_gbit * 1e9):>10.1f}"
        )
    print("  (slice: the largest segment, the worst case; whole: one snapshot and one batch)")
    print()
    print(f"challenges for {args.target:.0%} detection at {args.forged:.0%} forged steps")
    print(
        f"{'model':>5} {'forger':<40} {'p/challenge':>11} {'challenges':>10} "
        f"{'moved TB':>9} {'GPU-hours':>9}"
    )
    for model, whole_bytes, whole_seconds, slice_bytes, slice_seconds, _ in rows:
        n, k = model.sequences, args.opened
        segments = len(model.segments)
        per_micro = max(1, n // args.ranks)
        spread = math.ceil(math.sqrt(n) / args.outlier_z)
        forgers = [
            ("whole-step: any forgery", args.forged, whole_bytes, whole_seconds),
            ("sliced: step forged, honest c_i", args.forged, slice_bytes, slice_seconds),
            (
                f"sliced: step forged, lies in {spread} seqs",
                args.forged * (1 - miss(n, spread, k)),
                slice_bytes,
                slice_seconds,
            ),
            ("sliced: one segment's update", args.forged / segments, slice_bytes, slice_seconds),
            (
                f"sliced: one micro-batch's data ({per_micro} seqs)",
                args.forged * (1 - miss(n, per_micro, k)),
                slice_bytes,
                slice_seconds,
            ),
            (
                "sliced: one segment, lie in 1 seq",
                args.forged / segments * (1 - miss(n, 1, k)),
                slice_bytes,
                slice_seconds,
            ),
        ]
        for label, p, moved, seconds in forgers:
            count = needed(p, args.target)
            print(
                f"{model.name:>5} {label:<40} {p:>11.3g} {count:>10} "
                f"{count * moved / 1e12:>9.1f} {count * seconds / 3600:>9.1f}"
            )
    print()
    model, _, _, slice_bytes, slice_seconds, state = rows[1]
    bytes_ok = slice_bytes <= 0.01 * state
    seconds_ok = slice_seconds <= 60.0
    print(
        f"goal at {model.name}: moved per sliced challenge {slice_bytes / GB:.2f} GB <= "
        f"{0.01 * state / GB:.2f} GB (1 % of state): {'met' if bytes_ok else 'NOT met'}; "
        f"replay {slice_seconds:.2f} GPU-s <= 60: {'met' if seconds_ok else 'NOT met'}"
    )


def measure(args: argparse.Namespace) -> None:
    """Train the prototype and time one sliced and one whole-step challenge of one step."""
    import importlib.util
    import time

    sys.path[:0] = [
        str(ROOT),
        str(ROOT / "agent" / "zkdv" / "src"),
        str(ROOT / "agent" / "dvbench" / "src"),
    ]
    import torch
    from torch.nn import functional

    from provers.sliced import replay_whole_step, verify_slice
    from zkdv import sliced as zs

    spec = importlib.util.spec_from_file_location("lm", ROOT / "examples" / "torch" / "lm.py")
    assert spec is not None and spec.loader is not None
    lm = importlib.util.module_from_spec(spec)
    sys.modules["lm"] = lm  # dataclasses look their module up while the class is built
    spec.loader.exec_module(lm)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = lm.LMConfig(width=64, heads=4, layers=8, context=32, dropout=0.0)
    micro, rows = 4, 8

    def loss(model: object, batch: torch.Tensor) -> torch.Tensor:
        logits = model(batch[:, :-1])  # type: ignore[operator]
        value = functional.cross_entropy(logits.reshape(-1, config.vocab), batch[:, 1:].reshape(-1))
        return value / micro

    def embed(tables: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens[:-1]
        return tables["tokens.weight"][ids] + tables["positions.weight"][: ids.shape[0]]

    torch.manual_seed(0)
    model = lm.TinyLM(config)
    lab = zs.TorchLab(
        model,
        [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)],
        {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
        inputs=INPUTS,
    )
    started = time.perf_counter()
    for batch in lm.token_batches(config, steps=3, micro_batches=micro, rows=rows, seed=1):
        lab.step(batch, loss)
    train_seconds = time.perf_counter() - started
    names = [n for n, _ in model.named_parameters()]
    step = 1
    whole = lab.whole_step(step)
    platform = lm.TinyLM(config)
    whole_verdict = replay_whole_step(
        lab.steps[step].commitment, whole, model=platform, loss=loss, chunk_bytes=lab.chunk_bytes
    )
    print(
        f"prototype: {sum(p.numel() for p in model.parameters())} parameters, "
        f"{config.layers} blocks, {micro} x {rows} sequences of {config.context} tokens, "
        f"3 steps trained and committed in {train_seconds:.2f} s"
    )
    print(f"{'challenge':<26} {'bytes moved':>12} {'platform s':>10} {'verdict':>8}")
    print(
        f"{'whole step ' + str(step):<26} {whole['nbytes']:>12} {whole_verdict.seconds:>10.3f} "
        f"{'ok' if whole_verdict.ok else whole_verdict.reason:>8}"
    )
    for block in (0, config.layers - 1):
        challenge = zs.SliceChallenge(step, block, bytes([block + 1]) * 32, args.projections)
        lab_started = time.perf_counter()
        answer = lab.answer(challenge)
        lab_seconds = time.perf_counter() - lab_started
        sequences = zs.draw_sequences(
            bytes(32), challenge, answer.digest(), micro_batches=micro, rows=rows, count=args.opened
        )
        opening = lab.open(challenge, sequences)
        verdict = verify_slice(
            lab.steps[step].commitment,
            challenge,
            answer,
            sequences,
            opening,
            names=names,
            layout=lab.layout,
            block=platform.blocks[block],
            chunk_bytes=lab.chunk_bytes,
            inputs=INPUTS,
            embed=embed,
        )
        label = f"sliced: step {step} block {block}"
        print(
            f"{label:<26} {opening.nbytes + answer.nbytes:>12} {verdict.seconds:>10.3f} "
            f"{'ok' if verdict.ok else verdict.reason:>8}   (lab's answer {lab_seconds:.3f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opened", type=int, default=4, help="sequences opened per slice")
    parser.add_argument("--projections", type=int, default=4, help="Freivalds directions")
    parser.add_argument(
        "--input-positions", type=int, default=8, help="input check: positions per sequence"
    )
    parser.add_argument("--flops", type=float, default=989e12 * 0.4, help="effective FLOP/s")
    parser.add_argument("--hash-rate", type=float, default=50e9, help="device hashing B/s")
    parser.add_argument("--link-gbit", type=float, default=10.0)
    parser.add_argument("--forged", type=float, default=0.01)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument(
        "--ranks", type=int, default=256, help="data-parallel ranks (one micro-batch each)"
    )
    parser.add_argument(
        "--outlier-z", type=float, default=6.0, help="outlier test on the projections"
    )
    parser.add_argument("--measure", action="store_true", help="also time the prototype")
    parser.add_argument("--threads", type=int, default=1, help="--measure: CPU threads")
    args = parser.parse_args()
    project(args)
    if args.measure:
        print()
        measure(args)


if __name__ == "__main__":
    main()
