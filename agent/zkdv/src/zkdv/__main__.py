"""``python -m zkdv verify PROOF_DIR [--json]``: the offline transcript verifier.

Exit status: 0 the transcript is valid, 1 it is rejected (the reason and record index
are printed), 2 usage or I/O error.

``python -m zkdv calibrate PROOF_DIR``: the honest divergence of a run's own step under
other kernel environments, and its margin to the run's gradient bounds
(:mod:`zkdv.calibrate`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from zkdv.records import RECORDS_FILE
from zkdv.verify import verify_transcript


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zkdv", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    verify = commands.add_parser("verify", help="verify a transcript offline")
    verify.add_argument("proof", type=Path, help=f"proof directory (or its {RECORDS_FILE})")
    verify.add_argument("--json", action="store_true", help="print the full report as JSON")
    verify.add_argument("--no-probes", action="store_true", help="skip probe continuity checks")
    calibrate = commands.add_parser(
        "calibrate",
        help="measure how far replays under other kernel environments land from a run's "
        "committed gradients, against its bounds",
    )
    calibrate.add_argument("proof", type=Path, help="proof directory of a short run of the step")
    calibrate.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="'NAME=VALUE ... [threads=N]'",
        help="an environment to replay in (repeatable); default: every CPU kernel family "
        "and instruction set this machine offers, and other thread counts",
    )
    calibrate.add_argument(
        "--steps", type=int, default=8, help="recompute the first N committed steps (8)"
    )
    calibrate.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return 0 if exit_.code == 0 else 2
    if args.command == "calibrate":
        from zkdv import calibrate as calibration

        return calibration.main(
            args.proof, worker=args.worker, steps=args.steps, environments=args.env
        )
    target: Path = args.proof
    records = target / RECORDS_FILE if target.is_dir() else target
    if not records.is_file():
        print(f"zkdv verify: no transcript at {records}", file=sys.stderr)
        return 2
    report = verify_transcript(target, probes=not args.no_probes)
    if report.reason == "io_error":
        print(f"zkdv verify: {report.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    else:
        print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
