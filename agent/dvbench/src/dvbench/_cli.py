"""The ``dvbench`` command: login, status, experiments, sync, proofs, and the report commands.

Exit status: 0 success, 1 an error the message explains, 2 a usage error. A FAILED
certificate is never a success: ``verify-report``, ``download-report``, ``proofs show``
and ``sync --wait`` exit 1 unless the certificate records PASSED (``--allow-failed``
accepts an authentic FAILED one, for inspecting failures); ``proofs show --wait`` and
``sync --wait`` also exit 1 on a verifier error or when no certificate came in time.
``sync`` without ``--wait`` exits 0 once the upload is done, and prints the verdict as
far as it is known (usually pending).
"""

from __future__ import annotations

import argparse
import getpass
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dvbench._client import Client
from dvbench._config import credentials_path, read_credentials, write_credentials
from dvbench._exceptions import APIError, DVBenchError
from dvbench._verdict import FAILED, PENDING, Verdict

__all__ = ["main"]


def _out(text: str = "") -> None:
    print(text)


def _err(text: str) -> None:
    print(text, file=sys.stderr)


def _key_prefix(key: str | None) -> str:
    """The public part of a key (``dvb_<lookup>``): it identifies, never authenticates."""
    if not key:
        return "none"
    parts = key.split("_")
    return f"{parts[0]}_{parts[1]}…" if len(parts) >= 3 else f"{key[:4]}…"


def _key_source() -> tuple[str | None, str]:
    if os.environ.get("DVBENCH_API_KEY"):
        return os.environ["DVBENCH_API_KEY"], "DVBENCH_API_KEY"
    stored = read_credentials().get("api_key")
    if stored:
        return stored, str(credentials_path())
    return None, "none"


# --- commands ---------------------------------------------------------------------------


