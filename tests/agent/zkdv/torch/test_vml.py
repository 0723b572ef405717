"""MKL's vector math is initialised on one thread when zkdv.torch is imported.

Without it, the first VML call of a fresh process, split over two intra-op threads,
computes one thread's chunk about 2**18 float64 ulps from the true value in about one
process in eight (6 of 40 fresh processes on the 2-core development machine, Torch 2.13,
MKL 2024.2): the bits of that first ``sqrt`` or ``exp`` depend on a race, and the canonical
optimizer update, which rounds a float64 square root to float32, committed a parameter the
platform's replay then recomputed otherwise (zkdv.torch._vml).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

# Each child's first Torch computation: a float64 square root over two chunks of 2,048
# elements, one per intra-op thread, against numpy's correctly rounded one.
_FIRST_CALL = """
import sys
import numpy as np
import torch
import zkdv.torch

torch.set_num_threads(2)
values = np.random.default_rng(int(sys.argv[1])).random(4096) * 1e-7
roots = torch.from_numpy(values).sqrt().numpy()
ulps = np.abs(roots.view(np.int64) - np.sqrt(values).view(np.int64))
print(int(ulps.max()))
"""

#: One at a time: the race needs both intra-op threads on a core at once, which two
#: children side by side on two cores seldom get (0 of 24 then, 4 of 30 one at a time).
PROCESSES = 20


def _first_call_error(seed: int) -> int:
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL, str(seed)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.long  # twenty fresh Torch processes, about a minute
@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="Torch is built without MKL")
def test_the_first_parallel_vml_call_of_a_fresh_process_is_accurate() -> None:
    """20 fresh processes, each one whose first VML call runs on two threads: all within
    MKL's one ulp. Without the initialisation two or three would be off by 2**18 (none
    would with probability about 0.06)."""
    errors = [_first_call_error(seed) for seed in range(PROCESSES)]
    assert max(errors) <= 1, f"ulps off per fresh process: {errors}"
