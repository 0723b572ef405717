"""Digits on the TPU: plain jax.jit against ZKDV (host and device paths), verify, replay."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, "examples/jax")
import digits as d_mod
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import zkdv
from zkdv.verify import verify_transcript

OUT = Path(os.environ.get("OUT", "/tmp"))
res = {"device": jax.devices()[0].device_kind}
rows, held = d_mod.digit_rows()
STEPS = int(os.environ.get("STEPS", "60"))


def accuracy(params):
    logits = d_mod.DigitClassifier().apply({"params": params}, jnp.asarray(held[:, : d_mod.PIXELS]))
    return float((jnp.argmax(logits, axis=1) == held[:, d_mod.PIXELS]).mean())


def plain():
    model = d_mod.DigitClassifier()
    params = model.init(jax.random.key(0), jnp.zeros((1, d_mod.PIXELS), dtype=jnp.uint32))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

    @jax.jit
    def step(state, batch):
        pixels, labels = batch[:, : d_mod.PIXELS], batch[:, d_mod.PIXELS].astype(jnp.int32)

        def loss(p):
            return optax.softmax_cross_entropy_with_integer_labels(
                state.apply_fn({"params": p}, pixels), labels
            ).mean()

        value, g = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=g), value

    losses = []
    for b in d_mod.batches(rows, STEPS):
        state, value = step(state, jnp.asarray(b))
        losses.append(float(value))
    return state.params, losses


def zk(commitments):
    path = Path(tempfile.mkdtemp()) / f"proof-{commitments}"
    proof = zkdv.jax.ZKDV(
        path,
        zkdv.ZKDVConfig(
            sampling_policy=zkdv.SamplingPolicy(update_check_probability=0.1),
            commitments=commitments,
        ),
        replay_snapshot_interval=10,
    )
    proof.start(rolling_window=4, probe_ratio=0.25)
    t = time.time()
    state = d_mod.train(proof, rows, STEPS)
    proof.close()
    return path, state.params, time.time() - t


t = time.time()
pp, losses = plain()
res["plain"] = {
    "accuracy": accuracy(pp),
    "loss_first_last": [losses[0], losses[-1]],
    "s": time.time() - t,
}
paths = {}
for c in ("host", "device"):
    try:
        path, params, s = zk(c)
        paths[c] = path
        diff = max(
            float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(pp), strict=True)
        )
        r = {"accuracy": accuracy(params), "s": s, "max_param_diff_vs_plain": diff}
        try:
            tr = verify_transcript(path)
            r["verify"] = "ok"
            r["env"] = {
                k: tr.root["env"].get(k)
                for k in (
                    "jax_platform",
                    "devices",
                    "jaxlib",
                    "xla_flags",
                    "matmul_precision",
                    "x64",
                )
            }
        except Exception as e:
            r["verify"] = repr(e)[:800]
        r["records_sha256"] = hashlib.sha256((path / "records.cborl").read_bytes()).hexdigest()
        res[c] = r
    except Exception:
        res[c] = {"error": traceback.format_exc()[-2500:]}
    print(json.dumps(res, indent=1), flush=True)
if "host" in paths:
    try:
        import provers.jax_replay as pj
        from zkdv.jax.replay import load_transition

        t = time.time()
        tr = load_transition(paths["host"])
        verdicts = {}
        for step in (0, 9, 10, 37, STEPS - 1):
            v = pj.verify_challenge(paths["host"], step, transition=tr)
            verdicts[step] = [v.ok, v.reason, (v.message or "")[:300]]
        res["replay_host_proof"] = {
            "verdicts": verdicts,
            "exact_env": pj.exact_environment(verify_transcript(paths["host"]).root),
            "s": time.time() - t,
        }
    except Exception:
        res["replay_host_proof"] = {"error": traceback.format_exc()[-2500:]}
print(json.dumps(res, indent=1))
(OUT / "digits.json").write_text(json.dumps(res, indent=1))
