"""The trust root in Sigstore's format: ``trusted_root.json`` (TrustedRoot v0.1).

What Sigstore's verifiers (``@sigstore/verify``, sigstore-python, sigstore-go) take as
their one trust anchor file, from ``sigstore_trustroot.proto`` in sigstore/protobuf-specs,
media type :data:`TRUSTED_ROOT_MEDIA_TYPE`::

    {"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
     "tlogs": [{"baseUrl": "https://<log origin>", "hashAlgorithm": "SHA2_256",
                "publicKey": {"rawBytes": "<base64 DER SubjectPublicKeyInfo>",
                              "keyDetails": "PKIX_ED25519",
                              "validFor": {"start": "<not_before>", "end": "<not_after>"}},
                "logId": {"keyId": "<base64 signed-note key id of that key>"}}, ...],
     "certificateAuthorities": [], "ctlogs": [],
     "timestampAuthorities": [{"subject": {"organization": ..., "commonName": ...},
                               "uri": "...",
                               "certChain": {"certificates": [{"rawBytes": "<DER>"}, ...]},
                               "validFor": {"start": ...}}]}

* One ``tlogs`` entry per platform key, oldest first: the platform's key signs the
  certificates, the checkpoints and the signed entry timestamps, so each key is a log
  key too, valid in its trust-root window (``end`` absent while current; a rotation
  publishes the next version with the window closed). ``logId.keyId`` is the key ID the
  checkpoints' signature lines start with (``dvbench.attest.note_key_id``), and
  ``baseUrl`` contains the log's origin, which is how Sigstore verifiers pick the key for
  a checkpoint signature.
* The same keys verify the certificates' DSSE signatures: a Sigstore verifier given a
  bare public key looks it up by the bundle's ``publicKey.hint``, the key id
  (``dvbench.attest.key_id``, securesystemslib's), from these entries.
* ``timestampAuthorities`` lists the platform's RFC 3161 timestamp authority: its
  certificate chain, leaf first, root last.
* No Fulcio CA and no CT log: there are no signing certificates.

:meth:`TrustRoot.from_sigstore` reads the file back (``dvbench verify-report
--trust-root trusted_root.json``), so an auditor keeps one trust root file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cryptography.hazmat.primitives import serialization

from dvbench.attest._encoding import b64encode, format_time
from dvbench.attest._keys import TRUSTED_ROOT_MEDIA_TYPE, TrustRoot
from dvbench.attest._note import note_key_id
from dvbench.attest._tsa import TimestampAuthority

__all__ = ["TRUSTED_ROOT_MEDIA_TYPE", "sigstore_trusted_root"]


def sigstore_trusted_root(
    trust_root: TrustRoot,
    *,
    log_origin: str,
    timestamp_authorities: Sequence[TimestampAuthority] | None = None,
) -> dict[str, Any]:
    """The trust root as a Sigstore TrustedRoot v0.1 document (see the module docstring).

    Args:
        trust_root: the platform's trust root (its keys and their windows).
        log_origin: the transparency log's name (the first line of its checkpoints).
        timestamp_authorities: the platform's timestamp authorities (default: the
            trust root's own).

    Returns:
        The document, ready for ``json.dumps``.
    """
    tlogs = []
    for key in trust_root.keys:
        window = {"start": format_time(key.not_before)}
        if key.not_after is not None:
            window["end"] = format_time(key.not_after)
        der = key.public_key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        tlogs.append(
            {
                "baseUrl": f"https://{log_origin}",
                "hashAlgorithm": "SHA2_256",
                "publicKey": {
                    "rawBytes": b64encode(der),
                    "keyDetails": "PKIX_ED25519",
                    "validFor": window,
                },
                "logId": {"keyId": b64encode(note_key_id(log_origin, key.public_key))},
            }
        )
    return {
        "mediaType": TRUSTED_ROOT_MEDIA_TYPE,
        "tlogs": tlogs,
        "certificateAuthorities": [],
        "ctlogs": [],
        "timestampAuthorities": [
            tsa.to_dict()
            for tsa in (
                trust_root.timestamp_authorities
                if timestamp_authorities is None
                else timestamp_authorities
            )
        ],
    }
