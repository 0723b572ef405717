"""The lab's side of the prototype for a Torch model: :class:`TorchLab`.

It trains with hooks on each block, commits every step (:class:`~zkdv.sliced.StepCommitment`)
and answers sliced challenges from what it keeps in memory. Torch is imported only when
a lab is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zkdv.merkle import StateCommitment, commit_state, inclusion_path, merkle_root
from zkdv.sliced._challenges import SliceChallenge
from zkdv.sliced._commitment import (
    _KINDS,
    ACTIVATION,
    GRADIENT,
    BlockLayout,
    Leaves,
    StepCommitment,
    _row_index,
    batch_leaves,
    optimizer_paths,
    row_leaves,
    side_file_digest,
)
from zkdv.sliced._openings import (
    BatchRowOpening,
    RowOpening,
    SliceAnswer,
    SliceOpening,
    TensorOpening,
    _digest_path,
    _open_tensor,
)
from zkdv.sliced._projections import projection_directions, sequence_projections


@dataclass
class _Step:
    commitment: StepCommitment
    params: Leaves
    opt_state: Leaves
    grad: Leaves
    pre: tuple[StateCommitment, StateCommitment]
    post: tuple[StateCommitment, StateCommitment]
    grad_tree: StateCommitment
    #: ``[micro][boundary][kind]`` arrays of shape ``(rows, length, width)``.
    boundaries: list[list[dict[str, np.ndarray]]]
    batch: np.ndarray


@dataclass
class TorchLab:
    """The lab's side of the prototype, for a Torch model of sequential blocks.

    Per step it records, with hooks, each block's input and output activations and the
    loss gradients at them for every micro-batch; accumulates the gradient; commits the
    pre-state, the gradient and the boundary rows; applies AdamW through the canonical
    update (``zkdv.torch.optimizers.canonical``, bitwise reproducible); and commits the
    post-state. It keeps everything in memory and answers sliced challenges from it.

    Args:
        model: the model; its ``named_parameters()`` order is the committed order.
        blocks: ``(name, module)`` of each block, in forward order; a block maps one
            tensor to one tensor of the same shape.
        group: AdamW's options (``lr``, ``betas``, ``eps``, ``weight_decay``).
        chunk_bytes: Merkle chunk size of the state trees.
        inputs: the parameters that map a batch row to boundary 0 (the embedding's);
            with them, every slice also opens what the platform's input check reads.
        tamper: test hooks that forge the run (``docs/scale.md`` lists the forgeries).
    """

    model: Any
    blocks: Sequence[tuple[str, Any]]
    group: dict[str, Any]
    chunk_bytes: int = 1 << 16
    inputs: tuple[str, ...] = ()
    tamper: dict[str, Callable[..., None]] = field(default_factory=dict)
    steps: list[_Step] = field(default_factory=list)

    def __post_init__(self) -> None:
        import torch

        self._names = [name for name, _ in self.model.named_parameters()]
        self._params = dict(self.model.named_parameters())
        self._state = {
            name: {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
            for name, p in self._params.items()
        }
        self.layout = BlockLayout(
            tuple(
                (prefix, tuple(n for n in self._names if n.startswith(prefix + ".")))
                for prefix, _ in self.blocks
            )
        )

    # The three trees, as numpy leaves in committed order.
    def _leaves(self) -> tuple[Leaves, Leaves]:
        params = [(n, self._params[n].detach().numpy().copy()) for n in self._names]
        opt: Leaves = []
        for n in self._names:
            s = self._state[n]
            paths = optimizer_paths(n)
            opt += [
                (paths[0], s["exp_avg"].numpy().copy()),
                (paths[1], s["exp_avg_sq"].numpy().copy()),
                (paths[2], s["step"].numpy().reshape(()).copy()),
            ]
        return params, opt

    def step(self, batch: Any, loss: Callable[[Any, Any], Any]) -> float:
        """One training step over ``batch`` (``(micro_batches, rows, ...)``); returns the loss.

        ``loss(model, micro_batch)`` is the micro-batch's loss, already divided by the
        number of micro-batches (the gradient is their sum).
        """
        index = len(self.steps)
        params, opt = self._leaves()
        pre = (commit_state(params, self.chunk_bytes), commit_state(opt, self.chunk_bytes))
        boundaries, total = self._forward_backward(batch, loss)
        gradients = {n: self._params[n].grad.detach().clone() for n in self._names}
        if "gradient" in self.tamper:
            self.tamper["gradient"](index, gradients)
        if "boundaries" in self.tamper:
            self.tamper["boundaries"](index, boundaries)
        grad_leaves = [(f"params:{n}", gradients[n].numpy().copy()) for n in self._names]
        grad_tree = commit_state(grad_leaves, self.chunk_bytes)
        shape = (len(boundaries), len(self.blocks) + 1, int(batch.shape[1]))
        boundary_root = merkle_root(row_leaves(boundaries))
        committed_batch = batch.detach().numpy().copy()
        if "batch" in self.tamper:
            self.tamper["batch"](index, committed_batch)
        batch_root = merkle_root(batch_leaves(committed_batch))
        post = self._update(index, gradients)
        commitment = StepCommitment(
            index,
            (pre[0].root, pre[1].root),
            (post[0].root, post[1].root),
            grad_tree.root,
            boundary_root,
            batch_root,
            shape,
            self._hyperparameters(),
        )
        self.steps.append(
            _Step(
                commitment,
                params,
                opt,
                grad_leaves,
                pre,
                post,
                grad_tree,
                boundaries,
                committed_batch,
            )
        )
        return total

    def _forward_backward(
        self, batch: Any, loss: Callable[[Any, Any], Any]
    ) -> tuple[list[list[dict[str, np.ndarray]]], float]:
        """Accumulate every micro-batch's gradient, keeping each block's boundary rows.

        Returns ``[micro][boundary][kind]`` float32 rows and the summed loss.
        """
        boundaries: list[list[dict[str, np.ndarray]]] = []
        total = 0.0
        for micro in batch.unbind(0):
            acts: list[Any] = [None] * (len(self.blocks) + 1)
            grads: list[Any] = [None] * (len(self.blocks) + 1)
            handles = [
                self.blocks[0][1].register_forward_pre_hook(_keeper(0, acts, grads, pre=True))
            ]
            handles += [
                module.register_forward_hook(_keeper(b + 1, acts, grads, pre=False))
                for b, (_, module) in enumerate(self.blocks)
            ]
            try:
                value = loss(self.model, micro)
                value.backward()
            finally:
                for handle in handles:
                    handle.remove()
            total += float(value.detach())
            boundaries.append(
                [
                    {
                        ACTIVATION: a.numpy().astype(np.float32),
                        GRADIENT: g.numpy().astype(np.float32),
                    }
                    for a, g in zip(acts, grads, strict=True)
                ]
            )
        return boundaries, total

    def _update(
        self, index: int, gradients: dict[str, Any]
    ) -> tuple[StateCommitment, StateCommitment]:
        """Apply AdamW canonically to the committed gradient; commit the post-state."""
        import torch

        from zkdv.torch.optimizers import canonical

        canonical.update(
            "AdamW",
            [self._params[n].data for n in self._names],
            [gradients[n] for n in self._names],
            [self._state[n] for n in self._names],
            {**self.group, "amsgrad": False, "maximize": False},
        )
        for p in self._params.values():
            p.grad = None
        if "post" in self.tamper:
            with torch.no_grad():
                self.tamper["post"](index, self._params)
        post_params, post_opt = self._leaves()
        return (
            commit_state(post_params, self.chunk_bytes),
            commit_state(post_opt, self.chunk_bytes),
        )

    def _hyperparameters(self) -> dict[str, float]:
        """AdamW's hyperparameters as the step commitment records them."""
        hp = {k: float(v) for k, v in self.group.items() if k in ("lr", "eps", "weight_decay")}
        hp["beta1"], hp["beta2"] = (float(b) for b in self.group["betas"])
        return hp

    @property
    def names(self) -> list[str]:
        """The committed parameter order (``named_parameters()``, tied ones once)."""
        return list(self._names)

    @property
    def commitments(self) -> list[StepCommitment]:
        return [s.commitment for s in self.steps]

    def digest(self) -> bytes:
        return side_file_digest(self.layout, self.commitments)

    def programs(self, embed: Any | None = None) -> tuple[tuple[str, ...], str, dict[str, bytes]]:
        """Each block's program and the embedding's, for the platform (after a first step).

        ``embed`` is a module whose parameters are named as :attr:`inputs` and which maps
        one committed batch row to its boundary-0 row (the input check), or None without
        it. Blocks of one structure export to the same bytes (:func:`export_program`).

        Returns:
            ``(programs, embed_digest, archives)``: each block's SHA-256 (hex), the
            embedding's (empty without one), and every archive by its SHA-256.
        """
        import hashlib

        import torch

        from zkdv.sliced._wire import export_program

        if not self.steps:
            raise ValueError("programs are exported from a recorded step's shapes; train first")
        first = self.steps[0]
        archives: dict[str, bytes] = {}

        def keep(data: bytes) -> str:
            digest = hashlib.sha256(data).hexdigest()
            archives[digest] = data
            return digest

        blocks = tuple(
            keep(
                export_program(module, (torch.from_numpy(first.boundaries[0][b][ACTIVATION][0:1]),))
            )
            for b, (_, module) in enumerate(self.blocks)
        )
        embed_digest = ""
        if embed is not None:
            embed_digest = keep(export_program(embed, (torch.from_numpy(first.batch[0, 0]),)))
        return blocks, embed_digest, archives

    def run_file(self, programs: Sequence[str], embed: str = "") -> Any:
        """The run file the platform files (:class:`zkdv.sliced.RunFile`), after training."""
        from zkdv.sliced._wire import RunFile

        return RunFile(
            self.layout,
            tuple(self._names),
            self.chunk_bytes,
            tuple(self.inputs),
            tuple(programs),
            embed,
            tuple(self.commitments),
        )

    def _block_indices(self, block: int) -> tuple[list[int], list[int]]:
        names = self.layout.names(block)
        params = [self._names.index(n) for n in names]
        opt = [3 * i + k for i in params for k in range(3)]
        return params, opt

    def answer(
        self, challenge: SliceChallenge, *, lie: Callable[..., None] | None = None
    ) -> SliceAnswer:
        """The projections ``c`` of every sequence of the challenged step and block.

        ``lie(c)`` edits them before they are sent (a forger's test hook).
        """
        import torch

        record = self.steps[challenge.step]
        params_index, _ = self._block_indices(challenge.block)
        prefix, module = self.blocks[challenge.block]
        specs = [record.pre[0].specs[i] for i in params_index]
        directions = projection_directions(challenge.seed, specs, challenge.projections)
        weights = {
            record.params[i][0][len(prefix) + 1 :]: torch.from_numpy(record.params[i][1])
            for i in params_index
        }
        micro_batches, _, rows = record.commitment.shape
        c = np.zeros((challenge.projections, micro_batches, rows))
        for m in range(micro_batches):
            rows_m = record.boundaries[m]
            h_in = torch.from_numpy(rows_m[challenge.block][ACTIVATION])
            dh_out = torch.from_numpy(rows_m[challenge.block + 1][GRADIENT])
            _, _, projected, _ = sequence_projections(module, weights, h_in, dh_out, directions)
            c[:, m, :] = projected
        if lie is not None:
            lie(c)
        return SliceAnswer(c)

    def open(self, challenge: SliceChallenge, sequences: Sequence[tuple[int, int]]) -> SliceOpening:
        """Open the challenged block's tensors and the drawn sequences' boundary rows."""
        record = self.steps[challenge.step]
        params_index, opt_index = self._block_indices(challenge.block)
        leaves = row_leaves(record.boundaries)
        _, boundaries, rows = record.commitment.shape
        opened_rows = []
        wanted = [
            (boundary, kind)
            for boundary in (challenge.block, challenge.block + 1)
            for kind in _KINDS
        ]
        if self.inputs and challenge.block != 0:
            wanted.append((0, ACTIVATION))  # what the input check compares
        for micro, row in sequences:
            for boundary, kind in wanted:
                data = record.boundaries[micro][boundary][kind][row]
                index = _row_index(micro, boundary, kind, row, (boundaries, rows))
                opened_rows.append(
                    RowOpening(
                        micro, boundary, kind, row, data, tuple(inclusion_path(leaves, index))
                    )
                )
        inputs: tuple[TensorOpening, ...] = ()
        batch_rows: tuple[BatchRowOpening, ...] = ()
        if self.inputs:
            inputs = tuple(
                _open_tensor(record.pre[0], record.params, self._names.index(name))
                for name in self.inputs
            )
            committed_rows = batch_leaves(record.batch)
            batch_rows = tuple(
                BatchRowOpening(
                    micro,
                    row,
                    record.batch[micro, row],
                    tuple(inclusion_path(committed_rows, micro * rows + row)),
                )
                for micro, row in sequences
            )
        return SliceOpening(
            inputs=inputs,
            batch_rows=batch_rows,
            params=tuple(_open_tensor(record.pre[0], record.params, i) for i in params_index),
            opt_state=tuple(_open_tensor(record.pre[1], record.opt_state, i) for i in opt_index),
            grad=tuple(_open_tensor(record.grad_tree, record.grad, i) for i in params_index),
            post_params=tuple(_digest_path(record.post[0], i) for i in params_index),
            post_opt_state=tuple(_digest_path(record.post[1], i) for i in opt_index),
            rows=tuple(opened_rows),
        )

    def whole_step(self, step: int) -> dict[str, Any]:
        """What a whole-step challenge moves today: the full pre-state, gradient and batch."""
        record = self.steps[step]
        leaves = (*record.params, *record.opt_state, *record.grad)
        return {
            "commitment": record.commitment,
            "params": record.params,
            "opt_state": record.opt_state,
            "grad": record.grad,
            "batch": record.batch,
            "nbytes": sum(int(a.nbytes) for _, a in leaves) + int(record.batch.nbytes),
        }


def _keeper(position: int, acts: list[Any], grads: list[Any], *, pre: bool) -> Callable[..., None]:
    """A forward (pre-)hook that keeps a boundary activation and, later, its gradient."""

    def keep(_module: Any, inputs: Any, output: Any = None) -> None:
        tensor = inputs[0] if pre else output
        acts[position] = tensor.detach().clone()

        def on_grad(gradient: Any) -> None:
            grads[position] = gradient.detach().clone()

        tensor.register_hook(on_grad)

    return keep
