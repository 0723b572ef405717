"""The platform's RFC 3161 timestamp authority.

Every certificate's signature is stamped when it is issued, so a bundle carries a signed
time that Sigstore's verifiers accept (``timestampVerificationData.rfc3161Timestamps``),
beside the log's signed entry timestamp.

The authority is generated once, like the embedded signing key, under
``$DVBENCH_DATA_DIR/keys/`` (directory 0700, file 0600, never overwritten):
``tsa.pem`` holds its ECDSA P-256 private key and its certificate chain, the
timestamping certificate (critical extended key usage ``id-kp-timeStamping``, RFC 3161
section 2.3) and the self-signed root that issued it. The root's private key signs that
one certificate and is discarded. The chain is published in the Sigstore trusted root
(``GET /api/v1/trusted-root/``).

Tokens are encoded with asn1crypto's RFC 3161 and CMS types (no hand-written DER): a
``TimeStampResp`` (status granted) whose token is CMS ``SignedData`` over a ``TSTInfo``
with the SHA-256 imprint of the stamped bytes, signed attributes content-type,
message-digest and ESS signing-certificate-v2, signed with ECDSA-SHA256.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from asn1crypto import algos, cms, core, tsp
from asn1crypto import x509 as asn1_x509
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from dvbench.attest import TimestampAuthority

__all__ = ["TSA_FILENAME", "TSA_POLICY", "Authority", "generate_authority", "load_authority"]

TSA_FILENAME: Final = "tsa.pem"
#: The TSA policy under which tokens are issued (an arbitrary OID in the private
#: enterprise arc used for examples, RFC 5612; the policy is informational here).
TSA_POLICY: Final = "1.3.6.1.4.1.32473.1.1"
_ORGANIZATION: Final = "DVBench"
_VALIDITY: Final = timedelta(days=3650)


@dataclass(frozen=True)
class Authority:
    """The timestamp authority's key and chain (leaf first, root last)."""

    key: ec.EllipticCurvePrivateKey
    chain: tuple[x509.Certificate, ...]

    def descriptor(self, uri: str = "") -> TimestampAuthority:
        """The authority as the Sigstore trusted root lists it."""
        leaf = self.chain[0]
        return TimestampAuthority(
            chain=self.chain,
            not_before=leaf.not_valid_before_utc,
            not_after=None,
            uri=uri,
        )

    def stamp(self, data: bytes, at: datetime) -> bytes:
        """An RFC 3161 ``TimeStampResp`` (DER) stamping ``data`` at ``at``.

        Args:
            data: the bytes stamped (a certificate's DSSE signature).
            at: the time stated (``genTime``), the certificate's signed ``issuedOn``.
        """
        leaf_der = self.chain[0].public_bytes(serialization.Encoding.DER)
        info_der = _tst_info(data, at)
        certificate = asn1_x509.Certificate.load(leaf_der)
        signed_data = cms.SignedData(
            {
                "version": "v3",
                "digest_algorithms": [algos.DigestAlgorithm({"algorithm": "sha256"})],
                "encap_content_info": {
                    "content_type": "tst_info",
                    "content": core.ParsableOctetString(info_der),
                },
                "certificates": [certificate],
                "signer_infos": [self._signer_info(info_der, leaf_der, certificate)],
            }
        )
        response = tsp.TimeStampResp(
            {
                "status": {"status": "granted"},
                "time_stamp_token": {"content_type": "signed_data", "content": signed_data},
            }
        )
        return bytes(response.dump())

    def _signer_info(
        self, info_der: bytes, leaf_der: bytes, certificate: asn1_x509.Certificate
    ) -> cms.SignerInfo:
        """The authority's signature over the token's signed attributes."""
        signed_attrs = _signed_attributes(info_der, leaf_der)
        signature = self.key.sign(signed_attrs.dump(), ec.ECDSA(hashes.SHA256()))
        return cms.SignerInfo(
            {
                "version": "v1",
                "sid": cms.SignerIdentifier(
                    {
                        "issuer_and_serial_number": {
                            "issuer": certificate.issuer,
                            "serial_number": certificate.serial_number,
                        }
                    }
                ),
                "digest_algorithm": algos.DigestAlgorithm({"algorithm": "sha256"}),
                "signed_attrs": signed_attrs,
                "signature_algorithm": algos.SignedDigestAlgorithm({"algorithm": "sha256_ecdsa"}),
                "signature": signature,
            }
        )