def cmd_login(args: argparse.Namespace) -> int:
    key = args.key
    if key is None:
        if sys.stdin.isatty():
            key = getpass.getpass("DVBench API key (dvb_…, from the web UI's API keys page): ")
        else:
            key = sys.stdin.readline()
    key = (key or "").strip()
    if not key:
        _err("dvbench login: no key given")
        return 2
    base_url = args.base_url
    if not args.no_verify:
        with Client(base_url, api_key=key) as client:
            me = client.me()
            base_url = client.base_url
        roles = ", ".join(f"{o['slug']}: {o.get('role')}" for o in me.get("organizations", []))
        who = f"{me.get('username')} ({roles or 'no organisation'})"
    else:
        who = "(not verified)"
    path = write_credentials(key, base_url)
    # Never echo the key: only its public prefix.
    _out(f"Logged in as {who} with key {_key_prefix(key)}; stored in {path} (mode 0600)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    key, source = _key_source()
    with Client() as client:
        _out(f"platform:  {client.base_url}")
        _out(f"mode:      {client.settings.mode}")
        _out(f"api key:   {_key_prefix(key)} (from {source})")
        if client.offline:
            _out("offline:   nothing is sent; `dvbench sync` uploads once online")
            return 0
        try:
            health = client.health()
        except Exception as error:  # noqa: BLE001 - reported, not raised: this is a diagnosis
            _out(f"reachable: no ({type(error).__name__}: {error})")
            return 1
        _out(f"reachable: yes (/health: {health.get('status', health.get('status_code'))})")
        if not key:
            _out("identity:  no API key; run `dvbench login` or set DVBENCH_API_KEY")
            return 1
        me = client.me()
        _out(
            f"identity:  {me.get('username')}" + (" (regulator)" if me.get("is_regulator") else "")
        )
        for org in me.get("organizations", []):
            _out(f"           {org['slug']}: {org.get('role')}")
    return 0


def cmd_experiments_list(args: argparse.Namespace) -> int:
    with Client() as client:
        experiments = client.experiments(owner=args.owner)
    if args.json:
        _out(json.dumps([e.data for e in experiments], indent=1, default=str))
        return 0
    for experiment in experiments:
        proofs = experiment.data.get("proofs") or {}
        counts = ", ".join(f"{n} {s}" for s, n in sorted(proofs.items())) or "no proofs"
        _out(
            f"{experiment.name:40s} {experiment.framework or '-':6s} "
            f"spec {str(experiment.spec_digest)[:12]}  proofs: {counts}; "
            f"certificates: {_certificate_counts(experiment.data)}"
        )
    if not experiments:
        _err("no experiments visible to this key")
    return 0


def _certificate_counts(data: dict[str, Any]) -> str:
    """``1 PASSED, 1 FAILED``: the verdicts, FAILED first; ``none`` before any is signed."""
    certificates = data.get("certificates")
    if certificates is None:
        return "unknown (the platform does not report them)"
    counts = [f"{certificates[r]} {r}" for r in ("FAILED", "PASSED") if certificates.get(r)]
    return ", ".join(counts) or "none"


def cmd_experiments_create(args: argparse.Namespace) -> int:
    spec = None
    if args.spec:
        spec = json.loads(Path(args.spec).read_text())
        if not isinstance(spec, dict):
            _err(f"{args.spec}: the spec must be a JSON object")
            return 2
    with Client() as client:
        experiment = client.create_experiment(args.name, spec, framework=args.framework)
    _out(f"registered {experiment.name} (spec digest {experiment.spec_digest})")
    return 0


def cmd_experiments_spec_version(args: argparse.Namespace) -> int:
    spec = json.loads(Path(args.spec).read_text())
    if not isinstance(spec, dict):
        _err(f"{args.spec}: the spec must be a JSON object")
        return 2
    with Client() as client:
        version = client.revise_spec(args.name, spec)
    _out(f"{args.name}: spec version {version['version']}, digest {version['digest']}")
    return 0


def cmd_sync(args: argparse.Namespace) -> int:
    from dvbench._manifest import pending_directories
    from dvbench._proof import runs_dir
    from dvbench._sync import sync_directory

    directories = [Path(d) for d in args.directories]
    if not directories:
        directories = pending_directories(runs_dir(), finished=None if args.partial else True)
        unfinished = [] if args.partial else pending_directories(runs_dir(), finished=False)
        if unfinished:
            # A process that died while training left a transcript without its close
            # record: the platform would reject it, so it is only reported.
            _err(
                f"skipping {len(unfinished)} run(s) that never reached finish() (their "
                "training stopped early); `dvbench sync --partial DIR` uploads their files"
            )
        if not directories:
            _out(f"nothing to sync under {runs_dir()}")
            return 0
    if args.experiment and len(directories) != 1:
        _err("--experiment names the experiment of exactly one directory")
        return 2
    status = 0
    with Client() as client:
        if client.offline:
            _err("DVBENCH_MODE=offline: unset it to sync")
            return 1
        progress = False if args.no_progress else None
        if args.parallel is not None and args.parallel < 1:
            _err(f"--parallel must be at least 1, got {args.parallel}")
            return 2
        for directory in directories:
            try:
                result = sync_directory(
                    client,
                    directory,
                    progress=progress,
                    partial=args.partial,
                    experiment=args.experiment,
                    wait=args.wait,
                    timeout=args.timeout,
                    parallel=args.parallel,
                )
            except DVBenchError as error:
                _err(f"dvbench sync {directory}: {_explain(error)}")
                status = 1
                continue
            _out(result.summary())
            if args.wait and result.verdict is not None:
                status = max(status, _verdict_status(result.verdict, args.allow_failed))
            if result.released:
                _out(f"  released {directory}")
            elif result.complete:
                _out(f"  {directory} is synced (marked in its dvbench-sync.json)")
    return status


def _verdict_status(verdict: Verdict, allow_failed: bool) -> int:
    """0 for PASSED (and FAILED with ``--allow-failed``), else 1, saying why on stderr."""
    if verdict.passed:
        return 0
    if verdict.state == FAILED and allow_failed:
        return 0
    if verdict.state == FAILED:
        _err(
            f"proof {verdict.proof_id}: the certificate records FAILED: exit status 1 "
            "(--allow-failed exits 0 for a FAILED certificate)"
        )
    elif verdict.state == PENDING:
        _err(f"proof {verdict.proof_id}: no certificate yet: exit status 1")
    else:
        _err(f"proof {verdict.proof_id}: the verifier failed; no certificate: exit status 1")
    return 1


def cmd_proofs_show(args: argparse.Namespace) -> int:
    with Client() as client:
        if client.offline:
            _err("DVBENCH_MODE=offline: unset it to ask the platform")
            return 1
        if args.wait:
            verdict = client.wait_for_verdict(
                args.proof_id, timeout=args.timeout, interval=args.interval
            )
        else:
            verdict = client.verdict(args.proof_id)
    if args.json:
        _out(json.dumps(verdict.to_dict(), indent=1))
    else:
        _out(verdict.summary())
    if not args.wait and verdict.state == PENDING:
        # Asked once, and not final: say so, and let a script tell it from PASSED.
        _err(f"proof {verdict.proof_id}: no certificate yet: exit status 1 (--wait waits)")
        return 1
    return _verdict_status(verdict, args.allow_failed)


def cmd_download_report(args: argparse.Namespace) -> int:
    output = Path(args.output or f"proof-{args.proof_id}.bundle.json")
    with Client() as client:
        if client.offline:
            _err("DVBENCH_MODE=offline: unset it to download reports")
            return 1
        bundle = client.download_report(args.proof_id)
        # From the certificate alone: regulators read certificates, not proofs.
        verdict = Verdict.from_api(
            {"id": args.proof_id},
            client.certificate(args.proof_id),
            url=f"{client.base_url}/proofs/{args.proof_id}/",
        )
        sigstore = client.download_sigstore_bundle(args.proof_id) if args.sigstore_out else None
        trust_root = client.trust_root() if args.trust_root_out else None
        trusted = client.trusted_root() if args.trusted_root_out else None
    output.write_bytes(bundle)
    _out(f"saved the report bundle of proof {args.proof_id} to {output}")
    if sigstore is not None:
        Path(args.sigstore_out).write_bytes(sigstore)
        _out(f"saved the certificate as a Sigstore bundle v0.3 to {args.sigstore_out}")
    if trust_root is not None:
        Path(args.trust_root_out).write_bytes(trust_root)
        _out(
            f"saved the platform's current trust root to {args.trust_root_out}; compare it with "
            "a copy you obtained another way before relying on it"
        )
    if trusted is not None:
        Path(args.trusted_root_out).write_bytes(trusted)
        _out(
            f"saved the platform's trust root in Sigstore's format to {args.trusted_root_out} "
            "(for @sigstore/verify and verify-report --trust-root)"
        )
    _out(f"verify offline: dvbench verify-report {output} --trust-root TRUST_ROOT.json")
    # What the platform says; verify-report checks the signature of the same verdict.
    _out(verdict.summary())
    return _verdict_status(verdict, args.allow_failed)


def _attest_command(name: str) -> Callable[[list[str]], int] | None:
    """The signing library's ``<name>_main(argv)``, if that library is installed."""
    try:
        module = importlib.import_module("dvbench.attest.cli")
    except ImportError:
        return None
    function = getattr(module, f"{name.replace('-', '_')}_main", None)
    return function if callable(function) else None


def _report_slot(name: str, argv: list[str]) -> int:
    function = _attest_command(name)
    if function is None:
        _err(
            f"dvbench {name}: not available in this installation (it comes with DVBench's "
            "signed reports: dvbench.attest)"
        )
        return 2
    return int(function(argv))


def _explain(error: BaseException) -> str:
    text = str(error)
    notes = getattr(error, "__notes__", None)
    if notes:
        text += "\n" + "\n".join(notes)
    return text


# --- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dvbench",
        description="DVBench client: experiments, proof uploads, signed reports.",
        epilog="Environment: DVBENCH_BASE_URL, DVBENCH_API_KEY, DVBENCH_MODE, "
        "DVBENCH_TIMEOUT, DVBENCH_MAX_RETRIES (see docs/sdk.md).",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in (
        _add_login,
        _add_status,
        _add_experiments,
        _add_sync,
        _add_proofs,
        _add_download_report,
        _add_verify_report,
    ):
        add(commands)
    return parser


def _add_login(commands: Any) -> None:
    """``dvbench login``: store an API key."""
    login = commands.add_parser("login", help="store an API key (mode 0600)")
    login.add_argument("--key", help="the key (default: prompt, or read from stdin)")
    login.add_argument("--base-url", help="the platform's URL (default: DVBENCH_BASE_URL)")
    login.add_argument("--no-verify", action="store_true", help="store without asking /me")
    login.set_defaults(handler=cmd_login)


def _add_status(commands: Any) -> None:
    """``dvbench status``: who am I, and can I reach the platform."""
    status = commands.add_parser("status", help="who am I, and can I reach the platform")
    status.set_defaults(handler=cmd_status)


def _add_experiments(commands: Any) -> None:
    """``dvbench experiments list | create | spec-version``."""
    experiments = commands.add_parser("experiments", help="list or register experiments")
    actions = experiments.add_subparsers(dest="action", metavar="ACTION")
    listing = actions.add_parser("list", help="experiments visible to this key")
    listing.add_argument("--owner", help="only this organisation's")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(handler=cmd_experiments_list)
    create = actions.add_parser("create", help="register owner/name")
    create.add_argument("name", help="owner/name")
    create.add_argument("--spec", help="JSON file with the declared spec")
    create.add_argument(
        "--framework", choices=("jax", "torch"), default="jax", help="for the default spec"
    )
    create.set_defaults(handler=cmd_experiments_create)
    revise = actions.add_parser(
        "spec-version",
        help="declare a changed spec: a new version once a proof names the current one",
    )
    revise.add_argument("name", help="owner/name")
    revise.add_argument("--spec", required=True, help="JSON file with the declared spec")
    revise.set_defaults(handler=cmd_experiments_spec_version)


def _add_sync(commands: Any) -> None:
    """``dvbench sync``: upload proof directories left on disk."""
    sync = commands.add_parser("sync", help="upload proof directories left on disk")
    sync.add_argument(
        "directories", nargs="*", metavar="DIR", help="default: every unsynced run in the cache"
    )
    sync.add_argument("--partial", action="store_true", help="files only, for an unfinished run")
    sync.add_argument("--experiment", help="owner/name, for a proof written by zkdv alone")
    sync.add_argument("--no-progress", action="store_true", help="no progress bar")
    sync.add_argument(
        "--parallel",
        type=int,
        metavar="N",
        help="parts of one file in flight at once (default: DVBENCH_UPLOAD_PARALLEL; unset, 1 "
        "to the platform, 4 straight to object storage)",
    )
    sync.add_argument(
        "--wait",
        action="store_true",
        help="wait for each proof's certificate (answering challenges meanwhile); exit 1 "
        "unless it records PASSED",
    )
    sync.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="with --wait: how long to wait for a certificate (default 1800)",
    )
    sync.add_argument(
        "--allow-failed", action="store_true", help="with --wait: exit 0 for FAILED too"
    )
    sync.set_defaults(handler=cmd_sync)


