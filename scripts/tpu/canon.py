"""The canonical update's digests on this device against the CPU's (AVX2) digests."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("tc", "tests/agent/zkdv/jax/test_canonical.py")
tc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tc)

buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    tc.worker("TPU")
tpu = json.loads([x for x in buf.getvalue().splitlines() if x.startswith("RESULT ")][-1][7:])
lines = Path("scripts/tpu/cpu_avx2.txt").read_text().splitlines()
cpu = json.loads([x for x in lines if x.startswith("RESULT ")][-1][7:])
same = {k: tpu["canonical"][k] == cpu["canonical"][k] for k in cpu["canonical"]}
print(
    "CANON",
    json.dumps(
        {
            "same_as_cpu": same,
            "plain_adamw_same": tpu["plain_adamw"] == cpu["plain_adamw"],
            "fma": [tpu["canonical_fma_matches_numpy"], tpu["plain_fma_matches_numpy"]],
        }
    ),
)
