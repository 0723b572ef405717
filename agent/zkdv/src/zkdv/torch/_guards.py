"""Branches the attested step took on its batch's values, checked at every step.

Tracing records the operators one run of the attested step executed. Where Python
reads a value out of a tensor and branches on it (``if mask.all():``, ``.item()``), the
trace keeps only the branch taken at sealing. Hugging Face ``transformers`` does this
for every attention layer: an unpadded batch lets SDPA run with ``is_causal=True``
instead of an explicit mask. A later batch that takes the other branch in eager
training would then be replayed through the sealed branch: a false alarm on an honest
run.

So every such read whose value depends only on the batch becomes a **guard**: a small
graph (the part of the trace that computes those values, nothing else) evaluated on
each transaction's batch before its step runs. A batch whose values differ from the
sealed ones is refused with :data:`BRANCH_CHANGED` before anything is committed. The
sealed values are recorded in the root record (``env.program.guards``) for auditors.
Reads that depend on parameters (``loss.item()`` for logging) are not guards: the
program is the recorded computation, and branching on such values inside the attested
step is not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

__all__ = ["BRANCH_CHANGED", "Guards", "extract"]

BRANCH_CHANGED = (
    "this batch takes another branch of the attested step than the sealed program: the "
    "step reads a value from its batch and branches on it (a Python condition on a "
    "tensor or .item(); transformers does so to skip the attention mask of an unpadded "
    "batch), and value {index} ({where}) was {sealed!r} when the program was sealed but "
    "is {now!r} for this batch. Keep such batches uniform (pad every batch the same "
    "way, or never), or make the branch independent of the data"
)

_READ = torch.ops.aten._local_scalar_dense.default


@dataclass(frozen=True)
class Guards:
    """The batch-dependent values the sealed program assumes.

    Attributes:
        module: computes the values from the flat program inputs, or None (no guard).
        values: the values at sealing.
        where: for each, the operator whose result was read (for messages).
    """

    module: fx.GraphModule | None
    values: tuple[Any, ...]
    where: tuple[str, ...]

    def check(self, arguments: Sequence[torch.Tensor]) -> None:
        """Raise when ``arguments`` (the flat inputs of one step) take another branch.

        Raises:
            RuntimeError: :data:`BRANCH_CHANGED`.
        """
        if self.module is None:
            return
        with torch.no_grad():
            now = tuple(self.module(*arguments))
        for index, (sealed, value, where) in enumerate(
            zip(self.values, now, self.where, strict=True)
        ):
            if sealed != value:
                raise RuntimeError(
                    BRANCH_CHANGED.format(index=index, where=where, sealed=sealed, now=value)
                )

    def to_record(self) -> list[dict[str, Any]]:
        return [
            {"read": where, "value": value}
            for where, value in zip(self.where, self.values, strict=True)
        ]


def _placeholders_of(node: fx.Node, memo: dict[fx.Node, frozenset[fx.Node]]) -> frozenset[fx.Node]:
    stack = [node]
    order: list[fx.Node] = []
    while stack:
        current = stack.pop()
        if current in memo or current in order:
            continue
        order.append(current)
        stack.extend(current.all_input_nodes)
    for current in reversed(order):
        if current in memo:
            continue
        if current.op == "placeholder":
            memo[current] = frozenset({current})
        else:
            found: frozenset[fx.Node] = frozenset()
            for parent in current.all_input_nodes:
                found |= memo.get(parent, frozenset())
            memo[current] = found
    return memo[node]


def extract(graph: fx.GraphModule, arguments: Sequence[torch.Tensor], first_batch: int) -> Guards:
    """Split the value reads out of a traced ``graph`` (which is modified in place).

    Args:
        graph: the trace, made with data-dependent reads allowed; its reads are removed
            (their values are already baked into what follows them).
        arguments: the inputs the trace ran on.
        first_batch: the index of the first batch input among the placeholders.

    Returns:
        The guards: the reads that depend on batch inputs only.
    """
    placeholders = [node for node in graph.graph.nodes if node.op == "placeholder"]
    batch = set(placeholders[first_batch:])
    memo: dict[fx.Node, frozenset[fx.Node]] = {}
    reads = [
        node for node in graph.graph.nodes if node.op == "call_function" and node.target is _READ
    ]
    guarded = [node for node in reads if _placeholders_of(node, memo) <= batch]
    module: fx.GraphModule | None = None
    values: tuple[Any, ...] = ()
    where: tuple[str, ...] = ()
    if guarded:
        copy = fx.Graph()
        mapping: dict[fx.Node, fx.Node] = {}
        copy.graph_copy(graph.graph, mapping)
        copy.output(tuple(mapping[node] for node in guarded))
        # Only what the reads need. FX's default keeps every node it deems impure
        # (random draws, in-place operators) whether or not the outputs read it: on a
        # Hugging Face model with dropout that was the whole step, run a second time
        # before every step (a GPT-2 Trainer step took 2.2 times as long).
        copy.eliminate_dead_code(is_impure_node=lambda node: node.op in ("placeholder", "output"))
        module = fx.GraphModule(graph, copy)
        with torch.no_grad():
            values = tuple(module(*arguments))
        where = tuple(_source(node) for node in guarded)
    for node in reads:
        if not node.users:
            graph.graph.erase_node(node)
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return Guards(module, values, where)


def _source(node: fx.Node) -> str:
    parent = node.all_input_nodes[0] if node.all_input_nodes else None
    if parent is None or parent.op != "call_function":
        return "a tensor value"
    return f"the value of {getattr(parent.target, '__name__', parent.target)}"
