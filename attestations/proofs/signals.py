"""Signals of the proofs app.

:data:`verdict_recorded` is sent by :meth:`Proof.record_verdict
<attestations.proofs.models.Proof.record_verdict>` inside the transaction that records a
verdict the platform certifies (valid or rejected, not a duplicate), with ``proof``.
The certificates app connects to it in ``ready()`` and queues the certificate once that
transaction commits, so proofs never import what sits above them.
"""

from __future__ import annotations

from django.dispatch import Signal

verdict_recorded = Signal()

__all__ = ["verdict_recorded"]
