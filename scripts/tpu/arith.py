"""TPU arithmetic facts the canonical rules rely on, against numpy (IEEE, CPU)."""

from __future__ import annotations

import json
import traceback

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

out = {}
d = jax.devices()[0]
out["device"] = [d.platform, d.device_kind, jax.__version__]
try:
    import importlib.metadata as md

    out["libtpu"] = md.version("libtpu")
except Exception as e:
    out["libtpu"] = repr(e)
try:
    out["platform_version"] = jax.extend.backend.get_backend().platform_version
except Exception as e:
    out["platform_version"] = repr(e)

rng = np.random.default_rng(0)
N = 1 << 20


def rand_f32(n):
    # wide exponent spread incl. near-subnormal and near-overflow, plus ties-prone values
    m = rng.uniform(1, 2, n).astype(np.float32)
    e = rng.integers(-130, 128, n)
    x = np.ldexp(m.astype(np.float64), e).astype(np.float32)
    x[rng.random(n) < 0.5] *= -1
    small = rng.random(n) < 0.3
    x[small] = (rng.standard_normal(small.sum()) * 10.0 ** rng.integers(-3, 3, small.sum())).astype(
        np.float32
    )
    return x


a, b, c = rand_f32(N), rand_f32(N), rand_f32(N)
# flush subnormal inputs (canonical fences do)
tiny = np.float32(2.0**-126)


def flush(x):
    x = x.copy()
    m = np.abs(x) <= tiny
    x[m] = np.copysign(np.float32(0), x[m])
    return x


a, b, c = flush(a), flush(b), flush(c)

zero = jnp.uint32(0)


def fence(x, z):
    bits = lax.bitcast_convert_type(x, jnp.uint32) | z
    mag = bits & jnp.uint32(0x7FFFFFFF)
    flushed = bits & jnp.uint32(0x80000000)
    return lax.bitcast_convert_type(
        jnp.where(mag <= jnp.uint32(0x00800000), flushed, bits), jnp.float32
    )


@jax.jit
def ops(z, a, b, c):
    return dict(
        add=fence(a + b, z),
        sub=fence(a - b, z),
        mul=fence(a * b, z),
        fma_fenced=fence(fence(a * b, z) + c, z),
        fma_plain=a * b + c,
        div=a / b,
        sqrt=jnp.sqrt(jnp.abs(a)),
        rsqrt=lax.rsqrt(jnp.abs(a)),
        to_bf16=a.astype(jnp.bfloat16),
        to_f16=a.astype(jnp.float16),
        raw_mul=a * b,
        raw_add=a + b,
    )


r = {k: np.asarray(v) for k, v in ops(zero, a, b, c).items()}
with np.errstate(all="ignore"):
    ref = dict(
        add=flush(a + b),
        sub=flush(a - b),
        mul=flush(a * b),
        fma_fenced=flush(flush(a * b) + c),
        fma_plain=(a * b + c),
        div=(a / b),
        sqrt=np.sqrt(np.abs(a)),
        rsqrt=(1 / np.sqrt(np.abs(a).astype(np.float64))).astype(np.float32),
        to_bf16=a.astype(ml_dtypes.bfloat16),
        to_f16=a.astype(np.float16),
        raw_mul=a * b,
        raw_add=a + b,
    )


def bits_diff(x, y):
    xb = x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)
    yb = y.view(np.uint32 if y.dtype.itemsize == 4 else np.uint16)
    nan = np.isnan(x.astype(np.float32)) & np.isnan(y.astype(np.float32))
    diff = (xb != yb) & ~nan
    return int(diff.sum()), diff


res = {}
for k in ref:
    n, diff = bits_diff(r[k], ref[k])
    ex = []
    for i in np.flatnonzero(diff)[:3]:
        ex.append([float(a[i]), float(b[i]), float(r[k][i]), float(ref[k][i])])
    res[k] = [n, ex]
out[f"ops_mismatch_of_{N}"] = res


# signed flush: negative tiny product
@jax.jit
def tinyops(z, x, y):
    return x * y, fence(x * y, z), x + y


x = jnp.array([-1e-30, 1e-30, -1e-20, -(2.0**-126)], jnp.float32)
y = jnp.array([1e-10, -1e-10, 1e-20, 0.5], jnp.float32)
p, pf, s = tinyops(zero, x, y)
out["tiny_products_bits"] = [hex(int(v)) for v in np.asarray(p).view(np.uint32)]
out["tiny_fenced_bits"] = [hex(int(v)) for v in np.asarray(pf).view(np.uint32)]


# integer ops
@jax.jit
def intops(u, s):
    return dict(
        shl=u << s,
        shr=u >> s,
        sar=lax.shift_right_arithmetic(u.astype(jnp.int32), s.astype(jnp.int32)),
        mul=u * u,
        sub=u - s,
        lt=(u < s),
    )


u = jnp.array([0xFFFFFFFF, 0x80000000, 123456789, 1, 0xDEADBEEF], jnp.uint32)
s = jnp.array([0, 31, 32, 33, 7], jnp.uint32)
io = {k: [int(v) for v in np.asarray(w).astype(np.int64)] for k, w in intops(u, s).items()}
out["intops"] = io

# int8 x int8 -> int32 matmul exactness
A = rng.integers(-128, 128, (512, 4096)).astype(np.int8)
B = rng.integers(-128, 128, (4096, 256)).astype(np.int8)
P = jax.jit(
    lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
)(A, B)
Pref = A.astype(np.int64) @ B.astype(np.int64)
out["int8_matmul_mismatch"] = int((np.asarray(P).astype(np.int64) != Pref).sum())
# bf16 exact-int matmul with f32 accumulation on small ints (sums < 2^24)
A2 = rng.integers(-16, 16, (256, 1024)).astype(np.float32)
B2 = rng.integers(-16, 16, (1024, 128)).astype(np.float32)
P2 = jax.jit(
    lambda x, y: jnp.matmul(
        x.astype(jnp.bfloat16), y.astype(jnp.bfloat16), preferred_element_type=jnp.float32
    )
)(A2, B2)
out["bf16_int_matmul_mismatch"] = int((np.asarray(P2) != A2 @ B2).sum())
P3 = jax.jit(lambda x, y: jnp.matmul(x, y, precision=lax.Precision.HIGHEST))(A2 * 1001, B2 * 999)
out["f32_highest_int_matmul_mismatch"] = int(
    (
        np.asarray(P3).astype(np.float64)
        != (A2.astype(np.float64) * 1001) @ (B2.astype(np.float64) * 999)
    ).sum()
)

# current zkdv pieces
try:
    out["device_probes_import"] = "ok"
except Exception:
    out["device_probes_import"] = traceback.format_exc()[-500:]
print(json.dumps(out, indent=1))
