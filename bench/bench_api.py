"""API latency under concurrency, and upload throughput, against gunicorn.

    DATABASE_URL=postgres://... python bench/bench_api.py [--requests 3000] [--clients 50]
        [--workers 4] [--upload-mib 256] [--part-mib 64]

What it does, in a throwaway data directory:

1. migrates the database named by ``DATABASE_URL`` (PostgreSQL; without it the embedded
   SQLite is used and the run is labelled as such), and seeds one organisation with 200
   experiments and 400 proofs, and a user with an API key;
2. starts gunicorn (``platform/gunicorn.conf.py``, ``--workers``) on a free local port;
3. sends ``--requests`` requests from ``--clients`` concurrent clients to the experiment
   list (50 a page) and the same number to experiment detail pages, and prints requests
   per second and p50/p95/p99 latency for each, against the targets (>= 300 req/s,
   p99 <= 150 ms);
4. uploads ``--upload-mib`` of random bytes through the resumable upload API (create,
   parts of ``--part-mib``, complete), and copies the same bytes with ``shutil.copyfile``
   on the same disk, and prints both throughputs and their ratio (target >= 0.5); then
   the same for one part holding a whole blob (completion renames it, no second pass), and
   the machine's SHA-256 rate, which bounds the ratio: the server hashes every byte.

The machine (CPU, cores, load average) is printed with the figures.

The load generator runs on the same machine as the server, so it takes CPU from it: the
numbers are a lower bound for the server alone.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
TARGET_RPS = 300.0
TARGET_P99_MS = 150.0
TARGET_UPLOAD_RATIO = 0.5


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def django_env(data_dir: Path, part_mib: int, upload_mib: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        DVBENCH_DATA_DIR=str(data_dir),
        DVBENCH_MAX_PART_BYTES=str(part_mib * 1024 * 1024),
        DVBENCH_MAX_BLOB_BYTES=str(max(upload_mib, 1) * 1024 * 1024 * 2),
        DVBENCH_LOG_LEVEL="WARNING",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "agent" / "src")]),
    )
    return env


SEED = r"""
import django, json, sys
django.setup()
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone
from attestations.accounts.models import ApiKey, Membership, Organization
from attestations.uploads.models import Blob
from attestations.proofs.models import Proof, Job
from attestations.experiments.models import Experiment
spec = {"framework": "jax", "model_description": "bench model", "optimizer": "adam",
        "dataset_commitment": "ab" * 32, "max_flops": 10**25, "max_tokens": 10**12,
        "max_gpu_hours": "100", "allowed_regimes": ["pretraining"]}
with transaction.atomic():
    org, _ = Organization.objects.get_or_create(slug="bench", defaults={"name": "Bench"})
    user, _ = User.objects.get_or_create(username="bench")
    Membership.objects.get_or_create(user=user, organization=org, defaults={"role": "trainer"})
    blob, _ = Blob.objects.get_or_create(sha256="cd" * 32, defaults={"size": 1, "storage_name": "x"})
    names = []
    for i in range(200):
        e = Experiment.register(org, f"run-{i:03d}", spec, user=user)
        names.append(e.full_name)
        for j in range(2):
            p = Proof.objects.create(experiment=e, spec=e.current_spec, transcript=blob,
                                     status="valid", steps=100, checks=3)
            Job.objects.create(kind="ingest", organization=org, proof=p, status="succeeded",
                               progress=1.0)
    _, raw = ApiKey.issue(user, "bench")
