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
   on the same disk, and prints both throughputs and their ratio (target >= 0.4); then
   the same for one part holding a whole blob (completion renames it, no second pass), and
   the machine's SHA-256 rate, which bounds the ratio: the server hashes every byte; the
   exchange's floor (the same bytes over raw loopback TCP to a process doing only what
   the web worker must do to them: receive, hash the part and the whole file, write,
   sync each part; :func:`transfer_floor`) and the upload's ratio to it; and the web
   workers' CPU time per GiB uploaded (from ``/proc``);
5. starts ``moto_server`` (a real S3 API) and the platform on it (``DVBENCH_S3_BUCKET``),
   twice: with the bytes through the web worker (``DVBENCH_S3_DIRECT_UPLOADS=0``), then
   as direct uploads (each part PUT to its presigned S3 URL, S3 hashing the whole), and
   prints each throughput and the web workers' CPU time per GiB beside the local disk's
   (``--no-s3`` skips it). moto_server is one Python process: its own rate, not the
   platform's, bounds the S3 lines. ``--uploads-only`` skips the latency runs;
6. with ``--sdk-mib 10,1024``, the SDK (``dvbench``'s uploader, in a fresh process) sends
   one file of each size and its peak RSS is printed: bounded memory means the same
   figure for every size.

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
TARGET_UPLOAD_RATIO = 0.4


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
        PYTHONPATH=os.pathsep.join(
            [
                str(ROOT),
                str(ROOT / "agent" / "zkdv" / "src"),
                str(ROOT / "agent" / "dvbench" / "src"),
            ]
        ),
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


# One file of the given size sent by the SDK's uploader in a fresh process; prints that
# process's peak RSS (KiB) and the seconds the upload took.
SDK_UPLOAD = r"""
import os, resource, sys, time
from pathlib import Path
from dvbench import Client
from dvbench.uploads import Manifest, Uploader
url, key, experiment, directory = sys.argv[1:5]
relative = "files/snapshot-00000000.params.bin"
with Client(url, api_key=key) as client:
    manifest = Manifest.create(Path(directory), experiment=experiment, spec_digest="",
                               backend="jax", base_url=url, ephemeral=False)
    started = time.perf_counter()
    Uploader(client, manifest).upload(relative)
    elapsed = time.perf_counter() - started
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, elapsed)
"""


def sdk_upload_rss(served: Served, mib: int, part_mib: int, parallel: int) -> tuple[int, float]:
    """Peak RSS (KiB) and seconds of an SDK process uploading a file of ``mib`` MiB."""
    directory = served.tmp / f"sdk-{mib}"
    (directory / "files").mkdir(parents=True)
    with (directory / "files" / "snapshot-00000000.params.bin").open("wb") as handle:
        for _ in range(mib):
            handle.write(os.urandom(1 << 20))
    env = dict(os.environ)
    env.update(
        DVBENCH_PART_SIZE=str(part_mib << 20),
        DVBENCH_UPLOAD_PARALLEL=str(parallel),
        PYTHONPATH=os.pathsep.join(
            [
                str(ROOT / "agent" / "zkdv" / "src"),
                str(ROOT / "agent" / "dvbench" / "src"),
                env.get("PYTHONPATH", ""),
            ]
        ),
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SDK_UPLOAD,
            f"http://127.0.0.1:{served.port}",
            served.key,
            served.names[1],
            str(directory),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    shutil.rmtree(directory)
    return int(out[-2]), float(out[-1])


class Served(NamedTuple):
    port: int
    key: str
    names: list[str]
    tmp: Path  # a scratch directory that lives as long as the server
    data_dir: Path
    pid: int  # gunicorn's arbiter; its children are the web workers


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
        # gunicorn's error log (Django's warnings land there) goes to a file: a pipe
        # nobody reads blocks the server once 64 KiB have piled up, mid-run.
        log = Path(tmp) / "gunicorn.log"
        with log.open("wb") as output:  # the server holds its own copy
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
                stdin=subprocess.DEVNULL,
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
                        printed = log.read_text(errors="replace")[-4000:]
                        raise SystemExit(f"gunicorn did not start: {printed}") from None
                    time.sleep(0.2)
            yield Served(port, seeded["key"], seeded["names"], Path(tmp), data_dir, server.pid)
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


def upload_direct(port: int, key: str, experiment: str, source: Path, part_bytes: int) -> float:
    """Upload ``source`` as a direct upload: each part PUT to its presigned S3 URL.

    Returns seconds from create to completion. The parts go to S3, not to the platform,
    one after another, as the SDK sends them with ``--parallel 1``.
    """
    import httpx

    data_size = source.stat().st_size
    digest = hashlib.sha256()
    part_digests = []
    with source.open("rb") as handle:
        while chunk := handle.read(part_bytes):
            part_digests.append(hashlib.sha256(chunk).hexdigest())
            digest.update(chunk)
    api = httpx.Client(
        base_url=f"http://127.0.0.1:{port}/api/v1",
        headers={"Authorization": f"Bearer {key}"},
        timeout=600,
    )
    storage = httpx.Client(timeout=600)
    started = time.perf_counter()
    created = api.post(
        "/uploads/",
        json={
            "experiment": experiment,
            "kind": "artifact",
            "size": data_size,
            "sha256": digest.hexdigest(),
        },
    )
    if created.status_code != 201 or not created.json().get("direct"):
        raise SystemExit(f"create direct upload failed: {created.status_code} {created.text}")
    upload_id = created.json()["id"]
    with source.open("rb") as handle:
        for number, part_digest in enumerate(part_digests, start=1):
            size = min(part_bytes, data_size - (number - 1) * part_bytes)
            issued = api.post(
                f"/uploads/{upload_id}/parts/{number}/url/",
                json={"size": size, "sha256": part_digest},
            )
            if issued.status_code != 200:
                raise SystemExit(f"part {number} URL failed: {issued.status_code} {issued.text}")
            answer = issued.json()

            def body(remaining: int = size) -> Iterator[bytes]:
                while remaining:
                    chunk = handle.read(min(remaining, 1 << 20))
                    remaining -= len(chunk)
                    yield chunk

            sent = storage.put(answer["url"], content=body(), headers=answer["headers"])
            if sent.status_code != 200:
                raise SystemExit(f"part {number} PUT failed: {sent.status_code} {sent.text}")
    done = api.post(f"/uploads/{upload_id}/complete/")
    if done.status_code != 200:
        raise SystemExit(f"complete failed: {done.status_code} {done.text[:300]}")
    elapsed = time.perf_counter() - started
    api.close()
    storage.close()
    return elapsed


def workers_cpu(arbiter: int) -> float:
    """CPU seconds (user + system) spent so far by the arbiter's child processes.

    Read from ``/proc/<pid>/stat`` (Linux); 0.0 where there is no ``/proc``.
    """
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The command name may hold spaces: the fields start after its ')'.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == arbiter:  # ppid
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


@contextlib.contextmanager
def s3_server() -> Iterator[tuple[str, dict[str, str]]]:
    """A moto_server on a free port with one bucket; yields it and the platform's S3 env."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("moto_server did not start") from None
                time.sleep(0.1)
        env = {
            "DVBENCH_S3_BUCKET": "dvbench-bench",
            "DVBENCH_S3_ENDPOINT_URL": endpoint,
            "DVBENCH_S3_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
        }
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name=env["DVBENCH_S3_REGION"],
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket=env["DVBENCH_S3_BUCKET"])
        yield endpoint, env
    finally:
        process.terminate()
        process.wait(timeout=30)


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


#: The receiving half of :func:`transfer_floor`, run in a process of its own: what the web
#: worker does to a part's bytes (receive into reused buffers, hash the part and, in a
#: second thread, the whole file, write at the part's offset, sync each part), and
#: nothing else.
_FLOOR_RECEIVER = """
import hashlib, os, socket, sys
from concurrent.futures import ThreadPoolExecutor
size, part, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
buffers = [memoryview(bytearray(1 << 20)) for _ in range(2)]
whole, pool, offset, turn = hashlib.sha256(), ThreadPoolExecutor(1), 0, 0
while offset < size:
    digest, end, chained = hashlib.sha256(), min(size, offset + part), None
    while offset < end:
        view = buffers[turn]
        turn ^= 1
        count = conn.recv_into(view, min(len(view), end - offset))
        if not count:
            sys.exit("the sender stopped early")
        chunk = view[:count]
        if chained is not None:
            chained.result()
        chained = pool.submit(whole.update, chunk)
        digest.update(chunk)
        os.pwrite(out, chunk, offset)
        offset += count
    chained.result()
    os.fdatasync(out)
conn.sendall(b"ok")
"""


def transfer_floor(source: Path, part_bytes: int, directory: Path) -> float:
    """Seconds for the upload's own work without HTTP, Django or the database.

    The bench's client loop sends ``source`` over a loopback TCP connection to a process
    doing what the web worker must do to every byte (:data:`_FLOOR_RECEIVER`). The
    upload's rate against this one is the platform's share; this one's against a plain
    copy is the machine's (two SHA-256 passes per byte, the client on the same cores).
    """
    size = source.stat().st_size
    target = directory / "floor.bin"
    receiver = subprocess.Popen(
        [sys.executable, "-c", _FLOOR_RECEIVER, str(size), str(part_bytes), str(target)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as conn, source.open("rb") as handle:
            started = time.perf_counter()
            while chunk := handle.read(256 << 10):
                conn.sendall(chunk)
            if conn.recv(2) != b"ok":
                raise SystemExit("the floor's receiver failed")
            elapsed = time.perf_counter() - started
    finally:
        receiver.wait(timeout=60)
        target.unlink(missing_ok=True)
    return elapsed


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
    parser.add_argument(
        "--uploads-only", action="store_true", help="skip the latency runs (steps 1-3's load)"
    )
    parser.add_argument(
        "--no-s3", action="store_true", help="skip the S3 upload run (step 5, moto_server)"
    )
    parser.add_argument(
        "--sdk-mib",
        default="",
        help="comma-separated file sizes in MiB (e.g. 10,1024): the SDK uploads one file of "
        "each and its peak RSS is printed (step 6)",
    )
    parser.add_argument("--sdk-parallel", type=int, default=4, help="parts in flight (step 6)")
    args = parser.parse_args()

    database = "PostgreSQL" if os.environ.get("DATABASE_URL") else "SQLite (DATABASE_URL unset)"
    sizes = [int(size) for size in args.sdk_mib.split(",") if size.strip()]
    # Room for the SDK's largest file (step 6) as well as the uploads of step 4.
    blob_limit = {"DVBENCH_MAX_BLOB_BYTES": str(max([2 * args.upload_mib, *sizes]) << 20)}
    with serve(args.workers, args.part_mib, args.upload_mib, blob_limit) as served:
        port, key, names, tmp, data_dir, arbiter = served
        # Warm every worker (imports, connections) before measuring.
        run_load(port, key, ["/api/v1/experiments/?page_size=50"], args.workers * 20, args.workers)

        print(
            f"DVBench API bench: gunicorn x{args.workers} workers over {database}, "
            f"{args.clients} concurrent clients, load generator on the same machine\n"
            f"  machine: {machine()}"
        )
        results = {}
        if not args.uploads_only:
            results["list (50 a page)"] = run_load(
                port, key, ["/api/v1/experiments/?page_size=50"], args.requests, args.clients
            )
            results["detail"] = run_load(
                port,
                key,
                [f"/api/v1/experiments/{name}/" for name in names],
                args.requests,
                args.clients,
            )
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
        copies, durable, uploads, floors = [], [], [], []
        for _ in range(2):
            floors.append(transfer_floor(source, args.part_mib << 20, data_dir))
        cpu_before = workers_cpu(arbiter)
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
        # The web workers' CPU time per GiB received: the copies above run in this
        # process, so the workers' counters hold only the uploads (and their requests).
        cpu_per_gib = (workers_cpu(arbiter) - cpu_before) / (2 * args.upload_mib / 1024)
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
        floor_rate = mib / min(floors)
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
            f"{upload_rate / durable_rate:.2f}\n"
            f"    floor:              {floor_rate:7.1f} MiB/s   upload/floor {upload_rate / floor_rate:.2f} "
            f"(the same bytes over raw TCP, received, hashed twice and synced as the worker "
            f"does; floor/copy {floor_rate / copy_rate:.2f})\n"
            f"    web workers' CPU:   {cpu_per_gib:7.2f} s per GiB uploaded "
            f"(sha256 alone: {1024 / hash_rate:.2f} s per GiB)"
        )
        for size in sizes:
            rss, seconds = sdk_upload_rss(served, size, args.part_mib, args.sdk_parallel)
            print(
                f"  SDK upload of one {size} MiB file ({args.part_mib} MiB parts, "
                f"{args.sdk_parallel} in flight): peak RSS {rss / 1024:7.1f} MiB, "
                f"{size / seconds:7.1f} MiB/s including the SDK's own hashing"
            )
    if not args.no_s3:
        for direct in (False, True):
            mode = {"DVBENCH_S3_DIRECT_UPLOADS": "1" if direct else "0"}
            with (
                s3_server() as (endpoint, s3_env),
                serve(args.workers, args.part_mib, args.upload_mib, s3_env | mode) as served,
            ):
                source = served.tmp / "blob.bin"
                with source.open("wb") as handle:
                    for _ in range(args.upload_mib):
                        handle.write(os.urandom(1 << 20))
                send = upload_direct if direct else upload
                # Warm the workers (imports, S3 clients) with one small upload first.
                warm = served.tmp / "warm.bin"
                warm.write_bytes(os.urandom(1 << 20))
                send(served.port, served.key, served.names[0], warm, args.part_mib << 20)
                cpu_before = workers_cpu(served.pid)
                s3_uploads = []
                for _ in range(2):
                    s3_uploads.append(
                        send(
                            served.port,
                            served.key,
                            served.names[0],
                            source,
                            args.part_mib * 1024 * 1024,
                        )
                    )
                    with source.open("r+b") as handle:
                        handle.write(os.urandom(32))
                s3_cpu = (workers_cpu(served.pid) - cpu_before) / (2 * args.upload_mib / 1024)
            s3_rate = args.upload_mib / min(s3_uploads)
            how = (
                "direct: parts PUT to presigned S3 URLs, S3 hashes the whole"
                if direct
                else "bytes through the web worker"
            )
            print(
                f"  upload {args.upload_mib} MiB in {args.part_mib} MiB parts to S3 "
                f"(moto_server at {endpoint}, {how}): {s3_rate:7.1f} MiB/s\n"
                f"    upload/copy {s3_rate / copy_rate:.2f}, S3/local disk "
                f"{s3_rate / upload_rate:.2f}, web workers' CPU {s3_cpu:7.2f} s per GiB uploaded"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
