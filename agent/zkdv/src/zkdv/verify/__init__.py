"""The offline transcript verifier: everything in the protocol that needs no replay.

It checks, in one streaming pass, and names the first problem with its record index and
field: the hash chain; every field of every record, its type and range, with no field
missing and none the protocol does not define; the root's configuration and schema;
every position the protocol fixes (steps in order; a snapshot of the pre-state of step
0 and of every ``snapshot_interval``-th step and none elsewhere; a check for exactly the
sampled steps, after the step, replaying from the snapshot that precedes it; probe
blocks back to back in ``probes.bin``); every sampling decision recomputed from the step
record's hash; snapshot roots continuing the committed state; probe continuity and
linearity within the run's tolerance; and the close record's counts and final roots.
``docs/transcript.md`` tabulates the rules with their reason codes and tests.

``python -m zkdv verify PROOF_DIR [--json]`` wraps :func:`verify_transcript`.

The package's modules:

* :mod:`zkdv.verify._verifier`: :func:`verify_transcript`, and the pass over the records
  that checks the chain and each step, check, snapshot and close record;
* :mod:`zkdv.verify._root`: the root record's rules, and what it fixes for the rest;
* :mod:`zkdv.verify._schema`: the fields of every record, and the typed readers that
  name the field a record gets wrong;
* :mod:`zkdv.verify._frames`: the transcript's bytes, framed into hashed records;
* :mod:`zkdv.verify._report`: :class:`VerificationReport`, what the verifier found.
"""

from __future__ import annotations

from zkdv.verify._report import VerificationReport
from zkdv.verify._verifier import verify_transcript

__all__ = ["VerificationReport", "verify_transcript"]
