"""Exact-type registry for Torch functional optimizer contracts."""

from __future__ import annotations

import torch

from zkdv.torch.optimizers.adadelta import AdadeltaContract
from zkdv.torch.optimizers.adafactor import AdafactorContract
from zkdv.torch.optimizers.adagrad import AdagradContract
from zkdv.torch.optimizers.adam import AdamContract
from zkdv.torch.optimizers.adamax import AdamaxContract
from zkdv.torch.optimizers.adamw import AdamWContract
from zkdv.torch.optimizers.asgd import ASGDContract
from zkdv.torch.optimizers.base import OptimizerContract
from zkdv.torch.optimizers.lbfgs import LBFGSContract
from zkdv.torch.optimizers.muon import MuonContract
from zkdv.torch.optimizers.nadam import NAdamContract
from zkdv.torch.optimizers.radam import RAdamContract
from zkdv.torch.optimizers.rmsprop import RMSpropContract
from zkdv.torch.optimizers.rprop import RpropContract
from zkdv.torch.optimizers.sgd import SGDContract
from zkdv.torch.optimizers.sparse_adam import SparseAdamContract

__all__ = ["UNKNOWN_OPTIMIZER", "OptimizerRegistry"]

UNKNOWN_OPTIMIZER = (
    "ZKDV has no functional contract for {name}; call "
    "proof.register_functional_optimizer({name}, contract) with an OptimizerContract "
    "that names its state and functional update"
)


class OptimizerRegistry:
    """Resolve prepared optimizers without optimizer branching elsewhere.

    Lookup is by exact type: a subclass of ``torch.optim.Adam`` may change ``step()``
    arbitrarily, so it is rejected until its own contract is registered.
    """

    def __init__(self) -> None:
        self._contracts: dict[type[torch.optim.Optimizer], OptimizerContract] = {}
        for contract in (
            ASGDContract(),
            AdadeltaContract(),
            AdafactorContract(),
            AdagradContract(),
            AdamContract(),
            AdamWContract(),
            AdamaxContract(),
            LBFGSContract(),
            MuonContract(),
            NAdamContract(),
            RAdamContract(),
            RMSpropContract(),
            RpropContract(),
            SGDContract(),
            SparseAdamContract(),
        ):
            self.register(contract)

    def register(
        self,
        contract: OptimizerContract,
        optimizer_type: type[torch.optim.Optimizer] | None = None,
    ) -> None:
        """Use ``contract`` for optimizers of exactly ``optimizer_type``.

        Raises:
            TypeError: the contract or the type is not what it must be.
        """
        if not isinstance(contract, OptimizerContract):
            raise TypeError(f"{contract!r} is not a zkdv.torch.optimizers.OptimizerContract")
        kind = optimizer_type if optimizer_type is not None else contract.optimizer_type
        if not isinstance(kind, type) or not issubclass(kind, torch.optim.Optimizer):
            raise TypeError(f"{kind!r} is not a torch.optim.Optimizer subclass")
        self._contracts[kind] = contract

    def resolve(self, optimizer: torch.optim.Optimizer) -> OptimizerContract:
        """The contract of ``optimizer``'s exact type.

        Raises:
            ValueError: no contract is registered for that type.
        """
        kind = type(optimizer)
        contract = self._contracts.get(kind)
        if contract is None:
            raise ValueError(UNKNOWN_OPTIMIZER.format(name=_qualified(kind)))
        return contract

    def __contains__(self, kind: object) -> bool:
        return kind in self._contracts


def _qualified(kind: type) -> str:
    module = kind.__module__
    if module.startswith("torch.optim"):
        module = "torch.optim"
    return f"{module}.{kind.__qualname__}" if module != "__main__" else kind.__qualname__
