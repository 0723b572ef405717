"""Canonical ops on the TPU against the same program on the CPU backend, and device roots per dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zkdv.jax.canonical import canonical

cpu, tpu = jax.devices("cpu")[0], jax.devices()[0]
Z = np.uint32(0)
rng = np.random.default_rng(0)
N = 1 << 16


def rand(n):
    m = rng.uniform(1, 2, n)
    e = rng.integers(-125, 127, n)
    x = np.ldexp(m, e).astype(np.float32)
    x[rng.random(n) < 0.5] *= -1
    k = rng.random(n) < 0.3
    x[k] = rng.standard_normal(k.sum()).astype(np.float32)
    return x


a, b = rand(N), rand(N)
c = np.arange(-40, 2000, 7, dtype=np.int32)
res = {}
cases = {
    "div": (lambda a, b: a / b, (a, b)),
    "sqrt": (lambda a: jnp.sqrt(jnp.abs(a)), (a,)),
    "mul": (lambda a, b: a * b, (a, b)),
    "add": (lambda a, b: a + b, (a, b)),
    "intpow": (lambda c: np.float32(0.999) ** c, (c,)),
    "sq": (lambda a: a**2, (a,)),
    "exp": (jnp.exp, (np.clip(a, -80, 80),)),
    "log": (jnp.log, (np.abs(a),)),
    "cos": (jnp.cos, (np.clip(a, -100, 100),)),
    "sum": (lambda a: jnp.sum(a), (a,)),
    "sum_rows": (lambda a: jnp.sum(a.reshape(256, -1), axis=1), (a,)),
    "bf16_mul": (lambda a, b: a.astype(jnp.bfloat16) * b.astype(jnp.bfloat16), (a, b)),
    "bf16_div": (lambda a, b: a.astype(jnp.bfloat16) / b.astype(jnp.bfloat16), (a, b)),
    "conv_u32": (
        lambda a: (jnp.abs(a) * 0 + np.float32(2.0**24) + jnp.abs(jnp.clip(a, -1000, 1000))).astype(
            jnp.uint32
        ),
        (a,),
    ),
}


def _bits(v):
    return v.view(np.uint32 if v.dtype.itemsize == 4 else np.uint16)


for name, (f, args) in cases.items():
    g = jax.jit(lambda z, *xs, f=f: canonical(f, z)(*xs))
    try:
        on_cpu = np.asarray(g(jax.device_put(Z, cpu), *[jax.device_put(x, cpu) for x in args]))
        on_tpu = np.asarray(g(jax.device_put(Z, tpu), *[jax.device_put(x, tpu) for x in args]))
        diff = _bits(on_cpu) != _bits(on_tpu)
        idx = np.flatnonzero(diff.ravel())[:4]
        ex = [
            [float(np.ravel(x)[i]) if np.ndim(x) else float(x) for x in args]
            + [float(on_cpu.ravel()[i]), float(on_tpu.ravel()[i])]
            for i in idx
        ]
        res[name] = [int(diff.sum()), int(np.isnan(on_tpu.astype(np.float32)).sum()), ex]
    except Exception as e:
        res[name] = repr(e)[:600]
    print(name, res[name], flush=True)
# device roots per dtype
try:
    import ml_dtypes

    from zkdv.device_merkle import roots_to_bytes
    from zkdv.jax.device_merkle import COMPACT, chunk_roots
    from zkdv.merkle import commit_state

    bad = []
    for dt in (
        "float32",
        "bfloat16",
        "float16",
        "int32",
        "uint8",
        "int8",
        "bool",
        "uint32",
        "int16",
    ):
        x = (rng.standard_normal(1000) * 100).astype(np.float32)
        arr = (
            x.astype(ml_dtypes.bfloat16)
            if dt == "bfloat16"
            else (x > 0 if dt == "bool" else x.astype(dt))
        )
        expected = commit_state([("x", arr)], 64)
        roots = roots_to_bytes(
            jax.device_get(chunk_roots([jnp.asarray(arr)], 64, schedule=COMPACT))
        )
        if roots != list(expected.chunk_roots):
            bad.append(dt)
    with jax.enable_x64(True):
        for dt in ("float64", "int64", "uint64"):
            arr = (rng.standard_normal(1000) * 100).astype(dt)
            expected = commit_state([("x", arr)], 64)
            roots = roots_to_bytes(
                jax.device_get(chunk_roots([jnp.asarray(arr)], 64, schedule=COMPACT))
            )
            if roots != list(expected.chunk_roots):
                bad.append(dt)
    print("MERKLE_BAD", bad)
except Exception as e:
    print("MERKLE_ERR", repr(e)[:800])
