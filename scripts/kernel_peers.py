"""The peers `bench_kernels.py --peers` measures beside our kernels, on the same inputs.

Each function takes the JAX inputs of one of our benchmarks and our output on them, runs every
peer implementation it knows, checks the peer's output against ours (relative L2 error) and
reports a row through `report(op, impl, seconds, shape=..., **rates)`. A peer that is not
installed or fails is printed as FAILED and skipped: the benchmark goes on.

  attention   tokamax 0.0.17 `dot_product_attention` (implementations mosaic, cudnn, triton),
              causal, GQA, contiguous K/V; JAX's own Mosaic GPU example kernel
              (`attention_mgpu`); torch flash SDPA (random inputs of the same shape)
  ragged_dot  tokamax `ragged_dot` (its default implementation choice, and each one by name)
  scan        fla-core 0.6.0 `chunk_simple_gla` (Triton): the same recurrence with
              q = C, k = B (per head), v = dt x, g = dt a, scale 1, start state h0^T
  conv        fla-core `causal_conv1d` (Triton backend), silu, zero start state
  copy        torch `y = x + 1` over 2 GiB of bf16 (a second copy ceiling)

The GPU machine has no network (and Python 3.12): download the pinned wheels here, carry the
folder, install them there into a folder on PYTHONPATH (tokamax imports `xprof.cli`, which
xprof has from 2.23 on, a manylinux_2_27 wheel; --no-deps keeps pip off the network):

    pip download --no-deps --only-binary=:all: --python-version 3.12 -d out/peerwheels \
        --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 --platform any \
        tokamax==0.0.17 einshape qwix immutabledict pydantic pydantic-core annotated-types \
        typing-inspection tensorboardx 'xprof>=2.23' jaxtyping wadler-lindig \
        typing-extensions absl-py fla-core==0.6.0 einops
    # on the GPU machine (run with carry=["out/peerwheels"]):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers \
        out/peerwheels/*.whl
    PYTHONPATH=$PWD:/tmp/peers python scripts/bench_kernels.py --peers --json OUT.json
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from kernel_timing import rel_err, timed_torch

Report = Callable[..., None]


def _failed(what: str, exc: Exception) -> None:
    print(f"{what}: FAILED {type(exc).__name__}: {exc}"[:400], flush=True)


def attention(q, k, v, ours, timed: Callable, report: Report, iters: int) -> None:
    """tokamax causal attention on q [1, T, Hq, D], k / v [1, T, Hkv, D] (bf16); `ours` is our
    kernel's output for the same tokens, [1, T, Hq, D]."""
    t, nq, hd = q.shape[1], q.shape[2], q.shape[3]
    flops = 4 * t * t / 2 * nq * hd
    jax_mosaic(q, k, v, ours, flops, timed, report, iters)
    try:
        import tokamax
    except ImportError as exc:
        return _failed("tokamax attention", exc)
    for impl in ("mosaic", "cudnn", "triton"):
        fn = jax.jit(
            functools.partial(tokamax.dot_product_attention, is_causal=True, implementation=impl)
        )
        try:
            err = rel_err(fn(q, k, v), ours)
            sec = timed(fn, q, k, v, iters=iters)
            report("prefill attn", f"tokamax {impl} nobias", sec, shape=list(q.shape),
                   TFLOPs=flops / sec / 1e12, rel_err=err)  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (report and go on)
            _failed(f"tokamax attention {impl}", exc)


