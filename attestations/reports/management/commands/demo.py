"""``manage.py demo``: the whole product on this machine, on its embedded defaults.

The first of the README's two commands (``./scripts/demo``) ends here. It prepares the
platform (migrations, static files), registers the demo organisations and accounts (a
trainer, an auditor, a regulator and an admin, each with an API key; credentials kept,
readable by their owner only, in the data directory), serves it with gunicorn on
localhost, waits until ``/health`` answers, then runs the end-to-end flow of
:mod:`demo.flow` against it as its users would (experiment, training,
challenges, replay, certificate, report, offline verification), and keeps serving so
the person can click through what just happened.

Steps are numbered: 1 is the install (``scripts/demo``), 2-4 are here, 5-12 the flow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import string
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from demo import flow as demo_flow
from demo.flow import Account, Outcome, Steps

ADMIN_USERNAME = "admin"
DEMO_ORGANIZATION = ("demo", "Demo lab")
#: Regulators read claims and certificates of every organisation; the demo's belongs to
#: an agency the operator made (``manage.py agency``), as it would in life.
REGULATOR_ORGANIZATION = ("agency", "Demo regulator")
#: (role, username, organisation slug) of the accounts besides the admin.
DEMO_USERS = (
    ("trainer", "trainer", DEMO_ORGANIZATION[0]),
    ("auditor", "auditor", DEMO_ORGANIZATION[0]),
    ("regulator", "regulator", REGULATOR_ORGANIZATION[0]),
)
PASSWORD_ALPHABET = string.ascii_letters + string.digits
PASSWORD_LENGTH = 24  # about 143 bits
CREDENTIALS_FILE = "demo-admin.json"
ACCOUNTS_FILE = "demo-accounts.json"
PID_FILE = "demo.json"
REPORT_DIR = "demo-report"
SERVER_LOG = "demo-server.log"
API_KEY_NAME = "demo"
GUNICORN_CONFIG = Path(settings.BASE_DIR) / "platform" / "gunicorn.conf.py"
HEALTH_TIMEOUT_SECONDS = 60.0


class StopDemoError(Exception):
    """Ctrl-C or SIGTERM while the flow runs: stop it and the server."""


def free_port(host: str, preferred: int) -> int:
    """Return ``preferred`` if it can be bound on ``host``, else a port the OS picks."""
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return int(probe.getsockname()[1])
    raise CommandError(f"no free TCP port on {host}")


def _new_password() -> str:
    # Letters and digits only: the password is pasted into forms and shells.
    return "".join(secrets.choice(PASSWORD_ALPHABET) for _ in range(PASSWORD_LENGTH))


def _write_private(path: Path, document: Any) -> None:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump(document, handle, indent=1)


def ensure_admin(data_dir: Path) -> tuple[str, str]:
    """Create (or repair) the local superuser and return its username and password.

    The generated password is kept, readable only by its owner, in the data directory,
    so running the demo again prints the same credentials instead of rotating them.
    """
    path = data_dir / CREDENTIALS_FILE
    user_model = get_user_model()
    user = user_model.objects.filter(username=ADMIN_USERNAME).first()
    if path.exists() and user is not None:
        stored = json.loads(path.read_text())
        if user.check_password(stored["password"]):
            return ADMIN_USERNAME, str(stored["password"])
    password = _new_password()
    if user is None:
        user_model.objects.create_superuser(ADMIN_USERNAME, email="", password=password)
    else:
        user.set_password(password)
        user.is_staff = user.is_superuser = user.is_active = True
        user.save()
    _write_private(path, {"username": ADMIN_USERNAME, "password": password})
    return ADMIN_USERNAME, password


def ensure_demo_organization(username: str) -> str:
    """Give the admin an organisation to work in, as its admin; returns the slug.

    Experiments are named ``owner/name`` after an organisation, so without one the web
    UI has nowhere to register an experiment. Idempotent.
    """
    from attestations.accounts.models import Membership, Organization, Role

    slug, name = DEMO_ORGANIZATION
    organization, _ = Organization.objects.get_or_create(slug=slug, defaults={"name": name})
    user = get_user_model().objects.get(username=username)
    Membership.objects.get_or_create(
        user=user, organization=organization, defaults={"role": Role.ADMIN}
    )
    return organization.slug


def _usable_key(raw: object, username: str) -> bool:
    from attestations.accounts.models import ApiKey

    if not isinstance(raw, str):
        return False
    key = ApiKey.authenticate(raw)
    return key is not None and key.user.get_username() == username


def ensure_demo_accounts(data_dir: Path, admin: tuple[str, str]) -> dict[str, Account]:
    """The trainer, auditor, regulator and admin accounts, each with a working API key.

    Idempotent: passwords and keys stored in ``demo-accounts.json`` (mode 0600) are
    kept while they still work, so a second run prints the same credentials. A key
    that expired or was revoked, or a changed password, is replaced.
    """
    from attestations.accounts.management.commands.agency import create_agency, grant_regulator
    from attestations.accounts.models import ApiKey, Membership, Organization

    path = data_dir / ACCOUNTS_FILE
    try:
        stored: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = {}
    user_model = get_user_model()
    agency_slug, agency_name = REGULATOR_ORGANIZATION
    # The operator's path (manage.py agency): only an agency holds regulators.
    create_agency(agency_slug, agency_name)
    wanted = [*DEMO_USERS, ("admin", admin[0], DEMO_ORGANIZATION[0])]
    accounts: dict[str, Account] = {}
    for role, username, slug in wanted:
        entry = stored.get(role)
        previous: dict[str, Any] = entry if isinstance(entry, dict) else {}
        user = user_model.objects.filter(username=username).first()
        if role == "admin":
            password = admin[1]
        else:
            password = str(previous.get("password") or "")
            if user is None:
                password = password or _new_password()
                user = user_model.objects.create_user(username, email="", password=password)
            elif not password or not user.check_password(password):
                password = _new_password()
                user.set_password(password)
                user.save()
            if role == "regulator":
                grant_regulator(slug, username)
            else:
                # The demo's lab accounts, set up by the operator running the demo.
                organization = Organization.objects.get(slug=slug)
                Membership.objects.update_or_create(
                    user=user, organization=organization, defaults={"role": role}
                )
        assert user is not None
        key = previous.get("api_key")
        if not _usable_key(key, username):
            _, key = ApiKey.issue(user, API_KEY_NAME)
        accounts[role] = Account(username, password, role, slug, str(key))
    _write_private(
        path,
        {
            role: {
                "username": account.username,
                "password": account.password,
                "role": account.role,
                "organization": account.organization,
                "api_key": account.api_key,
            }
            for role, account in accounts.items()
        },
    )
    return accounts


def wait_for_health(url: str, server: subprocess.Popen[bytes], timeout: float) -> dict[str, Any]:
    """Poll ``url`` until it answers 200; fail if the server exits or time runs out."""
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise CommandError(f"the web server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - our own http URL
                body: dict[str, Any] = json.loads(response.read())
                return body
        except urllib.error.HTTPError as error:
            last_error = f"HTTP {error.code}: {error.read().decode(errors='replace')}"
        except OSError as error:
            last_error = str(error)
        time.sleep(0.25)
    raise CommandError(f"{url} did not answer 200 within {timeout:.0f} s ({last_error})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: it exists
    return True


def refuse_second_demo(data_dir: Path) -> None:
    """Fail, saying what to do, when a demo is already running on ``data_dir``.

    Two servers on one SQLite file and one report folder would trip over each other,
    and the second would print credentials for a platform the person is not looking at.
    """
    path = data_dir / PID_FILE
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        earlier = None
    pid = earlier.get("pid") if isinstance(earlier, dict) else None
    if isinstance(pid, int) and pid != os.getpid() and _alive(pid):
        raise CommandError(
            f"an earlier demo is still running (pid {pid}, serving {earlier.get('url')}) on "
            f"the data directory {data_dir}. Open that URL, or stop it (Ctrl-C in its "
            f"terminal, or `kill {pid}`) and run the demo again; or give this one its own "
            "DVBENCH_DATA_DIR."
        )


@contextlib.contextmanager
def single_demo(data_dir: Path, url: str) -> Iterator[None]:
    """Record this demo (pid and URL) for :func:`refuse_second_demo`, while it runs."""
    refuse_second_demo(data_dir)
    path = data_dir / PID_FILE
    path.write_text(json.dumps({"pid": os.getpid(), "url": url}))
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()


class Command(BaseCommand):
    help = (
        "Run DVBench locally, end to end: migrate, register demo accounts, serve the "
        "platform with gunicorn, train a proved model, get it challenged, replayed and "
        "certified, write and verify its report, then keep serving."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
        parser.add_argument(
            "--port",
            type=int,
            default=8000,
            help="port to serve on; if it is taken, a free one is used (0: any free port)",
        )
        parser.add_argument(
            "--torch", action="store_true", help="train the PyTorch example instead of JAX's"
        )
        parser.add_argument(
            "--no-flow",
            action="store_true",
            help="only prepare and serve: skip the training, certificate and report",
        )
        parser.add_argument(
            "--exit",
            action="store_true",
            help="stop the server once the flow is done; exit status 1 if a step failed",
        )
        parser.add_argument(
            "--report-dir",
            type=Path,
            help="where the report goes (default: demo-report/ in the data directory)",
        )
        parser.add_argument(
            "--no-serve",
            action="store_true",
            help="prepare (migrate, static files, accounts) and exit without serving",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        self.steps = Steps(self.stdout.write, first=2)
        data_dir = Path(settings.DVBENCH["DATA_DIR"])
        if options["no_serve"]:
            self.prepare(data_dir)
            return
        host, preferred = options["host"], options["port"]
        # Before the port: a taken port is most often the earlier demo itself.
        refuse_second_demo(data_dir)
        port = free_port(host, preferred)
        if preferred and port != preferred:
            self.stdout.write(
                self.style.WARNING(
                    f"Port {preferred} on {host} is taken by another program; "
                    f"serving on {port} instead (--port N picks another)."
                )
            )
        url = f"http://{host}:{port}"
        with single_demo(data_dir, url):
            accounts = self.prepare(data_dir)
            report_dir = options["report_dir"] or data_dir / REPORT_DIR
            framework = "torch" if options["torch"] else "jax"
            self.serve(
                host,
                port,
                accounts,
                None if options["no_flow"] else (framework, report_dir),
                exit_after=options["exit"],
            )

    def prepare(self, data_dir: Path) -> dict[str, Account]:
        """Migrations, static files and the demo accounts; returns the accounts."""
        with self.steps.step(f"Prepare the platform: migrations, static files ({data_dir})"):
            call_command("migrate", interactive=False, verbosity=0)
            call_command("collectstatic", interactive=False, verbosity=0)
        with self.steps.step("Register organisations, users and API keys"):
            username, password = ensure_admin(data_dir)
            slug = ensure_demo_organization(username)
            accounts = ensure_demo_accounts(data_dir, (username, password))
            self.steps.note(f"organisations: {slug!r} (a lab), {REGULATOR_ORGANIZATION[0]!r}")
            self.steps.note(f"admin account: user {username!r}, password {password!r}")
            self.steps.note(f"credentials and API keys: {data_dir / ACCOUNTS_FILE} (mode 0600)")
        return accounts

    def serve(
        self,
        host: str,
        port: int,
        accounts: dict[str, Account],
        flow: tuple[str, Path] | None,
        *,
        exit_after: bool = False,
    ) -> None:
        """Serve the platform, run the flow against it (unless ``flow`` is None), then
        keep serving until a signal (or stop at once with ``exit_after``)."""
        base = f"http://{host}:{port}"
        server = self.start_server(host, port)
        outcome: Outcome | None = None
        try:
            if flow is not None:
                outcome = self.run_flow(base, accounts, flow)
                if outcome is None:
                    return
            self.summary(base, accounts, outcome)
            if exit_after:
                server.send_signal(signal.SIGTERM)
            else:
                self.stdout.write("Press Ctrl-C to stop.")
            returncode = server.wait()
        finally:
            if server.poll() is None:
                server.terminate()
                server.wait(timeout=30)
        if returncode not in (0, -signal.SIGTERM):
            raise CommandError(f"the web server exited with status {returncode}")
        if exit_after and outcome is not None and not outcome.ok:
            raise CommandError("the demo did not complete; see the FAILED step above")

    def start_server(self, host: str, port: int) -> subprocess.Popen[bytes]:
        """Gunicorn on ``host:port``, stopped by SIGINT, SIGTERM or SIGHUP; returns once
        ``/health`` answers."""
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "--config",
            str(GUNICORN_CONFIG),
            "--bind",
            f"{host}:{port}",
            # Request lines would drown the demo's own progress.
            "--access-logfile",
            os.devnull,
            "config.wsgi:application",
        ]
        log_path = Path(settings.DVBENCH["DATA_DIR"]) / SERVER_LOG
        with self.steps.step("Start the web server (gunicorn)"):
            # The server's log (and, with tasks run in-process, the tasks') goes to a
            # file: interleaved, it would drown the demo's numbered steps.
            with log_path.open("ab") as log:
                server = subprocess.Popen(
                    command, cwd=settings.BASE_DIR, stdout=log, stderr=subprocess.STDOUT
                )
            self.steps.note(f"server log: {log_path}")
            self.stop_on_signals(server)
            base = f"http://{host}:{port}"
            try:
                health = wait_for_health(f"{base}/health", server, HEALTH_TIMEOUT_SECONDS)
            except CommandError as error:
                tail = log_path.read_text(errors="replace").splitlines()[-20:]
                raise CommandError(
                    f"{error}; the end of {log_path}:\n" + "\n".join(tail)
                ) from error
            states = ", ".join(
                f"{name} {item['status']}" for name, item in health["components"].items()
            )
            self.stdout.write(self.style.SUCCESS(f"DVBench is serving at {base}/") + f" ({states})")
        return server

    def stop_on_signals(self, server: subprocess.Popen[bytes]) -> None:
        """SIGINT, SIGTERM and SIGHUP stop the server, and the flow if it is running."""
        self.running_flow = False

        def stop(signum: int, frame: FrameType | None) -> None:
            server.send_signal(signal.SIGTERM)
            if self.running_flow:
                raise StopDemoError(signal.Signals(signum).name)

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, stop)

    def run_flow(
        self, base: str, accounts: dict[str, Account], flow: tuple[str, Path]
    ) -> Outcome | None:
        """The demo's flow against the platform at ``base``; None if a signal stopped it."""
        framework, report_dir = flow
        self.running_flow = True
        # One line per HTTP request would drown the numbered steps.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        try:
            return demo_flow.run(
                base, accounts, report_dir, framework=framework, write=self.stdout.write
            )
        except StopDemoError:
            self.stdout.write("Stopped.")
            return None
        finally:
            self.running_flow = False

    def summary(self, base: str, accounts: dict[str, Account], outcome: Outcome | None) -> None:
        """What happened, where to look, and who to sign in as."""
        write = self.stdout.write
        write("")
        if outcome is not None:
            verdict = f"proof {outcome.proof_id} of {outcome.experiment}: {outcome.status}"
            if outcome.certificate:
                verdict += f", certificate {outcome.certificate}"
            if outcome.verified:
                verdict += ", report verified offline"
            style = self.style.SUCCESS if outcome.ok else self.style.ERROR
            write(style(("Demo complete: " if outcome.ok else "Demo incomplete: ") + verdict))
            if outcome.accuracy is not None:
                write(f"  model:      held-out accuracy {outcome.accuracy:.1%}")
            if outcome.proof_id is not None:
                write(f"  this proof: {base}/proofs/{outcome.proof_id}/")
                write(f"  its report: {base}/proofs/{outcome.proof_id}/report/")
            write(f"  report:     {outcome.report_dir}/")
            for what, path in outcome.files.items():
                write(f"    {what:10s} {path.name}")
            for failure in outcome.failures:
                write(self.style.ERROR(f"  failed:     {failure}"))
            for missing in outcome.unavailable:
                write(self.style.WARNING(f"  not available on this platform yet: {missing}"))
        write(self.style.SUCCESS(f"DVBench is serving at {base}/"))
        write(f"  API:        {base}/api/v1/ (OpenAPI: {base}/api/v1/docs/)")
        write(f"  admin:      {base}/admin/")
        write("Sign in as (API keys are in the credentials file above):")
        for role, account in accounts.items():
            write(
                f"  {role:10s} user {account.username!r}, password {account.password!r} "
                f"({account.role} in {account.organization!r})"
            )