json.dump({"key": raw, "names": names}, sys.stdout)
"""


class Served(NamedTuple):
    port: int
    key: str
    names: list[str]
    tmp: Path  # a scratch directory that lives as long as the server
    data_dir: Path


@contextlib.contextmanager
def serve(
    workers: int, part_mib: int, upload_mib: int, env_extra: dict[str, str] | None = None
) -> Iterator[Served]:
    """A migrated, flushed and seeded platform under gunicorn, in a throwaway directory."""
    with tempfile.TemporaryDirectory(prefix="dvbench-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        env = django_env(data_dir, part_mib, upload_mib) | (env_extra or {})
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
        port = free_port()
        server = subprocess.Popen(
            [
                python,
                "-m",
                "gunicorn",
                "-c",
                str(ROOT / "platform" / "gunicorn.conf.py"),
                "--bind",
                f"127.0.0.1:{port}",
                "--workers",
                str(workers),
                "--access-logfile",
                "/dev/null",
                "--max-requests",
                "0",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", port), timeout=1):
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        stderr = server.stderr.read().decode() if server.stderr else ""
                        raise SystemExit(f"gunicorn did not start: {stderr}") from None
                    time.sleep(0.2)
            yield Served(port, seeded["key"], seeded["names"], Path(tmp), data_dir)
        finally:
            server.terminate()
            server.wait(timeout=30)


def run_load(port: int, key: str, paths: list[str], total: int, clients: int) -> dict[str, float]:
    """``total`` GETs spread over ``clients`` threads; returns throughput and latencies."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    counter = iter(range(total))
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json"}

    def worker() -> None:
        nonlocal errors
        local: list[float] = []
        local_errors = 0
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while True:
            with lock:
                index = next(counter, None)
            if index is None:
                break
            path = paths[index % len(paths)]
            start = time.perf_counter()
            try:
                conn.request("GET", path, headers=headers)
                response = conn.getresponse()
                response.read()
                if response.status != 200:
                    local_errors += 1
                if response.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            except (OSError, http.client.HTTPException):
                local_errors += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            local.append(time.perf_counter() - start)
        conn.close()
        with lock:
            latencies.extend(local)
            errors += local_errors

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000

    return {
        "requests": float(len(latencies)),
        "errors": float(errors),
        "rps": len(latencies) / elapsed,
        "p50_ms": pct(0.50),
        "p95_ms": pct(0.95),
        "p99_ms": pct(0.99),
        "mean_ms": statistics.fmean(latencies) * 1000,
    }