def jax_mosaic(q, k, v, ours, flops: float, timed: Callable, report: Report, iters: int) -> None:
    """JAX's own Pallas Mosaic GPU attention example (`jax.experimental.pallas.ops.gpu.
    attention_mgpu`: FA3-style, TMA loads, two compute warpgroups and a memory one; causal and
    GQA, no bias), which scores unscaled: q goes in times 1/sqrt(d). Blocks of 64 queries per
    warpgroup and 64 or 128 keys, two KV buffers in flight; float16 only (its shared-memory
    buffers are float16)."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
    except ImportError as exc:
        return _failed("jax attention_mgpu", exc)
    # its buffers are float16: it runs on float16 copies of the inputs
    scaled = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(jnp.float16)
    k, v = k.astype(jnp.float16), v.astype(jnp.float16)
    for block_kv in (128, 64):
        config = mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2,
                                   causal=True)  # fmt: skip
        fn = jax.jit(functools.partial(mgpu.attention, config=config))
        try:
            err = rel_err(fn(scaled, k, v), ours)
            sec = timed(fn, scaled, k, v, iters=iters)
            report("prefill attn", f"jax attention_mgpu kv{block_kv} nobias", sec,
                   shape=list(q.shape), TFLOPs=flops / sec / 1e12, rel_err=err)  # fmt: skip
        except Exception as exc:  # noqa: BLE001  (report and go on)
            _failed(f"jax attention_mgpu kv{block_kv}", exc)


def torch_flash(t: int, nq: int, nkv: int, hd: int, report: Report, iters: int) -> float:
    """TFLOP/s of torch SDPA (flash backend) without bias, causal, on q [1, nq, t, hd] and
    k / v with nkv heads (GQA, and the K/V expanded to nq heads); the best, 0 without CUDA."""
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return 0.0
    if not torch.cuda.is_available():
        return 0.0
    q = torch.randn(1, nq, t, hd, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, nkv, t, hd, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, nkv, t, hd, device="cuda", dtype=torch.bfloat16)
    flops = 4 * t * t / 2 * nq * hd
    best = 0.0
    for label, gqa in (("gqa", True), ("expanded kv", False)):
        kk = k if gqa else k.repeat_interleave(nq // nkv, 1)
        vv = v if gqa else v.repeat_interleave(nq // nkv, 1)
        fn = functools.partial(F.scaled_dot_product_attention, q, kk, vv, is_causal=True,
                               enable_gqa=gqa)  # fmt: skip
        try:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                sec = timed_torch(fn, iters)
            report("prefill attn", f"torch flash SDPA {label}", sec, shape=[1, t, nq, hd],
                   TFLOPs=flops / sec / 1e12)  # fmt: skip
            best = max(best, flops / sec / 1e12)
        except Exception as exc:  # noqa: BLE001
            _failed(f"torch flash {label}", exc)
    return best


def ragged_dot(x, w, sizes, ours, timed: Callable, report: Report, iters: int) -> None:
    """tokamax `ragged_dot` of x [M, K] by w [G, K, N] in groups of `sizes` rows."""
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[2]
    try:
        import tokamax
    except ImportError as exc:
        return _failed("tokamax ragged_dot", exc)
    for impl in (None, "mosaic", "triton"):
        fn = jax.jit(functools.partial(tokamax.ragged_dot, implementation=impl))
        try:
            err = rel_err(fn(x, w, sizes), ours)
            sec = timed(fn, x, w, sizes, iters=iters)
            report("grouped matmul", f"tokamax ragged_dot {impl or 'default'}", sec,
                   shape=[*x.shape, w.shape[2], w.shape[0]], TFLOPs=flops / sec / 1e12,
                   rel_err=err)  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            _failed(f"tokamax ragged_dot {impl}", exc)


def scan(x, dt, a, b, c, d, h0, ours_y, report: Report, iters: int) -> None:
    """fla-core `chunk_simple_gla` on our Mamba2 scan's inputs (x [B, T, H, P], dt [B, T, H],
    a [H], b / c [B, T, 1, N], D [H], h0 [B, H, P, N] float32). Mamba2's y is the gated linear
    attention output plus D x, so the check compares `ours_y - D x` with fla's."""
    try:
        import torch
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:
        return _failed("fla chunk_simple_gla", exc)
    bsz, t, nh, _ = x.shape
    as_torch = lambda z: torch.from_dlpack(jnp.asarray(z))  # noqa: E731
    q = as_torch(jnp.broadcast_to(c, (*c.shape[:2], nh, c.shape[3])).astype(jnp.bfloat16))
    k = as_torch(jnp.broadcast_to(b, (*b.shape[:2], nh, b.shape[3])).astype(jnp.bfloat16))
    v = as_torch((x.astype(jnp.float32) * dt.astype(jnp.float32)[..., None]).astype(x.dtype))
    g = as_torch(dt.astype(jnp.float32) * a[None, None, :])
    state = as_torch(jnp.swapaxes(h0, 2, 3))  # fla's state is [B, H, K = N, V = P]

    def run():
        return chunk_simple_gla(q, k, v, g, scale=1.0, initial_state=state,
                                output_final_state=True)  # fmt: skip

    try:
        with torch.no_grad():
            y, _ = run()
            want = ours_y.astype(jnp.float32) - d[None, None, :, None] * x.astype(jnp.float32)
            err = rel_err(y, want)
            sec = timed_torch(run, iters)
        report("mamba2 scan", f"fla chunk_simple_gla B{bsz} T{t}", sec, shape=list(x.shape),
               tok_per_s=bsz * t / sec, rel_err=err)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        _failed("fla chunk_simple_gla", exc)


def conv(x, w, bias, ours_zero_state, bandwidth: float, report: Report, iters: int) -> None:
    """fla-core `causal_conv1d` (Triton) on x [B, T, C] with weight [C, W], silu, from a zero
    state; `ours_zero_state` is our output from a zero state."""
    try:
        import torch
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError as exc:
        return _failed("fla causal_conv1d", exc)
    tx, tw, tb = (torch.from_dlpack(jnp.asarray(z)) for z in (x, w, bias))
    moved = 2 * x.nbytes

    def run():
        return causal_conv1d(tx, weight=tw, bias=tb, activation="silu", backend="triton")

    try:
        with torch.no_grad():
            y = run()
            y = y[0] if isinstance(y, tuple) else y
            err = rel_err(y, ours_zero_state)
            sec = timed_torch(run, iters)
        report("sconv", "fla causal_conv1d triton", sec, shape=list(x.shape),
               GBps=moved / sec / 1e9, of_bandwidth=moved / sec / bandwidth,
               rel_err=err)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        _failed("fla causal_conv1d", exc)


def torch_copy(report: Report, iters: int, nbytes: int = 2**31) -> float:
    """torch `y = x + 1` over `nbytes` of bf16: bytes read + written per second (0 without a
    CUDA torch)."""
    try:
        import torch
    except ImportError:
        return 0.0
    if not torch.cuda.is_available():
        return 0.0
    sec = _copy_seconds(torch, nbytes, iters)
    torch.cuda.empty_cache()  # the 2 GiB go back to the device for JAX
    report("ceiling", f"torch copy y = x + 1 ({nbytes / 2**30:g} GiB)", sec, shape=[nbytes // 2],
           GBps=2 * nbytes / sec / 1e9)  # fmt: skip
    return 2 * nbytes / sec


def _copy_seconds(torch, nbytes: int, iters: int) -> float:
    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    return timed_torch(lambda: x + 1, iters)
