"""RFC 3161 timestamps: the authorities a trust root names, and verifying their tokens.

A Sigstore bundle may carry RFC 3161 timestamp responses over the envelope's signature
(``verificationMaterial.timestampVerificationData.rfc3161Timestamps``). The platform runs
its own timestamp authority (``attestations/certificates/tsa.py``); its certificate chain
is in the Sigstore trusted root (``dvbench.attest._trusted_root``). Tokens are decoded and
verified with ``rfc3161-client`` (the library sigstore-python uses): status granted, the
CMS signature by the timestamping certificate, that certificate's chain to the root at
the stated time, its critical ``id-kp-timeStamping`` key usage, and the imprint of the
stamped bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from dvbench.attest._encoding import b64encode, format_time, to_seconds
from dvbench.attest._errors import InvalidSignatureError, KeyNotValidError, MalformedInputError

__all__ = ["TimestampAuthority", "verify_timestamp"]


@dataclass(frozen=True)
class TimestampAuthority:
    """An RFC 3161 timestamp authority a trust root names.

    Attributes:
        chain: its certificates, leaf (the timestamping certificate) first, root last.
        not_before: when it started stamping.
        not_after: when it stopped; None while current.
        uri: where it is served (informational).
    """

    chain: tuple[x509.Certificate, ...]
    not_before: datetime
    not_after: datetime | None = None
    uri: str = ""

    def valid_at(self, moment: datetime) -> bool:
        """Whether ``not_before <= moment`` and, if it ended, ``moment <= not_after``."""
        return self.not_before <= moment and (self.not_after is None or moment <= self.not_after)

    def to_dict(self) -> dict[str, Any]:
        """The authority as a Sigstore TrustedRoot's ``timestampAuthorities`` entry."""
        leaf = self.chain[0]
        names = {
            "organization": _name(leaf.subject, x509.NameOID.ORGANIZATION_NAME),
            "commonName": _name(leaf.subject, x509.NameOID.COMMON_NAME),
        }
        window = {"start": format_time(self.not_before)}
        if self.not_after is not None:
            window["end"] = format_time(self.not_after)
        return {
            "subject": names,
            "uri": self.uri,
            "certChain": {
                "certificates": [
                    {"rawBytes": b64encode(cert.public_bytes(serialization.Encoding.DER))}
                    for cert in self.chain
                ]
            },
            "validFor": window,
        }


def _name(name: x509.Name, oid: x509.ObjectIdentifier) -> str:
    values = name.get_attributes_for_oid(oid)
    return str(values[0].value) if values else ""


def verify_timestamp(
    token: bytes,
    data: bytes,
    authorities: Sequence[TimestampAuthority],
    *,
    what: str = "timestamp",
) -> datetime:
    """Verify an RFC 3161 timestamp response over ``data``; return the stamped time.

    Args:
        token: the DER ``TimeStampResp``.
        data: the bytes it must stamp (a DSSE signature).
        authorities: the trusted timestamp authorities.
        what: how to name the token in errors.

    Returns:
        The token's ``genTime``, to the second.

    Raises:
        MalformedInputError: the token does not decode, or no authority is trusted.
        InvalidSignatureError: no trusted authority's verification passes.
        KeyNotValidError: the stamped time is outside the authority's validity period.
    """
    from rfc3161_client import VerificationError, VerifierBuilder, decode_timestamp_response

    if not authorities:
        raise MalformedInputError(f"{what}: the trust root names no timestamp authority")
    try:
        response = decode_timestamp_response(token)
    except ValueError as error:
        raise MalformedInputError(
            f"{what} is not an RFC 3161 timestamp response: {error}"
        ) from None
    failure = ""
    for authority in authorities:
        builder = VerifierBuilder().tsa_certificate(authority.chain[0])
        for certificate in authority.chain[1:-1]:
            builder = builder.add_intermediate_certificate(certificate)
        builder = builder.add_root_certificate(authority.chain[-1])
        try:
            builder.build().verify_message(response, data)
        except VerificationError as error:
            failure = str(error)
            continue
        except Exception as error:  # noqa: BLE001
            # rfc3161-client reports fields it cannot read with whatever its parsers
            # raise (ValueError for a status outside PKIStatus, cryptography's
            # InvalidVersion for a damaged certificate): a token that does not verify.
            failure = f"{type(error).__name__}: {error}"
            continue
        moment = to_seconds(response.tst_info.gen_time.astimezone(UTC))
        if not authority.valid_at(moment):
            raise KeyNotValidError(
                f"{what} states {format_time(moment)}, outside its authority's validity period"
            )
        return moment
    raise InvalidSignatureError(
        f"{what} does not verify with a trusted timestamp authority: {failure}"
    )
