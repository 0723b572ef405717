"""``zkdv calibrate`` on a TPU-trained run: exact on the TPU, the CPU's margins for information.

Trains the LM test recipe for ``STEPS`` steps on the TPU with its gradients kept as files
(a TPU's default keeps none), in a child process of its own, since one program at a
time may hold the chip; then runs ``python -m zkdv calibrate`` on the proof, whose own
children recompute the steps on the TPU (the run's environment) and on this machine's
CPU under each XLA instruction set (for information). Prints the command's output and
exits with its status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = int(os.environ.get("STEPS", "8"))


def train(path: Path) -> None:
    sys.path.insert(0, "tests/agent/zkdv/jax")
    import recipes

    import zkdv

    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.0),
            gradient_files="always",
        ),
        replay_snapshot_interval=recipes.INTERVAL,
    )
    proof.start(rolling_window=2, probe_ratio=0.25)
    recipes.RECIPES["lm"](proof, STEPS, 0)
    proof.close()


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "train":
        train(Path(sys.argv[2]))
        return 0
    path = Path(tempfile.mkdtemp()) / "lm"
    subprocess.run([sys.executable, __file__, "train", str(path)], check=True)
    command = [sys.executable, "-m", "zkdv", "calibrate", str(path), "--steps", str(STEPS)]
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
