"""Run 129's probe (session 50): second derivatives (a Hessian-vector product in q) of
`chunkscan.attention` on this machine's default device, by route: a short call (to
`mx.fast`, bf16 on its float32 upcast), a long call with the CUDA kernels, and a long
call on the portable path (`kernels=False`), each against `chunkscan.naive_attention`
in float32 on the same inputs. Prints one line per case: the max error relative to the
oracle's largest value, or the error raised."""

import mlx.core as mx

import chunkscan
from chunkscan.ops.attention import blocked

B, H, D = 1, 4, 64


def hvp(fn, q, k, v, w, u):
    def loss(q):
        return mx.sum(fn(q, k, v).astype(mx.float32) * w)

    return mx.grad(lambda q: mx.sum(mx.grad(loss)(q).astype(mx.float32) * u))(q)


def case(name, T, dtype, **kw):
    keys = mx.random.split(mx.random.key(1), 5)
    q, k, v, w, u = (mx.random.normal((B, H, T, D), key=s) for s in keys)
    scale = D**-0.5

    def ours(q, k, v):
        return chunkscan.attention(q, k, v, scale=scale, mask="causal", **kw)

    def oracle(q, k, v):
        return chunkscan.naive_attention(q, k, v, scale=scale, mask="causal")

    try:
        got = hvp(ours, q.astype(dtype), k.astype(dtype), v.astype(dtype), w, u)
        mx.eval(got)
    except Exception as e:  # noqa: BLE001 (the probe reports what was raised)
        print(f"{name:32s} T={T:5d} {dtype}: raised {type(e).__name__}: {str(e)[:160]}")
        return
    up = [x.astype(dtype).astype(mx.float32) for x in (q, k, v)]
    want = hvp(oracle, *up, w, u)
    err = mx.max(mx.abs(got.astype(mx.float32) - want)) / mx.max(mx.abs(want))
    print(f"{name:32s} T={T:5d} {dtype}: max error / max |oracle| {err.item():.2e}")


print("device:", mx.default_device(), "FAST_MAX_SCORES", blocked.FAST_MAX_SCORES)
for dtype in (mx.float32, mx.bfloat16):
    case("short (mx.fast)", 256, dtype)
    case("long, kernels (default)", 2048, dtype)
    case("long, portable (kernels=False)", 2048, dtype, kernels=False)
