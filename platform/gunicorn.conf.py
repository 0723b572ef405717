"""Gunicorn settings for the DVBench web process (compose service ``web``, ``./scripts/demo``).

Command-line flags override these; ``WEB_CONCURRENCY`` sets the number of workers and
``GUNICORN_CMD_ARGS`` can pass any other gunicorn flag.
"""

import os
import resource

wsgi_app = "config.wsgi:application"
# Gunicorn's own refusals (a request line over limit_request_line, a Content-Length that is
# not a number, ...) in the API's JSON error format with gunicorn's statuses, instead of
# its HTML pages (attestations/http/server.py). gthread: JsonErrorThreadWorker.
worker_class = "attestations.http.server.JsonErrorSyncWorker"
bind = ["0.0.0.0:8000"]
workers = int(os.environ.get("WEB_CONCURRENCY", "2"))
# Upload parts are up to DVBENCH_MAX_PART_BYTES (64 MiB by default); a slow client needs
# more than gunicorn's default 30 s to send one.
timeout = 120
graceful_timeout = 30
keepalive = 5
# Recycle workers now and then so a slow leak cannot grow without bound.
max_requests = 2000
max_requests_jitter = 200
accesslog = "-"
errorlog = "-"
# Heartbeat files on tmpfs: a container's overlay disk can stall them and get workers killed.
_SHARED_MEMORY = "/dev/shm"  # noqa: S108 - gunicorn's advice for containers, not a temp file
if os.path.isdir(_SHARED_MEMORY):
    worker_tmp_dir = _SHARED_MEMORY
# The runtime control socket defaults to one path per user ($HOME/.gunicorn/gunicorn.ctl):
# two servers on one machine would fight over it, and a container's user cannot write there.
control_socket_disable = True

# Each web worker's address space is capped (RLIMIT_AS): a request that would take the
# machine's memory fails with MemoryError (a 500 for that request) instead of the OOM
# killer taking a worker, or the database, at random. Parsers bound what they decode
# (zkdv.sliced._bounded); this is the backstop. 0 turns it off.
_MEMORY_LIMIT_MB = int(os.environ.get("DVBENCH_WEB_MEMORY_LIMIT_MB", "16384") or "0")


def post_fork(server: object, worker: object) -> None:
    """Cap the new worker's address space at DVBENCH_WEB_MEMORY_LIMIT_MB MiB."""
    if _MEMORY_LIMIT_MB > 0:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = _MEMORY_LIMIT_MB * 1024 * 1024
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
