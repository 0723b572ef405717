"""A private platform for fault tests: PostgreSQL, Redis and Celery workers this test owns.

Fault tests stop, kill and restart servers, so they never touch the shared ones: each
starts a throwaway PostgreSQL cluster (``initdb``, as ``.ci/run`` does, as the
``postgres`` user when running as root) and a Redis server on free ports, with Redis
persisting its queue (append-only file, fsync on every write: what a deployment that
must not lose jobs runs). Platform code runs in subprocesses with ``DATABASE_URL`` and
``REDIS_URL`` pointing at them; the test reads results back the same way.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.sources import AGENT_PYTHONPATH

REPO = Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def gunicorn(environment: dict[str, str], log: Path, workers: int = 1) -> Iterator[int]:
    """The real gunicorn with the platform's configuration, in a subprocess on a free
    port (yielded) until the block ends; its output goes to ``log``."""
    port = free_port()
    with log.open("wb") as output:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gunicorn",
                "--config",
                str(REPO / "platform" / "gunicorn.conf.py"),
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "--access-logfile",
                os.devnull,
            ],
            cwd=REPO,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"gunicorn did not start:\n{log.read_text()}") from None
                time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]) if found else None


def available() -> str | None:
    """Why a private stack cannot start here, or None if it can."""
    if _pg_bin() is None:
        return "PostgreSQL server binaries (/usr/lib/postgresql/*/bin) are not installed"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser"
    return None


class PrivatePostgres:
    """A throwaway cluster: ``start``, ``stop`` (immediate, as a crash), ``restart``."""

    def __init__(self, work: Path) -> None:
        self.bin = _pg_bin()
        assert self.bin is not None
        self.work = work / "pg"
        self.data = self.work / "data"
        self.port = free_port()
        self.as_postgres = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.work.mkdir(parents=True)
        if self.as_postgres:
            shutil.chown(self.work, "postgres", "postgres")
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.as_postgres, str(self.bin / tool), *args],
            check=True,
            capture_output=True,
        )

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/dvbench"

    def start(self) -> None:
        options = f"-p {self.port} -k {self.work} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.work / "server.log"),
            "-w",
            "-t",
            "60",
            "start",
            "-o",
            options,
        )

    def create_database(self) -> None:
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "dvbench")

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()


class PrivateRedis:
    """A Redis server persisting every write (AOF, fsync always); ``kill`` is a crash."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "redis"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
                "--logfile",
                str(self.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"redis did not start: {(self.dir / 'redis.log').read_text()}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def restart(self) -> None:
        self.kill()
        self.start()


class Stack:
    """A private PostgreSQL + Redis + data directory, and the platform run against them."""

    def __init__(self, work: Path) -> None:
        self.work = work
        work.chmod(0o755)
        self.pg = PrivatePostgres(work)
        self.redis = PrivateRedis(work)
        self.data = work / "data"
        self.data.mkdir()
        self.workers: list[subprocess.Popen[bytes]] = []

    def env(self) -> dict[str, str]:
        environment = {
            k: v for k, v in os.environ.items() if not k.startswith(("DVBENCH_", "DJANGO_"))
        }
        environment.update(
            DATABASE_URL=self.pg.url,
            REDIS_URL=self.redis.url,
            DVBENCH_DATA_DIR=str(self.data),
            # A claim is stale (its worker died) after this, and the broker redelivers an
            # unacknowledged message after twice this: short, so faults heal within a test.
            DVBENCH_TASK_TIME_LIMIT="10",
            # The synthetic transcripts attest no program (nothing to replay).
            DVBENCH_REQUIRE_PROGRAM="0",
            # Each test files its dozen transcripts into one experiment.
            DVBENCH_MAX_PROOFS_PER_EXPERIMENT="100",
            DVBENCH_LOG_LEVEL="INFO",
            DJANGO_SETTINGS_MODULE="config.settings",
            PYTHONPATH=os.pathsep.join(
                [
                    str(REPO),
                    AGENT_PYTHONPATH,
                ]
            ),
            PYTHONUNBUFFERED="1",
        )
        return environment

    def start(self) -> None:
        self.pg.start()
        self.pg.create_database()
        self.redis.start()
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "-v", "0"],
            cwd=REPO,
            env=self.env(),
            check=True,
        )

    def python(self, code: str, *args: str, timeout: float = 120) -> Any:
        """Run ``code`` with Django set up against the stack; returns its JSON stdout."""
        prelude = "import django, json, sys\ndjango.setup()\n"
        result = subprocess.run(
            [sys.executable, "-c", prelude + code, *args],
            cwd=REPO,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if result.returncode != 0:
            raise AssertionError(f"stack script failed:\n{result.stderr[-4000:]}")
        return json.loads(result.stdout.strip().splitlines()[-1])

    def start_worker(
        self, *, pool: str = "prefork", concurrency: int = 2
    ) -> subprocess.Popen[bytes]:
        log = (self.work / f"worker-{len(self.workers)}.log").open("wb")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "--app=config",
                "worker",
                "--queues=ingest,replay",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                f"--hostname=fault{len(self.workers)}@%h",
                "--loglevel=INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=REPO,
            env=self.env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.workers.append(process)
        return process

    def worker_log(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-3000:] for p in sorted(self.work.glob("worker-*.log"))
        )

    def stop(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGKILL)
                worker.wait()
        self.redis.kill()
        with contextlib.suppress(subprocess.CalledProcessError):
            self.pg.stop()