def _add_proofs(commands: Any) -> None:
    """``dvbench proofs show``: a filed proof's verdict."""
    proofs = commands.add_parser("proofs", help="a filed proof's verdict")
    proof_actions = proofs.add_subparsers(dest="action", metavar="ACTION")
    show = proof_actions.add_parser(
        "show",
        help="the proof's verdict: certificate PASSED, FAILED with the failed claims, "
        "pending or verifier error; exit 0 only for PASSED",
    )
    show.add_argument("proof_id", type=int, metavar="PROOF_ID", help="the proof's id")
    show.add_argument(
        "--wait", action="store_true", help="wait until the certificate is signed (or none will be)"
    )
    show.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        metavar="SECONDS",
        help="with --wait: how long to wait (default 1800); then exit 1, still pending",
    )
    show.add_argument(
        "--interval", type=float, default=5.0, metavar="SECONDS", help="between polls (default 5)"
    )
    show.add_argument(
        "--allow-failed", action="store_true", help="exit 0 for a FAILED certificate too"
    )
    show.add_argument("--json", action="store_true", help="print the verdict as JSON")
    show.set_defaults(handler=cmd_proofs_show)


def _add_download_report(commands: Any) -> None:
    """``dvbench download-report``: a proof's signed report bundle."""
    download = commands.add_parser(
        "download-report", help="download a proof's signed report bundle (JSON)"
    )
    download.add_argument("proof_id", type=int, metavar="PROOF_ID", help="the proof's id")
    download.add_argument(
        "-o", "--output", metavar="FILE", help="where to save it (default: proof-ID.bundle.json)"
    )
    download.add_argument(
        "--trust-root-out",
        metavar="FILE",
        help="also save the platform's current trust root (pin it; verify-report needs one)",
    )
    download.add_argument(
        "--trusted-root-out",
        metavar="FILE",
        help="also save the trust root in Sigstore's TrustedRoot format (trusted_root.json)",
    )
    download.add_argument(
        "--sigstore-out",
        metavar="FILE",
        help="also save the certificate as a Sigstore bundle v0.3 (e.g. proof.sigstore.json)",
    )
    download.add_argument(
        "--allow-failed",
        action="store_true",
        help="exit 0 when the certificate records FAILED (the files are saved either way)",
    )
    download.set_defaults(handler=cmd_download_report)


