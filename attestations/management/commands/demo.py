"""``manage.py demo``: run the platform on this machine, on its embedded defaults.

The first of the README's two commands (``./scripts/demo``) ends here. It prepares the
platform (migrations, static files, a local admin account whose generated credentials
it prints), then serves it with gunicorn on localhost, waits until ``/health`` answers,
and prints the URL. Later steps of the end-to-end demo (an experiment, a training run,
verification, a certificate) slot in between :meth:`Command.prepare` and
:meth:`Command.serve`.
"""

from __future__ import annotations

import json
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
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

ADMIN_USERNAME = "admin"
DEMO_ORGANIZATION = ("demo", "Demo lab")
PASSWORD_ALPHABET = string.ascii_letters + string.digits
PASSWORD_LENGTH = 24  # about 143 bits
CREDENTIALS_FILE = "demo-admin.json"
GUNICORN_CONFIG = Path(settings.BASE_DIR) / "platform" / "gunicorn.conf.py"
HEALTH_TIMEOUT_SECONDS = 60.0


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
    # Letters and digits only: the password is pasted into forms and shells.
    password = "".join(secrets.choice(PASSWORD_ALPHABET) for _ in range(PASSWORD_LENGTH))
    if user is None:
        user_model.objects.create_superuser(ADMIN_USERNAME, email="", password=password)
    else:
        user.set_password(password)
        user.is_staff = user.is_superuser = user.is_active = True
        user.save()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        json.dump({"username": ADMIN_USERNAME, "password": password}, handle)
    return ADMIN_USERNAME, password


def ensure_demo_organization(username: str) -> str:
    """Give the admin an organisation to work in, as its admin; returns the slug.

    Experiments are named ``owner/name`` after an organisation, so without one the web
    UI has nowhere to register an experiment. Idempotent.
    """
    from attestations.models import Membership, Organization, Role

    slug, name = DEMO_ORGANIZATION
    organization, _ = Organization.objects.get_or_create(slug=slug, defaults={"name": name})
    user = get_user_model().objects.get(username=username)
    Membership.objects.get_or_create(
        user=user, organization=organization, defaults={"role": Role.ADMIN}
    )
    return organization.slug


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


class Command(BaseCommand):
    help = (
        "Run DVBench locally: migrate, create a local admin account and print its "
        "credentials, serve the platform with gunicorn and print its URL."
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
            "--no-serve",
            action="store_true",
            help="prepare (migrate, static files, admin account) and exit without serving",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        username, password = self.prepare()
        self.stdout.write(f"Admin account: user {username!r}, password {password!r}")
        if options["no_serve"]:
            return
        self.serve(options["host"], options["port"], username, password)

    def prepare(self) -> tuple[str, str]:
        """Bring the database and static files up to date; return the admin credentials."""
        data_dir = Path(settings.DVBENCH["DATA_DIR"])
        self.stdout.write(f"Data directory: {data_dir}")
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        username, password = ensure_admin(data_dir)
        slug = ensure_demo_organization(username)
        self.stdout.write(f"Organisation: {slug!r} (the admin is its admin)")
        return username, password

    def serve(self, host: str, port: int, username: str, password: str) -> None:
        port = free_port(host, port)
        base = f"http://{host}:{port}"
        command = [
            sys.executable,
            "-m",
            "gunicorn",
            "--config",
            str(GUNICORN_CONFIG),
            "--bind",
            f"{host}:{port}",
            "config.wsgi:application",
        ]
        server = subprocess.Popen(command, cwd=settings.BASE_DIR)

        def stop(signum: int, frame: FrameType | None) -> None:
            server.send_signal(signal.SIGTERM)

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, stop)
        try:
            health = wait_for_health(f"{base}/health", server, HEALTH_TIMEOUT_SECONDS)
            states = ", ".join(
                f"{name} {item['status']}" for name, item in health["components"].items()
            )
            self.stdout.write(
                self.style.SUCCESS(f"DVBench is serving at {base}/")
                + f"\n  health: {base}/health ({states})"
                + f"\n  admin:  {base}/admin/ (user {username!r}, password {password!r})"
                + "\nPress Ctrl-C to stop."
            )
            returncode = server.wait()
        finally:
            if server.poll() is None:
                server.terminate()
                server.wait(timeout=30)
        if returncode not in (0, -signal.SIGTERM):
            raise CommandError(f"the web server exited with status {returncode}")
