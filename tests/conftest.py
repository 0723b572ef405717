"""Fixtures shared by the whole suite.

Two modes, chosen by the environment exactly as the platform chooses them:

* Embedded defaults (nothing set): SQLite, tasks run in the calling process.
* Services (``DATABASE_URL`` and ``REDIS_URL`` set, as ``.ci/run`` does): PostgreSQL and
  a Redis broker. Tests marked ``services`` need this mode and skip, saying so, without it.

In both modes an ordinary test runs Celery tasks in-process (``.delay()`` returns once the
task has run), so the same assertions hold on a laptop and in CI. A test that wants a
real worker asks for the ``celery_worker_process`` fixture: the task then travels over
Redis to a separate worker process, which writes to the same PostgreSQL test database.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from django.conf import settings

from tests.attestations.s3 import S3Server, s3_server

__all__ = ["s3_server"]  # a session fixture: one S3 API for every test that asks for one

REPO_ROOT = Path(__file__).resolve().parent.parent

# XLA compiles the same JAX programs again and again across the suite (each test's
# proof.jit, the platform's replay of the exported step, the forgery suite's runs): one
# persistent compilation cache under .cache/ serves them all, as TORCHINDUCTOR_CACHE_DIR
# does for the Torch tests (tests/agent/zkdv/torch/conftest.py). Its key covers the
# program, the compile options and XLA_FLAGS, so a run under another --xla_cpu_max_isa
# never gets this one's machine code. Set here, before any test imports JAX; subprocesses
# inherit it. tests/agent/zkdv/jax took 365 s with it (a cold cache) against 417 s, and
# with the cache warm it and three more files took 223 s. It lives under .cache/, not
# .data/: the platform hides .data/ from its sandboxed replay children (an empty mount,
# attestations.challenges.sandboxed.hidden_paths), and there every child of a JAX proof
# compiled its replay cold, 8 children a proof; out of .data/ (JAX_* passes to them) the
# first child's compile serves the rest. The embedded demo took 105 s of CPU with the cache
# under .data/, 69 s out of it. A child's entry is keyed like any other (program, options,
# XLA_FLAGS), so a child under another instruction set never reads this one's code.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(REPO_ROOT / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))  # bytes, LRU beyond
DEMO_TIMEOUT_SECONDS = 600
#: The queues a test worker consumes: every queue the settings route tasks to.
WORKER_QUEUES = ("ingest", "replay")
WORKER_START_TIMEOUT_SECONDS = 60.0
#: Fixtures that start a service of their own when the environment names none. A test that
#: uses one is marked ``self_started``; .ci/run runs those again with the services'
#: variables unset, the way they run on a newcomer's machine (issue 58).
SELF_STARTING_FIXTURES = ("s3_server",)
#: A session fixture's setup is charged to the first test that asks for it: these add
#: their own limit (seconds) to the per-test timeout of every test that uses them.
SLOW_FIXTURE_SECONDS = {"embedded_demo": DEMO_TIMEOUT_SECONDS}
#: Under pytest-xdist (``-n 2 --dist loadgroup``) the tests that use these fixtures run on one
#: worker, in one group: a session's Celery worker consumes the shared Redis queues and
#: would take the other xdist worker's tasks to its own test database; the demo is started
#: once per xdist worker that asks for it, a minute and a half each.
XDIST_GROUPS = {"celery_worker_process": "services", "embedded_demo": "demo"}
SERVICES_SKIP_REASON = (
    "needs real PostgreSQL and Redis: set DATABASE_URL and REDIS_URL "
    "(.ci/run starts throwaway servers and sets both)"
)


@pytest.fixture(scope="session", autouse=True)
def live_server_class() -> None:
    """Django's live test server answers without Nagle's algorithm (``TCP_NODELAY``), and
    counts the requests it is answering (:class:`LiveRequests`).

    It keeps HTTP/1.1 connections alive and writes a response's headers and body in
    separate sends; with Nagle the body then waits for the client's delayed ACK, about
    40 ms on Linux, so every request over a kept-alive connection (schemathesis, the
    browser, requests' sessions) took 45 ms instead of 4. Production runs gunicorn.
    """
    from django.core.servers.basehttp import ThreadedWSGIServer
    from django.test.testcases import LiveServerThread

    class LiveServer(ThreadedWSGIServer):
        def get_request(self) -> tuple[socket.socket, object]:
            connection, address = super().get_request()
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return connection, address

        def set_app(self, application: Any) -> None:
            super().set_app(LIVE_REQUESTS.counting(application))

    LiveServerThread.server_class = LiveServer


class LiveRequests:
    """The live server's requests still being answered, so a test's end can wait for them.

    The live server is the session's, and in the tests' mode tasks run inside the request
    that sends them: an upload's request replays its challenges. A client that gives up on
    it (the SDK's 60 s read timeout, after which it retries and the retry is answered at
    once) leaves that request running into the next test, where it writes to a flushed
    database or, once pytest-django blocks the database, logs errors from its thread
    while pytest formats the failure (CPython 3.11's ``ast`` state
    is shared between threads, and the two together crashed the xdist worker: ci5,
    2026-12-07). A test that used the live server ends only once its requests have.
    """

    def __init__(self) -> None:
        self._settled = threading.Condition()
        self._active: dict[object, str] = {}

    def counting(self, application: Any) -> Any:
        """``application``, its requests counted until the server closes their response
        (Django's ``request_finished``, which reads the database, runs in that close)."""

        def counted(environ: dict[str, Any], start_response: Any) -> Any:
            key = object()
            with self._settled:
                self._active[key] = f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']}"
            try:
                return _Closing(application(environ, start_response), lambda: self._end(key))
            except BaseException:
                self._end(key)
                raise

        return counted

    def _end(self, key: object) -> None:
        with self._settled:
            self._active.pop(key, None)
            self._settled.notify_all()

    def wait(self, seconds: float) -> list[str]:
        """Wait up to ``seconds`` for every request to end; those still running."""
        with self._settled:
            self._settled.wait_for(lambda: not self._active, timeout=seconds)
            return sorted(self._active.values())


class _Closing:
    """A WSGI response whose ``close`` (the server's, after the body) also calls ``ended``."""

    def __init__(self, response: Any, ended: Callable[[], None]) -> None:
        self._response, self._ended = response, ended

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._response)

    def close(self) -> None:
        try:
            if hasattr(self._response, "close"):
                self._response.close()
        finally:
            self._ended()


LIVE_REQUESTS = LiveRequests()
#: How long a test's end waits for the live server's requests (a replay inside an upload).
LIVE_REQUESTS_SECONDS = 240


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    """Before the fixtures' teardown (the database's flush), the live server goes idle.

    A request still running after the wait fails the test's teardown, saying which, once
    the fixtures are torn down (failing first would leave them standing).
    """
    running = []
    if "live_server" in getattr(item, "fixturenames", ()):
        seconds = LIVE_REQUESTS_SECONDS
        running = LIVE_REQUESTS.wait(seconds)
    yield
    if running:
        pytest.fail(
            f"the live server was still answering {', '.join(running)} {seconds} s after "
            "the test ended (a client that gave up?)",
            pytrace=False,
        )


def services_configured() -> bool:
    """Whether the suite runs against real PostgreSQL and Redis servers."""
    return bool(os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL"))


@dataclass(frozen=True)
class WorkerProcess:
    """A running ``celery worker`` subprocess and where its output goes."""

    process: subprocess.Popen[bytes]
    nodename: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _test_database_url() -> str:
    """``DATABASE_URL`` pointed at the test database pytest-django created."""
    parts = urlsplit(os.environ["DATABASE_URL"])
    name = str(settings.DATABASES["default"]["NAME"])
    return urlunsplit(parts._replace(path=f"/{name}"))


def _purge_queues() -> None:
    # Messages left by an interrupted earlier run must not reach this run's worker.
    from config.celery_app import app

    with app.connection_for_write() as connection:
        channel = connection.default_channel
        for queue in WORKER_QUEUES:
            channel.queue_purge(queue)


def _wait_until_ready(worker: WorkerProcess) -> None:
    from config.celery_app import app

    deadline = time.monotonic() + WORKER_START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if worker.process.poll() is not None:
            pytest.fail(
                f"celery worker exited with status {worker.process.returncode}:\n{worker.log()}"
            )
        if app.control.ping(destination=[worker.nodename], timeout=1.0):
            return
    pytest.fail(
        f"celery worker not ready after {WORKER_START_TIMEOUT_SECONDS:.0f} s:\n{worker.log()}"
    )


@pytest.fixture(scope="session")
def celery_worker_process(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A real Celery worker process consuming every queue, for the whole session.

    It reads the same PostgreSQL test database and data directory as the tests, so a task
    sent with ``.delay()`` runs there and its rows are visible to the test. Use it with
    ``transactional_db`` (rows written by another process are not rolled back by a test
    transaction). Skips when ``DATABASE_URL``/``REDIS_URL`` are unset; terminates the
    worker when the session ends.
    """
    if not services_configured():
        pytest.skip(SERVICES_SKIP_REASON)
    if settings.CELERY_TASK_ALWAYS_EAGER:
        pytest.skip("DVBENCH_EAGER_TASKS is on, so tasks never leave the process; unset it")

    nodename = f"pytest-{uuid.uuid4().hex[:8]}@%h"
    log_path = tmp_path_factory.mktemp("celery") / "worker.log"
    environment = dict(os.environ)
    environment.pop("DVBENCH_EAGER_TASKS", None)
    environment.update(
        DATABASE_URL=_test_database_url(),
        DVBENCH_DATA_DIR=str(settings.DVBENCH["DATA_DIR"]),
        DJANGO_SETTINGS_MODULE="config.settings",
        PYTHONUNBUFFERED="1",
    )
    command = [
        sys.executable,
        "-m",
        "celery",
        "--app=config",
        "worker",
        f"--queues={','.join(WORKER_QUEUES)}",
        "--pool=solo",
        "--concurrency=1",
        f"--hostname={nodename}",
        "--loglevel=INFO",
        "--without-gossip",
        "--without-mingle",
    ]
    _purge_queues()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=environment, stdout=log, stderr=subprocess.STDOUT
        )
    # Celery expands %h to the host name; ping needs the expanded name.
    worker = WorkerProcess(process, nodename.replace("%h", socket.gethostname()), log_path)
    try:
        _wait_until_ready(worker)
        yield worker
    finally:
        process.terminate()  # warm shutdown: finish the current task, then exit
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(autouse=True)
def _tasks_run_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run Celery tasks in the calling process unless the test uses the real worker.

    With ``REDIS_URL`` set the platform sends tasks to the broker; without a worker they
    would sit there and a test expecting their effects would hang or fail. Tests that
    want the real round trip ask for ``celery_worker_process``.
    """
    if "celery_worker_process" in request.fixturenames:
        yield
        return
    from config.celery_app import app

    previous = app.conf.task_always_eager
    app.conf.task_always_eager = True
    try:
        yield
    finally:
        app.conf.task_always_eager = previous


@dataclass
class EmbeddedDemo:
    """``manage.py demo`` on embedded defaults, its flow complete, still serving.

    ``root`` looks like the repository's folder as a newcomer has it after
    ``./scripts/demo``: the demo's data in ``root/.data``, its report in
    ``root/.data/demo-report``.
    """

    root: Path
    url: str
    #: Everything the demo printed (stdout and stderr), as it goes on serving.
    log: Path
    environment: dict[str, str]

    @property
    def printed(self) -> list[str]:
        """The lines the demo has printed so far."""
        return self.log.read_text(errors="replace").splitlines()

    @property
    def data(self) -> Path:
        return self.root / ".data"

    @property
    def report(self) -> Path:
        return self.data / "demo-report"


@pytest.fixture(scope="session")
def embedded_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedDemo]:
    """The README's first command, run once for the session (it trains, proves, certifies
    and verifies a run: a minute of this suite's time each), shared by the tests that read
    its output (tests/test_demo_flow.py), its report (tests/attestations/
    test_certificates_model.py) and its live server (tests/test_guides.py).

    SQLite, tasks in-process and gunicorn, in a subprocess on a data directory of its own:
    the in-memory SQLite database of the test run cannot take the SDK's concurrent uploads.
    The services are removed from its environment, so it runs the same in CI.
    """
    import re

    root = tmp_path_factory.mktemp("demo")
    # Beside the demo's folder, which looks like a checkout to the guides' tests.
    log = tmp_path_factory.mktemp("demo-output") / "demo.log"
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("DJANGO_", "DVBENCH_", "DATABASE_URL", "REDIS_URL", "PYTHON"))
    }
    # A third of the demo's steps: the same flow, cheaper (the services flow test trains
    # the full run).
    environment.update(PYTHONUNBUFFERED="1", DIGITS_STEPS="20")
    command = [sys.executable, "manage.py", "demo", "--port", "0"]
    # Its output goes to a file, never to a pipe: the demo goes on serving (and printing)
    # for the whole session, long after the flow this fixture waits for.
    with log.open("wb") as output:
        server = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**environment, "DVBENCH_DATA_DIR": str(root / ".data")},
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + DEMO_TIMEOUT_SECONDS
        while True:
            text = log.read_text(errors="replace")
            if "Demo complete" in text or "Demo incomplete" in text or server.poll() is not None:
                break
            assert time.monotonic() < deadline, f"the demo did not finish its flow in time:\n{text}"
            time.sleep(0.2)
        url = re.search(r"serving at (http://[^/\s]+)/", text)
        assert url and "Demo complete" in text, text
        yield EmbeddedDemo(root, url.group(1), log, environment)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