def _tst_info(data: bytes, at: datetime) -> bytes:
    """The DER ``TSTInfo`` stating that ``data`` (its SHA-256) existed at ``at``."""
    info = tsp.TSTInfo(
        {
            "version": "v1",
            "policy": TSA_POLICY,
            "message_imprint": {
                "hash_algorithm": {"algorithm": "sha256"},
                "hashed_message": hashlib.sha256(data).digest(),
            },
            "serial_number": secrets.randbits(63),
            "gen_time": at.astimezone(UTC),
        }
    )
    return bytes(info.dump())


def _signed_attributes(info_der: bytes, leaf_der: bytes) -> cms.CMSAttributes:
    """The attributes the signature covers: content type, the TSTInfo's digest, the signer."""
    attributes = [
        cms.CMSAttribute({"type": "content_type", "values": ["tst_info"]}),
        cms.CMSAttribute({"type": "message_digest", "values": [hashlib.sha256(info_der).digest()]}),
        cms.CMSAttribute(
            {
                "type": "signing_certificate_v2",
                "values": [
                    {
                        "certs": [
                            {
                                "hash_algorithm": {"algorithm": "sha256"},
                                "cert_hash": hashlib.sha256(leaf_der).digest(),
                            }
                        ]
                    }
                ],
            }
        ),
    ]
    # DER orders a SET OF by encoding; the signature covers these exact bytes.
    attributes.sort(key=lambda attribute: attribute.dump())
    return cms.CMSAttributes(attributes)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORGANIZATION),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def generate_authority(now: datetime) -> Authority:
    """A new authority, its certificates valid from five minutes before ``now``.

    :func:`load_authority` keeps the one it generates; dvbench's attestation tests
    (``tests/agent/dvbench/attest``) stamp with one made at a fixed time.
    """
    start = now - timedelta(minutes=5)
    root_key = ec.generate_private_key(ec.SECP256R1())
    root_name = _name("DVBench timestamp root")
    root = (
        x509.CertificateBuilder()
        .subject_name(root_name)
        .issuer_name(root_name)
        .public_key(root_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(root_key.public_key()), critical=False
        )
        .sign(root_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name("DVBench timestamp authority"))
        .issuer_name(root_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.TIME_STAMPING]), critical=True)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(root_key.public_key()),
            critical=False,
        )
        .sign(root_key, hashes.SHA256())
    )
    return Authority(key=key, chain=(leaf, root))


def _to_pem(authority: Authority) -> bytes:
    text = authority.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    for certificate in authority.chain:
        text += certificate.public_bytes(serialization.Encoding.PEM)
    return text


def _from_pem(data: bytes, path: Path) -> Authority:
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{path} does not hold an ECDSA timestamp authority key")
    chain = tuple(x509.load_pem_x509_certificates(data))
    if len(chain) < 2 or chain[0].public_key() != key.public_key():
        raise ValueError(
            f"{path} must hold the authority's key, then its certificate and its root's"
        )
    return Authority(key=key, chain=chain)


def load_authority(directory: Path) -> Authority:
    """The authority under ``directory`` (``tsa.pem``), generated on first use.

    Raises:
        ValueError: the file exists but does not hold a key and its chain.
    """
    path = directory / TSA_FILENAME
    if not path.exists():
        authority = generate_authority(datetime.now(UTC).replace(microsecond=0))
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Written whole under a private name, then linked into place: another process
        # never reads a half-written file, and the first link wins.
        staging = directory / f".{TSA_FILENAME}.{secrets.token_hex(8)}"
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(_to_pem(authority))
        try:
            os.link(staging, path)
        except FileExistsError:
            pass  # another process won the race: use its authority
        else:
            return authority
        finally:
            staging.unlink()
    return _from_pem(path.read_bytes(), path)
