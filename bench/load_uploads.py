"""Uploads under concurrent clients, against gunicorn over PostgreSQL, on loopback.

    DATABASE_URL=postgres://... python bench/load_uploads.py [--clients 8] [--uploads 80]
        [--blob-kib 1024] [--part-kib 256] [--workers 4]

Each of ``--clients`` threads uploads blobs of ``--blob-kib`` (random bytes, so nothing
deduplicates) through the whole resumable protocol: create, parts of ``--part-kib`` with
their digests, complete. ``--uploads`` uploads in all (a bounded count). Prints per-request
latency percentiles for each step, uploads per second and MiB/s, and the machine and its
load. The load generator shares the machine with the server, as in ``bench_api.py``.

Reads the same migrations and seed as ``bench_api.py`` (one organisation, 200 experiments,
a trainer with an API key), in a throwaway data directory; the database named by
``DATABASE_URL`` is flushed first.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import sys
import threading
import time

from bench_api import machine, serve


def request(
    port: int, method: str, path: str, body: bytes, headers: dict[str, str]
) -> tuple[int, bytes, float]:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    return response.status, data, time.perf_counter() - start


def one_upload(
    port: int, key: str, experiment: str, blob: bytes, part: int, timings: dict[str, list[float]]
) -> None:
    auth = {"Authorization": f"Bearer {key}"}
    declaration = {
        "experiment": experiment,
        "kind": "artifact",
        "size": len(blob),
        "sha256": hashlib.sha256(blob).hexdigest(),
    }
    status, data, elapsed = request(
        port,
        "POST",
        "/api/v1/uploads/",
        json.dumps(declaration).encode(),
        {**auth, "Content-Type": "application/json"},
    )
    if status != 201:
        raise RuntimeError(f"create: {status} {data[:200]!r}")
    timings["create"].append(elapsed)
    upload_id = json.loads(data)["id"]
    for number, start in enumerate(range(0, len(blob), part), start=1):
        chunk = blob[start : start + part]
        status, data, elapsed = request(
            port,
            "PUT",
            f"/api/v1/uploads/{upload_id}/parts/{number}",
            chunk,
            {
                **auth,
                "Content-Type": "application/octet-stream",
                "X-Part-SHA256": hashlib.sha256(chunk).hexdigest(),
            },
        )
        if status != 200:
            raise RuntimeError(f"part {number}: {status} {data[:200]!r}")
        timings["part"].append(elapsed)
    status, data, elapsed = request(
        port, "POST", f"/api/v1/uploads/{upload_id}/complete", b"", auth
    )
    if status != 200:
        raise RuntimeError(f"complete: {status} {data[:200]!r}")
    timings["complete"].append(elapsed)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--uploads", type=int, default=80)
    parser.add_argument("--blob-kib", type=int, default=1024)
    parser.add_argument("--part-kib", type=int, default=256)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    blob_bytes, part_bytes = args.blob_kib * 1024, args.part_kib * 1024
    blobs = [os.urandom(blob_bytes) for _ in range(args.uploads)]
    database = "PostgreSQL" if os.environ.get("DATABASE_URL") else "SQLite (DATABASE_URL unset)"
    with serve(
        args.workers,
        max(1, -(-part_bytes // (1 << 20))),
        max(1, -(-blob_bytes // (1 << 20))),
        # Measuring the server, not its abuse limit.
        env_extra={"DVBENCH_RATE_UPLOADS": "off"},
    ) as served:
        port, key, names = served.port, served.key, served.names
        timings: dict[str, list[float]] = {"create": [], "part": [], "complete": []}
        errors: list[str] = []
        lock = threading.Lock()
        queue = iter(range(args.uploads))

        def client() -> None:
            local: dict[str, list[float]] = {"create": [], "part": [], "complete": []}
            while True:
                with lock:
                    index = next(queue, None)
                if index is None:
                    break
                try:
                    one_upload(
                        port, key, names[index % len(names)], blobs[index], part_bytes, local
                    )
                except (OSError, RuntimeError, http.client.HTTPException) as error:
                    with lock:
                        errors.append(str(error))
            with lock:
                for step, values in local.items():
                    timings[step].extend(values)

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    done = len(timings["complete"])
    print(
        f"DVBench upload load: gunicorn x{args.workers} over {database}, {args.clients} concurrent clients, "
        f"{args.uploads} uploads of {args.blob_kib} KiB in {args.part_kib} KiB parts\n"
        f"  machine: {machine()}\n"
        f"  {done} uploads in {elapsed:.1f} s: {done / elapsed:.1f} uploads/s, "
        f"{done * blob_bytes / (1 << 20) / elapsed:.1f} MiB/s, errors {len(errors)}"
    )
    for step, values in timings.items():
        if values:
            print(
                f"  {step:<9} {len(values):>5} req  p50 {percentile(values, 0.5):7.1f} ms  "
                f"p95 {percentile(values, 0.95):7.1f} ms  p99 {percentile(values, 0.99):7.1f} ms"
            )
    for error in errors[:5]:
        print(f"  error: {error}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