def _add_verify_report(commands: Any) -> None:
    """``dvbench verify-report``: parsed by ``dvbench.attest``'s own parser."""
    slot = commands.add_parser(
        "verify-report", help="verify a signed report offline", add_help=False
    )
    slot.add_argument("rest", nargs=argparse.REMAINDER)
    slot.set_defaults(handler=None, slot="verify-report")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dvbench`` command line; returns the exit status."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # The report commands own their arguments: hand them over untouched.
    if arguments and arguments[0] == "verify-report":
        return _report_slot(arguments[0], arguments[1:])
    args = parser.parse_args(arguments)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        if args.command in ("experiments", "proofs"):
            parser.parse_args([args.command, "--help"])
        parser.print_help()
        return 2
    try:
        return handler(args)
    except APIError as error:
        _err(f"dvbench {args.command}: {_explain(error)}")
        return 1
    except DVBenchError as error:
        _err(f"dvbench {args.command}: {_explain(error)}")
        return 1
    except KeyboardInterrupt:
        _err("interrupted; `dvbench sync` resumes an interrupted upload")
        return 130
    except BrokenPipeError:
        # `dvbench experiments list | head`: the reader left; say nothing more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _entry() -> Any:  # pragma: no cover - python -m dvbench._cli
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    _entry()
