"""``dvbench verify-report``: check a report bundle offline.

Usage::

    dvbench verify-report BUNDLE --trust-root FILE [--transcript PATH] [--model PATH] [--json]

BUNDLE is the report bundle (``*.bundle.json``) or the same certificate as a Sigstore
bundle v0.3 (``*.sigstore.json``); the format is read from the file.

Exit status: 0 when every check passes, 1 when the bundle is rejected (the reason is
printed), 2 for a usage error. Nothing here opens a network connection: the trust root
is the auditor's own file, never the bundle's copy.

The SDK's CLI registers :func:`verify_report_main` as its ``verify-report`` command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dvbench.attest._bundle import verify_bundle
from dvbench.attest._errors import AttestationError
from dvbench.attest._keys import TrustRoot

__all__ = ["build_parser", "verify_report_main"]


def build_parser(prog: str = "dvbench verify-report") -> argparse.ArgumentParser:
    """The argument parser, for embedding as a subcommand's help."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Verify a DVBench report bundle or Sigstore bundle offline: the "
        "certificate's signature, its key's validity at signing time, the transparency-log "
        "inclusion against the signed checkpoint, and optionally the transcript's digests "
        "and the final model's files.",
    )
    parser.add_argument("bundle", type=Path, help="the report bundle or the Sigstore bundle (JSON)")
    parser.add_argument(
        "--trust-root",
        type=Path,
        required=True,
        help="your copy of the platform's trust root (JSON); the bundle's own copy is not trusted",
    )
    parser.add_argument(
        "--transcript",
        type=Path,
        help="a proof directory or records.cborl whose digest must equal the certificate's subject",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="the final model: a .safetensors file, or a folder of them with model.sig; "
        "their SHA-256 and the model_signing manifest must be the certificate's subjects",
    )
    parser.add_argument(
        "--require-passed",
        action="store_true",
        help="also exit 1 when the (authentic) certificate records FAILED",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def verify_report_main(argv: Sequence[str] | None = None) -> int:
    """Run ``dvbench verify-report``.

    Args:
        argv: the arguments after the command name (``sys.argv[2:]`` style); None reads
            ``sys.argv[1:]``.

    Returns:
        0 when the bundle verifies, 1 when it does not.

    Raises:
        SystemExit: with status 2 on a usage error (argparse's convention).
    """
    args = build_parser().parse_args(argv)
    try:
        trust_root = TrustRoot.load(args.trust_root)
        bundle = args.bundle.read_bytes()
    except AttestationError as error:
        return _report_failure(
            args.json, error.reason, f"--trust-root {args.trust_root}: {error.message}"
        )
    except OSError as error:
        return _report_failure(args.json, "malformed", f"cannot read bundle {args.bundle}: {error}")
    result = verify_bundle(
        bundle, trust_root, transcript_path=args.transcript, model_path=args.model
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        print(result.summary(), file=sys.stdout if result.ok else sys.stderr)
    if not result.ok:
        return 1
    assert result.certificate is not None
    if args.require_passed and result.certificate.result.value != "PASSED":
        if not args.json:
            print("the certificate is authentic but records FAILED", file=sys.stderr)
        return 1
    return 0


def _report_failure(as_json: bool, reason: str, message: str) -> int:
    if as_json:
        print(
            json.dumps(
                {"ok": False, "reason": reason, "message": message}, indent=2, sort_keys=True
            )
        )
    else:
        print(f"rejected ({reason}): {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(verify_report_main())
