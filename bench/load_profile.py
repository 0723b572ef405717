"""Cost of one API request in-process: queries, milliseconds, and where the time goes.

    DATABASE_URL=postgres://.../scratch python bench/load_profile.py [--requests 200] [--profile list]

Seeds the database like ``bench_api.py`` (it is flushed first), then sends requests through
Django's test client (the whole middleware stack and DRF, no HTTP server, no network) to
the experiment list (50 a page) and detail endpoints, authenticated with an API key.
Prints the SQL queries of one request and the mean milliseconds per request; with
``--profile list`` or ``--profile detail``, the cProfile functions taking most time.
This is the server's CPU cost per request: at ``n`` cores the server alone cannot exceed
``n * 1000 / ms`` requests per second.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_api import ROOT, SEED, django_env, machine


class Recorder:
    """A database execute wrapper that keeps the SQL of every query."""

    def __init__(self, into: list[str]) -> None:
        self.into = into

    def __call__(self, execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        self.into.append(sql)
        return execute(sql, params, many, context)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--profile", choices=["list", "detail"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dvbench-profile-") as tmp:
        env = django_env(Path(tmp), 64, 64)
        python = sys.executable
        subprocess.run([python, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True)
        subprocess.run(
            [python, "manage.py", "flush", "--no-input", "-v", "0"], cwd=ROOT, env=env, check=True
        )
        seeded = json.loads(
            subprocess.run(
                [python, "-c", SEED], cwd=ROOT, env=env, check=True, capture_output=True
            ).stdout
        )
        os.environ.update(env)
        sys.path[:0] = [
            str(ROOT),
            str(ROOT / "agent" / "zkdv" / "src"),
            str(ROOT / "agent" / "dvbench" / "src"),
        ]
        import django

        django.setup()
        from django.db import connection
        from django.test import Client

        client = Client(
            HTTP_AUTHORIZATION=f"Bearer {seeded['key']}", HTTP_ACCEPT="application/json"
        )
        paths = {
            "list": ["/api/v1/experiments/?page_size=50"],
            "detail": [f"/api/v1/experiments/{name}/" for name in seeded["names"]],
        }
        print(f"In-process API cost per request; machine: {machine()}")
        for kind, targets in paths.items():
            for path in targets[:5]:
                assert client.get(path).status_code == 200
            queries: list[str] = []
            with connection.execute_wrapper(Recorder(queries)):
                client.get(targets[0])
            start = time.perf_counter()
            for i in range(args.requests):
                client.get(targets[i % len(targets)])
            per = (time.perf_counter() - start) / args.requests * 1000
            print(f"  {kind:<7} {len(queries)} queries  {per:6.2f} ms/request")
            for sql in queries:
                print(f"      {sql[:110]}")
            if args.profile == kind:
                profiler = cProfile.Profile()
                profiler.enable()
                for i in range(args.requests):
                    client.get(targets[i % len(targets)])
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
