"""Web and Celery workers run under memory limits (issue 59, bounded work per request).

Each limit is checked in a child process, which it really caps: an allocation past it is a
``MemoryError`` there, not in the test runner.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: After the limit is set: the limit in MiB, then whether 1 GiB more could be allocated.
PROBE = """
import resource
soft, _ = resource.getrlimit(resource.RLIMIT_AS)
print(soft // (1024 * 1024))
try:
    block = bytearray(soft)  # as much again as the whole address space allowed
except MemoryError:
    print("MemoryError")
else:
    print("allocated")
"""


def _run(code: str, **env: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_each_web_worker_is_capped_after_it_forks() -> None:
    hook = (
        "import runpy; conf = runpy.run_path('platform/gunicorn.conf.py'); "
        "conf['post_fork'](None, None)\n"
    )
    assert _run(hook + PROBE, DVBENCH_WEB_MEMORY_LIMIT_MB="1024") == ["1024", "MemoryError"]
    # 0 turns it off: the process keeps what it had (unlimited here).
    unlimited = _run(hook + "import resource; print(resource.getrlimit(resource.RLIMIT_AS)[0])",
                     DVBENCH_WEB_MEMORY_LIMIT_MB="0")  # fmt: skip
    assert unlimited == [str(_current_limit())]


def test_each_celery_pool_child_is_capped_as_it_starts(tmp_path: Path) -> None:
    start = (
        "import os, django; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings'; "
        "django.setup()\n"
        "from celery.signals import worker_process_init\n"
        "import config.celery_app\n"
        "worker_process_init.send(sender=None)\n"
    )
    limited = _run(
        start + PROBE, DVBENCH_WORKER_MEMORY_LIMIT_MB="1536", DVBENCH_DATA_DIR=str(tmp_path)
    )
    assert limited == ["1536", "MemoryError"]


def _current_limit() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_AS)[0]
