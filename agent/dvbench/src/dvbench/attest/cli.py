"""``dvbench verify-report``: check a report bundle offline.

Usage::

    dvbench verify-report BUNDLE --trust-root FILE [--transcript PATH] [--model PATH]
                          [--allow-failed] [--json]

BUNDLE is the report bundle (``*.bundle.json``) or the same certificate as a Sigstore
bundle v0.3 (``*.sigstore.json``); the format is read from the file.

Exit status: 0 when every check passes and the certificate records PASSED; 1 when the
bundle is rejected (the reason is printed) or the authentic certificate records FAILED
(the failed claims are printed), unless ``--allow-failed``, with which an authentic
FAILED certificate exits 0 (for inspecting failures); 2 for a usage error.
``--require-passed`` is accepted and changes nothing: requiring PASSED is the default.
Nothing here opens a network connection: the trust root is the auditor's own file,
never the bundle's copy.

The SDK's CLI registers :func:`verify_report_main` as its ``verify-report`` command.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from dvbench._verdict import failed_claims
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
        "--allow-failed",
        action="store_true",
        help="exit 0 for an authentic certificate that records FAILED (default: exit 1 "
        "unless it records PASSED); for inspecting failures",
    )
    parser.add_argument(
        "--require-passed",
        action="store_true",
        help="the default (exit 1 unless the certificate records PASSED); kept for scripts "
        "that name it",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    return parser


def verify_report_main(argv: Sequence[str] | None = None) -> int:
    """Run ``dvbench verify-report``.

    Args:
        argv: the arguments after the command name (``sys.argv[2:]`` style); None reads
            ``sys.argv[1:]``.

    Returns:
        0 when the bundle verifies and its certificate records PASSED (or FAILED, with
        ``--allow-failed``); 1 when it does not verify, or records FAILED.

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
    failed: list[str] = []
    passed = False
    if result.ok:
        assert result.certificate is not None
        passed = result.certificate.result.value == "PASSED"
        if not passed:
            predicate = result.certificate.to_statement().to_dict()["predicate"]
            failed = failed_claims(
                predicate.get("claims") or [],
                predicate.get("filings"),
                transcript_digest=result.certificate.transcript_digest,
            )
    accepted = result.ok and (passed or args.allow_failed)
    if args.json:
        document = result.to_dict()
        if result.ok:
            document["result"] = "PASSED" if passed else "FAILED"
            document["failed_claims"] = failed
        document["accepted"] = accepted
        print(json.dumps(document, indent=2, sort_keys=True))
        return 0 if accepted else 1
    if not result.ok:
        print(result.summary(), file=sys.stderr)
        return 1
    if passed:
        print(result.summary())
        return 0
    # Authentic, and FAILED: what failed goes with it, on the stream the status implies.
    stream = sys.stdout if args.allow_failed else sys.stderr
    print(result.summary(), file=stream)
    print("failed claims:", file=stream)
    for reason in failed or ["(none listed in the certificate)"]:
        print(f"  {reason}", file=stream)
    if not args.allow_failed:
        print(
            "the certificate is authentic and records FAILED: exit status 1 "
            "(--allow-failed exits 0 for an authentic FAILED certificate)",
            file=sys.stderr,
        )
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