def upload(port: int, key: str, experiment: str, source: Path, part_bytes: int) -> float:
    """Upload ``source`` through the API; returns seconds from create to completion."""
    data_size = source.stat().st_size
    digest = hashlib.sha256()
    with source.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    # The client's own hashing is the SDK's work, done before any byte is sent; the
    # server side is what is timed, as the plain copy is.
    part_digests = []
    with source.open("rb") as handle:
        while chunk := handle.read(part_bytes):
            part_digests.append(hashlib.sha256(chunk).hexdigest())
    started = time.perf_counter()
    body = {
        "experiment": experiment,
        "kind": "artifact",
        "size": data_size,
        "sha256": digest.hexdigest(),
    }
    conn.request("POST", "/api/v1/uploads/", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    created = json.loads(response.read())
    if response.status != 201:
        raise SystemExit(f"create upload failed: {response.status} {created}")
    with source.open("rb") as handle:
        for number, part_digest in enumerate(part_digests, start=1):
            size = min(part_bytes, data_size - (number - 1) * part_bytes)
            conn.putrequest("PUT", f"/api/v1/uploads/{created['id']}/parts/{number}")
            conn.putheader("Authorization", headers["Authorization"])
            conn.putheader("Content-Type", "application/octet-stream")
            conn.putheader("Content-Length", str(size))
            conn.putheader("X-Part-SHA256", part_digest)
            conn.endheaders()
            remaining = size
            while remaining:
                chunk = handle.read(min(remaining, 256 << 10))
                conn.send(chunk)
                remaining -= len(chunk)
            response = conn.getresponse()
            answer = response.read()
            if response.status != 200:
                raise SystemExit(f"part {number} failed: {response.status} {answer[:300]!r}")
            if response.getheader("Connection", "").lower() == "close":
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", f"/api/v1/uploads/{created['id']}/complete", headers=headers)
    response = conn.getresponse()
    answer = response.read()
    if response.status != 200:
        raise SystemExit(f"complete failed: {response.status} {answer[:300]!r}")
    elapsed = time.perf_counter() - started
    conn.close()
    return elapsed


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def machine() -> str:
    """CPU model, core count and load: the figures mean nothing without them."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return f"{model}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"


def sha256_rate(data: bytes) -> float:
    """MiB/s of one SHA-256 pass over ``data`` (best of three)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - start)
    return len(data) / (1 << 20) / best


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--upload-mib", type=int, default=256)
    parser.add_argument("--part-mib", type=int, default=64)
    args = parser.parse_args()

    database = "PostgreSQL" if os.environ.get("DATABASE_URL") else "SQLite (DATABASE_URL unset)"
    with serve(args.workers, args.part_mib, args.upload_mib) as served:
        port, key, names, tmp, data_dir = served
        # Warm every worker (imports, connections) before measuring.
        run_load(port, key, ["/api/v1/experiments/?page_size=50"], args.workers * 20, args.workers)

        print(
            f"DVBench API bench: gunicorn x{args.workers} workers over {database}, "
            f"{args.clients} concurrent clients, load generator on the same machine\n"
            f"  machine: {machine()}"
        )
        results = {
            "list (50 a page)": run_load(
                port, key, ["/api/v1/experiments/?page_size=50"], args.requests, args.clients
            ),
            "detail": run_load(
                port,
                key,
                [f"/api/v1/experiments/{name}/" for name in names],
                args.requests,
                args.clients,
            ),
        }
        ok = True
        for name, r in results.items():
            passed = r["rps"] >= TARGET_RPS and r["p99_ms"] <= TARGET_P99_MS and not r["errors"]
            ok &= passed
            print(
                f"  {name:<17} {r['requests']:>6.0f} req  {r['rps']:>7.1f} req/s  "
                f"p50 {r['p50_ms']:6.1f} ms  p95 {r['p95_ms']:6.1f} ms  p99 {r['p99_ms']:6.1f} ms  "
                f"errors {r['errors']:.0f}  "
                f"(rps/target {r['rps'] / TARGET_RPS:.2f}, p99/target {r['p99_ms'] / TARGET_P99_MS:.2f}) "
                f"{verdict(passed)}"
            )

        source = tmp / "blob.bin"
        with source.open("wb") as handle:
            for _ in range(args.upload_mib):
                handle.write(os.urandom(1 << 20))
        copy_target = data_dir / "copy.bin"
        # Side by side, best of two each, alternating.
        copies, durable, uploads = [], [], []
        for _ in range(2):
            start = time.perf_counter()
            shutil.copyfile(source, copy_target)
            copies.append(time.perf_counter() - start)
            with copy_target.open("rb+") as handle:
                os.fsync(handle.fileno())
            durable.append(time.perf_counter() - start)
            copy_target.unlink()
            uploads.append(upload(port, key, names[0], source, args.part_mib * 1024 * 1024))
            # The second upload would be deduplicated: change the bytes.
            with source.open("r+b") as handle:
                handle.write(os.urandom(32))
        # One part holding the whole blob: the part's digest is the blob's, so
        # completion renames it into place instead of reading it again.
        single_bytes = min(args.upload_mib, args.part_mib) << 20
        single_source = tmp / "single.bin"
        with source.open("rb") as handle:
            single_source.write_bytes(handle.read(single_bytes))
        singles, single_copies = [], []
        for _ in range(2):
            start = time.perf_counter()
            shutil.copyfile(single_source, copy_target)
            single_copies.append(time.perf_counter() - start)
            copy_target.unlink()
            singles.append(upload(port, key, names[0], single_source, single_bytes))
            with single_source.open("r+b") as handle:
                handle.write(os.urandom(32))
        with source.open("rb") as handle:
            hash_rate = sha256_rate(handle.read(single_bytes))
        mib = float(args.upload_mib)
        copy_rate, upload_rate = mib / min(copies), mib / min(uploads)
        durable_rate = mib / min(durable)
        ratio = upload_rate / copy_rate
        ok &= ratio >= TARGET_UPLOAD_RATIO
        single_mib = single_bytes / (1 << 20)
        single_rate = single_mib / min(singles)
        single_copy = single_mib / min(single_copies)
        print(
            f"  upload {single_mib:.0f} MiB as one part: {single_rate:7.1f} MiB/s, "
            f"plain copy {single_copy:7.1f} MiB/s, upload/copy {single_rate / single_copy:.2f}\n"
            f"  sha256 on this machine: {hash_rate:7.1f} MiB/s; the server must hash every byte "
            f"once, so upload/copy cannot exceed {hash_rate / copy_rate:.2f} here"
        )
        # The upload fsyncs what it stores (an attestation platform must not lose an
        # accepted artifact); the copy + fsync line is the like-for-like comparison.
        print(
            f"  upload {args.upload_mib} MiB in {args.part_mib} MiB parts: {upload_rate:7.1f} MiB/s\n"
            f"    plain copy:         {copy_rate:7.1f} MiB/s   upload/copy {ratio:.2f} "
            f"(target >= {TARGET_UPLOAD_RATIO}) {verdict(ratio >= TARGET_UPLOAD_RATIO)}\n"
            f"    copy + fsync:       {durable_rate:7.1f} MiB/s   upload/durable copy "
            f"{upload_rate / durable_rate:.2f}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
