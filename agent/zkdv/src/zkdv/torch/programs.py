"""The Torch frontend's program serialization, for zkdv's other packages.

Not the user API (``zkdv.torch``): what the sliced prototype (``zkdv.sliced``) needs to
write a block's ``torch.export`` program as the frontend writes a step's, with the same
bytes for the same program. :mod:`zkdv.torch.replay` is the verifiers' counterpart.
"""

from __future__ import annotations

from zkdv.torch._artifact import AOT_INDUCTOR, TORCH_EXPORT, reproducible, strip_provenance

__all__ = ["AOT_INDUCTOR", "TORCH_EXPORT", "reproducible", "strip_provenance"]