#: Files a number of transcripts as proofs through the upload service (the web's code
#: path, minus HTTP); each completion queues one ingest on the stack's broker.
FILE_PROOFS = r"""
import hashlib, io, tempfile
from pathlib import Path
from django.contrib.auth.models import User
from attestations.uploads import services as uploads
from attestations.uploads.parts import put_part
from attestations.accounts.models import ApiKey, Membership, Organization
from attestations.experiments.models import Experiment
from zkdv.records import RECORDS_FILE
from tests.synthetic import write_synthetic_transcript
count = int(sys.argv[1])
org, _ = Organization.objects.get_or_create(slug="acme", defaults={"name": "Acme"})
user, _ = User.objects.get_or_create(username="alice")
Membership.objects.get_or_create(user=user, organization=org, defaults={"role": "trainer"})
spec = {"framework": "jax", "model_description": "m", "optimizer": "sgd", "dataset_commitment": "ab" * 32,
        "max_flops": 10**20, "max_tokens": 10**9, "max_gpu_hours": "1", "allowed_regimes": ["pretraining"]}
experiment = Experiment.objects.filter(owner=org, name="faults").first() or Experiment.register(org, "faults", spec, user=user)
ids = []
for i in range(count):
    with tempfile.TemporaryDirectory() as tmp:
        write_synthetic_transcript(tmp, steps=3, seed=i + int(sys.argv[2]), experiment=experiment.full_name,
                                   spec_digest=experiment.current_spec.digest)
        data = (Path(tmp) / RECORDS_FILE).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    upload = uploads.create(experiment=experiment, kind="transcript", size=len(data), sha256=digest, user=user)
    put_part(upload, 1, stream=io.BytesIO(data), declared_sha256=digest, content_length=len(data))
    upload = uploads.complete(upload, user=user)
    ids.append(upload.proof.pk)
print(json.dumps(ids))
"""

#: Per proof: status, jobs, and how many verdict audit events it has.
OUTCOME = r"""
from attestations.audit.models import AuditEvent
from attestations.proofs.models import Proof
out = {}
for proof in Proof.objects.all():
    verdicts = AuditEvent.objects.filter(target_type="proof", target_id=str(proof.pk), action__in=["proof.valid", "proof.rejected", "proof.error"]).count()
    out[proof.pk] = {"status": proof.status, "reason": proof.reason, "verdicts": verdicts,
                     "jobs": sorted(proof.jobs.values_list("status", flat=True))}
print(json.dumps(out))
"""
