"""Functional bridge contract for :class:`torch.optim.AdamW`."""

from __future__ import annotations

import torch

from zkdv.torch.optimizers.adam import AdamContract

__all__ = ["AdamWContract"]


class AdamWContract(AdamContract):
    """AdamW (Loshchilov and Hutter 2019): Adam's core with decoupled weight decay.

    ``torch.optim.AdamW`` is ``Adam(decoupled_weight_decay=True)``; its groups carry
    that flag, so the update is the same functional call.
    """

    optimizer_type = torch.optim.AdamW
