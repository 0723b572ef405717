"""The three recipes on this device under ZKDV: train, verify, replay some steps; paths compared."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, "tests/agent/zkdv/jax")
import recipes

import zkdv
from zkdv.verify import verify_transcript

OUT = Path(os.environ.get("OUT", "/tmp"))
paths_wanted = os.environ.get("PATHS", "host,device").split(",")
names = os.environ.get("RECIPES", "digits,batchstats,lm").split(",")
STEPS = int(os.environ.get("STEPS", "24"))
res = {}
for name in names:
    for c in paths_wanted:
        key = f"{name}/{c}"
        try:
            path = Path(tempfile.mkdtemp()) / key.replace("/", "-")
            proof = zkdv.jax.ZKDV(
                path,
                zkdv.ZKDVConfig(
                    sampling_policy=zkdv.SamplingPolicy.DEBUGCheckEvery(5), commitments=c
                ),
                replay_snapshot_interval=recipes.INTERVAL,
            )
            proof.start(rolling_window=2, probe_ratio=0.25)
            t = time.time()
            recipes.RECIPES[name](proof, STEPS, 0)
            proof.close()
            r = {"train_s": round(time.time() - t, 1)}
            tr = verify_transcript(path)
            r["verify"] = "ok"
            r["records"] = hashlib.sha256((path / "records.cborl").read_bytes()).hexdigest()[:16]
            import provers.jax_replay as pj
            from zkdv.jax.replay import load_transition

            t = time.time()
            transition = load_transition(path)
            steps = sorted({0, 3, 4, 7, STEPS // 2, STEPS - 1})
            verdicts = [pj.verify_challenge(path, s, transition=transition) for s in steps]
            r["replay"] = {
                "exact_env": pj.exact_environment(tr.root),
                "ok": sum(v.ok for v in verdicts),
                "of": len(verdicts),
                "bad": [
                    [s, v.reason, (v.message or "")[:200]]
                    for s, v in zip(steps, verdicts, strict=True)
                    if not v.ok
                ][:2],
                "s": round(time.time() - t, 1),
            }
            res[key] = r
        except Exception:
            res[key] = {"error": traceback.format_exc()[-1500:]}
        print(key, json.dumps(res[key]), flush=True)
for name in names:
    recs = {res.get(f"{name}/{c}", {}).get("records") for c in paths_wanted}
    res[f"{name}/identical"] = len(recs) == 1 and None not in recs
print(json.dumps(res, indent=1))
(OUT / "recipes.json").write_text(json.dumps(res, indent=1))
