"""``manage.py rotate_signing_key``: start a new signing key now, end the current one.

* Embedded default (no key configured): generates a new key into
  ``$DVBENCH_DATA_DIR/keys/signing-key.pem`` (mode 0600), or imports ``--key-file``,
  and deletes the retired private key.
* With ``DVBENCH_SIGNING_KEY_FILE`` / ``DVBENCH_SIGNING_KEY``: first put the new key
  there (and restart the workers), then run this to adopt it. Until then, issuance
  refuses to sign with a key the trust root does not list as current.

Either way the trust root gains a version: the old key's window ends at the rotation
second and the new key's starts there, so certificates signed before stay valid.
Publish the new trust root (``GET /api/v1/trust-root/``) to auditors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from attestations.certificates.keys import rotate_key
from dvbench.attest import AttestationError, SigningKey


class Command(BaseCommand):
    help = "Rotate the certificate signing key (new key valid from now; the old key's window ends)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--key-file",
            type=Path,
            help="import this Ed25519 PEM private key instead of generating one "
            "(only when no key is configured in the environment)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        try:
            incoming = SigningKey.from_file(options["key_file"]) if options["key_file"] else None
            rotation = rotate_key(incoming)
        except AttestationError as error:
            raise CommandError(error.message) from None
        self.stdout.write(
            f"rotated at {rotation.at.isoformat()}: key {rotation.old_keyid or '(none)'} retired, "
            f"key {rotation.new_keyid} current; trust root version {rotation.trust_root.version} "
            f"(sha256 {rotation.trust_root.digest})"
        )
