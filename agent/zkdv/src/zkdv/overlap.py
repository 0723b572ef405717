"""Per-transaction training and verification overlap policies."""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ALWAYS", "NEVER", "UNCHECKED", "Policy"]


class Policy(IntEnum):
    """Control how a transaction shares device-buffer residency with its neighbors.

    * ``ALWAYS``: a sampled check releases the training slot as soon as it holds its
      inputs; training and verification overlap (two generations plus workspace).
    * ``UNCHECKED`` (default): commitments pipeline, a sampled check is a fence; at most
      one already-admitted successor is retained while the check completes.
    * ``NEVER``: no successor is admitted until the current commitment and any sampled
      check retire.
    """

    ALWAYS = 0
    UNCHECKED = 1
    NEVER = 2


ALWAYS = Policy.ALWAYS
UNCHECKED = Policy.UNCHECKED
NEVER = Policy.NEVER