# --- Collection: self-started services, time limits ---------------------------------------


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Fail a test whose ``xdist_group`` mark did not take under ``--dist loadgroup``.

    pytest-xdist keeps a group on one worker by adding ``@<group>`` to each marked test's
    id, after :func:`pytest_collection_modifyitems` marked it. Where it cannot (pytest 9.2
    with xdist 3.8: ``pyproject.toml``'s dev pins), or reads the marks before they are
    made, the ids stay as they were and the groups are silently spread over the workers:
    two Celery workers then consume the same Redis queues and take each other's tasks, and
    tests fail far from the cause.
    """
    if (
        getattr(item.config.option, "loadgroup", False)
        and item.get_closest_marker("xdist_group")
        and "@" not in item.nodeid
    ):
        pytest.fail(
            f"pytest-xdist did not keep {item.nodeid} in its xdist_group: pytest "
            f"{pytest.__version__} with this pytest-xdist cannot (pyproject.toml's dev pins say "
            "which versions can); run it without -n, or with the pinned versions",
            pytrace=False,
        )


def _timeout_seconds(marker: pytest.Mark) -> float | None:
    value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
    return None if value is None else float(value)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker counts its rate limits under keys of its own.

    The workers share the cache (Redis, or the files under the data directory), and each
    worker's test database numbers its users and keys from 1: without a prefix of its own,
    one worker's requests would count against the other's limits.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        cache = settings.CACHES["default"]
        cache["KEY_PREFIX"] = f"{cache.get('KEY_PREFIX', '')}-{worker}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="also run the tests marked long (deselected by default; see the marker)",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups it marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the tests marked ``long`` unless ``--long`` is given; mark the tests
    whose fixtures start services of their own (``self_started``), put those that must
    share an xdist worker in one group (``XDIST_GROUPS``), and give the tests that use a
    slow session fixture its setup time on top of their limit.
    """
    if not config.getoption("long"):
        kept: list[pytest.Item] = []
        deselected: list[pytest.Item] = []
        for item in items:
            (deselected if item.get_closest_marker("long") else kept).append(item)
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept
    default = None
    if config.pluginmanager.hasplugin("timeout"):
        default = float(config.getoption("timeout", None) or config.getini("timeout") or 0)
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names.intersection(SELF_STARTING_FIXTURES):
            item.add_marker(pytest.mark.self_started)
        groups = {XDIST_GROUPS[name] for name in names.intersection(XDIST_GROUPS)}
        if item.get_closest_marker("services"):
            groups.add("services")
        # One group a test: services first (a demo test with services needs both), else
        # its file's, so that a file's module fixtures (a trained run, a forgery suite)
        # are built on one xdist worker, not on each that runs one of its tests.
        group = (
            "services" if "services" in groups else "demo" if groups else item.nodeid.split("::")[0]
        )
        item.add_marker(pytest.mark.xdist_group(group))
        extra = sum(seconds for name, seconds in SLOW_FIXTURE_SECONDS.items() if name in names)
        if not (default and extra):
            continue
        declared = item.get_closest_marker("timeout")
        base = _timeout_seconds(declared) if declared is not None else default
        if base:  # 0 turns the limit off; it stays off
            # Prepended: pytest-timeout reads the closest timeout marker, this one.
            item.add_marker(pytest.mark.timeout(base + extra), append=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test that used the session's own S3 server shows the end of its log."""
    report = yield
    if report.failed:
        server = getattr(item, "funcargs", {}).get("s3_server")
        if isinstance(server, S3Server) and server.log is not None:
            report.sections.append(("moto_server log", server.log_tail()))
    return report


# --- The skipped groups, in one line at the end of the run --------------------------------

#: (group, what its tests need, words of their skip reasons, their marker). A skip goes to
#: the first group whose words its reason holds, else to the first whose marker it has.
SKIP_GROUPS = (
    (
        "services",
        "real PostgreSQL and Redis",
        ("DATABASE_URL", "REDIS_URL", "PostgreSQL"),
        "services",
    ),
    ("browser", "Chromium", ("Chromium",), "browser"),
    ("sigstore-js", "node and npm ci in tests/sigstore_js", ("JavaScript verifier",), ""),
    ("gpu", "a CUDA device", ("CUDA",), "gpu"),
)


def skip_group(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The group of a skipped test's report (``SKIP_GROUPS``), or ``other``."""
    longrepr = report.longrepr
    reason = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr).lower()
    for group, _, words, _ in SKIP_GROUPS:
        if any(word.lower() in reason for word in words):
            return group
    for group, _, _, marker in SKIP_GROUPS:
        if marker and marker in getattr(report, "keywords", {}):
            return group
    return "other"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line: how many tests skipped, by group and what the group needs.

    Printed before pytest's own short summary (``-ra`` lists each reason there) and its
    closing line, which stays the last.
    """
    # A module that skips whole (importorskip) is one collection report, as pytest counts it.
    skipped = [
        report
        for report in terminalreporter.stats.get("skipped", [])
        if isinstance(report, pytest.TestReport | pytest.CollectReport)
        and not hasattr(report, "wasxfail")
    ]
    if not skipped:
        return
    counts = Counter(skip_group(report) for report in skipped)
    needs = {group: need for group, need, _, _ in SKIP_GROUPS} | {"other": "see the reasons"}
    groups = sorted(counts, key=lambda group: (-counts[group], group))
    terminalreporter.write_line(
        "skipped by group: "
        + ", ".join(f"{counts[group]} {group} ({needs[group]})" for group in groups)
    )
