"""The op protocol: one signature per op, and a registry keyed by (op, backend).

Models call every numerically interesting op through an `Ops` table resolved once per engine
(`load_ops("xla")`), so that a backend can be swapped without touching the model. `xla` (plain
jax.numpy) is always present and is the ground truth; other backends must match it within the
tolerances stated in their tests.

Dimension letters used in the shapes below:
  B batch rows, T tokens per row, S cache length, N query heads, K kv heads, H head dim,
  Pg cache pages, C conv channels, W conv width, Hs ssm heads, P ssm head dim, G ssm groups,
  Ns ssm state dim, E experts, M routed token slots (tokens * top_k).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable
from typing import Protocol

import jax

from backends.fp8 import Fp8GroupedMatmul, Fp8Linear
from backends.fused import Linear, Mamba2DecodePaged
from backends.nvfp4 import Nvfp4GroupedMatmul

Array = jax.Array


class BackendError(RuntimeError):
    """A backend is unknown, lacks an op, or does not support this hardware."""


class RmsNorm(Protocol):
    def __call__(self, x: Array, weight: Array, eps: float) -> Array:
        """RMSNorm: `weight * x / sqrt(mean(x^2) + eps)`, statistics in float32.

        Args:
          x: [..., D]. weight: [D].
        Returns: [..., D] in x's dtype.
        """


class GatedRmsNorm(Protocol):
    def __call__(self, y: Array, z: Array, weight: Array, eps: float, group_size: int) -> Array:
        """Gated group RMSNorm (gate first): `g = y * silu(z)`, normalised per group of
        `group_size` channels, times `weight`. Float32 inside.

        Args:
          y, z: [..., I]. weight: [I]. I must be a multiple of group_size.
        Returns: [..., I] in y's dtype.
        """


STATE_LAYOUTS = ("DS", "SD")  # conv state: channel-major [B, C, W-1] or token-major [B, W-1, C]


def conv_state_to_ds(state: Array, layout: str) -> Array:
    """A conv state in `layout` as DS ([B, C, W-1]), the layout the kernels compute in; its own
    inverse (SD <-> DS is a swap of the last two axes)."""
    if layout not in STATE_LAYOUTS:
        raise ValueError(f"conv state_layout must be one of {STATE_LAYOUTS}, got {layout!r}")
    return state if layout == "DS" else jax.numpy.swapaxes(state, 1, 2)


class CausalConv1d(Protocol):
    def __call__(
        self,
        x: Array,
        state: Array,
        weight: Array,
        bias: Array | None,
        lengths: Array,
        activation: str | None,
        state_layout: str = "DS",
    ) -> tuple[Array, Array]:
        """Causal depthwise conv over a chunk that continues from `state`.

        `y[t, c] = bias[c] + sum_k weight[c, k] * u[t - (W-1) + k, c]`, where u is the state's
        W-1 earlier inputs followed by x; then the activation ("silu" or None).

        Args:
          x: [B, T, C]; rows are valid for their first `lengths[b]` tokens (the rest is padding).
          state: [B, C, W-1], the W-1 raw inputs before x (DS layout: channel-major), or
            [B, W-1, C] with `state_layout="SD"`; new_state comes back in the same layout.
          weight: [C, W] (tap W-1 multiplies the current token). bias: [C] or None.
          lengths: [B] int32, valid tokens per row (0 <= lengths <= T).
        Returns:
          y: [B, T, C] (padding positions hold garbage), new_state: [B, C, W-1], the last W-1
          valid raw inputs of each row.
        """


class CausalConv1dStep(Protocol):
    def __call__(
        self,
        x: Array,
        state: Array,
        weight: Array,
        bias: Array | None,
        activation: str | None,
        state_layout: str = "DS",
    ) -> tuple[Array, Array]:
        """One-token causal conv update. x: [B, C]; state: [B, C, W-1] (or [B, W-1, C] with
        `state_layout="SD"`, also for the new state).

        Returns: y [B, C], new_state [B, C, W-1] (state shifted left by one, x appended).
        """


class Mamba2Scan(Protocol):
    def __call__(
        self,
        x: Array,
        dt: Array,
        a: Array,
        b: Array,
        c: Array,
        d: Array,
        initial_state: Array,
        chunk_size: int,
    ) -> tuple[Array, Array]:
        """Chunked SSD scan (Mamba2) over a chunk of tokens from an initial state.

        Per head h (group g(h) = h // (Hs/G)) and token t:
          `s_t = exp(dt_t * a_h) * s_{t-1} + dt_t * (x_t outer b_t)`   (s: [P, Ns])
          `y_t = s_t . c_t + d_h * x_t`
        Padding tokens must carry dt = 0 and x = 0, which leaves the state unchanged.

        Args:
          x: [B, T, Hs, P]. dt: [B, T, Hs] (after softplus; no clamp). a: [Hs] (negative).
          b, c: [B, T, G, Ns]. d: [Hs]. initial_state: [B, Hs, P, Ns] float32.
          chunk_size: the SSD block length (the result does not depend on it beyond rounding).
        Returns:
          y: [B, T, Hs, P] in x's dtype; final_state: [B, Hs, P, Ns] float32.
        """


class Mamba2Step(Protocol):
    def __call__(
        self, state: Array, x: Array, dt: Array, a: Array, b: Array, c: Array, d: Array
    ) -> tuple[Array, Array]:
        """One-token Mamba2 state update (the recurrence of `Mamba2Scan` for T = 1).

        Args: state [B, Hs, P, Ns] float32; x [B, Hs, P]; dt [B, Hs]; a, d [Hs]; b, c [B, G, Ns].
        Returns: y [B, Hs, P] in x's dtype; new_state [B, Hs, P, Ns] float32.
        """


class Mamba2StepPaged(Protocol):
    def __call__(
        self,
        region: Array,
        pages: Array,
        fresh: Array,
        x: Array,
        dt: Array,
        a: Array,
        b: Array,
        c: Array,
        d: Array,
        state_offset: int,
        page_rows: int,
    ) -> tuple[Array, Array]:
        """`Mamba2Step` on states that live in a cache region, updated where they lie.

        Row i's state is float32 [Hs, P, Ns], contiguous, at word `state_offset` of page
        `pages[i]` (page p: region rows [p * page_rows, (p + 1) * page_rows)); a row with
        `fresh[i]` starts from zeros (its page is reused), and a row on page 0 (the null page:
        padding) is computed but its state is not stored.

        Args: region words (int32) [1, R, Wd] (one rank's shard; Wd words a row); pages, fresh
          [B] int32; x [B, Hs, P]; dt [B, Hs]; a, d [Hs]; b, c [B, G, Ns].
        Returns: y [B, Hs, P] in x's dtype; the region with the new states (the caller donates
          it: a backend may write it in place).
        """


@dataclasses.dataclass(frozen=True)
class RelativeBias:
    """Bucketing of query-key distances `d = p_q - p_k >= 0` for a learned relative-position
    bias: distances below `num_exact` get a bucket each; from `num_exact` on, the remaining
    buckets start at log-spaced distances up to `max_distance`; the last bucket holds every
    distance from its start on. Bucket starts are integers fixed here (no float rounding in the
    kernels): `bucket(d) = #{b : boundaries[b] <= d} - 1`."""

    num_buckets: int
    num_exact: int
    max_distance: int

    def __post_init__(self) -> None:
        if not 0 < self.num_exact <= self.num_buckets:
            raise ValueError(f"need 0 < num_exact ({self.num_exact}) <= num_buckets")
        if self.num_exact < self.num_buckets and self.max_distance <= self.num_exact:
            raise ValueError(f"max_distance ({self.max_distance}) must exceed num_exact")

    def boundaries(self) -> tuple[int, ...]:
        """The first distance of each bucket (`num_buckets` strictly increasing ints from 0)."""
        starts = list(range(self.num_exact))
        log_buckets = self.num_buckets - self.num_exact
        ratio = self.max_distance / self.num_exact
        for i in range(log_buckets):
            start = int(round(self.num_exact * ratio ** (i / max(log_buckets - 1, 1))))
            starts.append(max(start, starts[-1] + 1))
        return tuple(starts)

    def bucket(self, distance: Array) -> Array:
        """Bucket of each distance (negative distances, never visible, map to bucket 0)."""
        bounds = jax.numpy.asarray(self.boundaries(), jax.numpy.int32)
        d = jax.numpy.maximum(distance, 0).astype(jax.numpy.int32)
        return jax.numpy.searchsorted(bounds, d, side="right").astype(jax.numpy.int32) - 1


class PagedAttention(Protocol):
    def __call__(
        self,
        q: Array,
        k_pages: Array,
        v_pages: Array | None,
        block_table: Array,
        q_positions: Array,
        kv_lengths: Array,
        scale: float,
        sliding_window: int | None,
        rel_q: Array | None = None,
        rel_table: Array | None = None,
        rel_bias: RelativeBias | None = None,
    ) -> Array:
        """Causal GQA attention of a ragged batch (prefill chunks and decode tokens, rows
        right-padded to T) over the paged KV cache, this step's keys already written.

        Key j of row b lives in page `block_table[b, j // page]`, slot `j % page`. It is visible
        to a query at position p when `j <= p`, `j < kv_lengths[b]` and, with a window,
        `p - j < sliding_window`. Query head n reads kv head `n // (N / K)`. The logits are
          `l[n, p, j] = scale * q_n(p) . k(j) + rel_q_n(p) . rel_table[bucket(p - j)]`
        (the second term only with a relative bias: per-query vectors times the learned table
        of distance embeddings, computed by the kernels per tile, never as a [T, S] array).
        Softmax in float32. Keys that are not visible may hold any bytes (other layers' state,
        freed pages): they must not reach the output, even as NaN * 0. A query with no visible
        key outputs zeros.

        Args:
          q: [B, T, N, H]. k_pages, v_pages: [Pg, K, page, H] (head-major pages, the cache
          layout) with N % K == 0; or k_pages [Pg, 2, K, page, H], each page's K then its V
          (the region's own layout, `split_kv`), and v_pages None: a kernel then reads both
          halves of the one array, which no slice has copied. block_table: [B, nblk] int32 page
          ids (covering every visible key of the row). q_positions: [B, T] int32 absolute
          positions. kv_lengths: [B] int32.
          rel_q: [B, T, N, R]; rel_table: [num_buckets, R]; rel_bias: the bucketing.
        Returns: [B, T, N, H] in q's dtype.
        """


def is_joint_kv(k_pages: Array, v_pages: Array | None) -> bool:
    """Do `paged_attention`'s pages come joint (`v_pages` None: k_pages [Pg, 2, K, page, H])?
    Raises `ValueError` when they are joint but not of that shape."""
    if v_pages is not None:
        return False
    if k_pages.ndim != 5 or k_pages.shape[1] != 2:
        raise ValueError(f"joint K|V pages must be [Pg, 2, K, page, H], got {k_pages.shape}")
    return True


def split_kv(k_pages: Array, v_pages: Array | None) -> tuple[Array, Array]:
    """`paged_attention`'s pages as separate K and V ([Pg, K, page, H] each) in either form."""
    if not is_joint_kv(k_pages, v_pages):
        return k_pages, v_pages
    return k_pages[:, 0], k_pages[:, 1]


class GroupedMatmul(Protocol):
    def __call__(self, x: Array, w: Array, group_sizes: Array) -> Array:
        """Ragged (grouped) matmul for MoE: rows of x sorted by expert.

        Args: x [M, Din]; w [E, Din, Dout]; group_sizes [E] int32 summing to M.
        Returns: [M, Dout], row r multiplied by the weight of the expert it belongs to.
        """


OP_SIGNATURES: dict[str, type] = {
    "linear": Linear,
    "rms_norm": RmsNorm,
    "gated_rms_norm": GatedRmsNorm,
    "causal_conv1d": CausalConv1d,
    "causal_conv1d_step": CausalConv1dStep,
    "mamba2_scan": Mamba2Scan,
    "mamba2_step": Mamba2Step,
    "mamba2_step_paged": Mamba2StepPaged,
    "mamba2_decode_paged": Mamba2DecodePaged,
    "paged_attention": PagedAttention,
    "grouped_matmul": GroupedMatmul,
    "nvfp4_grouped_matmul": Nvfp4GroupedMatmul,
    "fp8_linear": Fp8Linear,
    "fp8_grouped_matmul": Fp8GroupedMatmul,
}

BACKENDS = ("xla", "pallas", "torch", "tokamax")  # tokamax: single-op overrides
_REGISTRY: dict[tuple[str, str], Callable] = {}


def register(op: str, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as the implementation of `op` for `backend`."""
    if op not in OP_SIGNATURES:
        raise BackendError(f"unknown op {op!r}; known ops: {sorted(OP_SIGNATURES)}")

    def wrap(fn: Callable) -> Callable:
        _REGISTRY[(op, backend)] = fn
        return fn

    return wrap


@dataclasses.dataclass(frozen=True)
class Ops:
    """The resolved op table of one backend (one field per op in `OP_SIGNATURES`)."""

    backend: str
    linear: Linear
    rms_norm: RmsNorm
    gated_rms_norm: GatedRmsNorm
    causal_conv1d: CausalConv1d
    causal_conv1d_step: CausalConv1dStep
    mamba2_scan: Mamba2Scan
    mamba2_step: Mamba2Step
    mamba2_step_paged: Mamba2StepPaged
    mamba2_decode_paged: Mamba2DecodePaged
    paged_attention: PagedAttention
    grouped_matmul: GroupedMatmul
    nvfp4_grouped_matmul: Nvfp4GroupedMatmul
    fp8_linear: Fp8Linear
    fp8_grouped_matmul: Fp8GroupedMatmul


def _import_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)}")
    try:
        module = importlib.import_module(f"backends.{backend}")
    except ImportError as err:
        raise BackendError(f"backend {backend!r} is not available here: {err}") from err
    check = getattr(module, "check_platform", None)  # a backend may refuse this hardware
    if check is not None:
        check(jax.default_backend())


def get_op(op: str, backend: str) -> Callable:
    """The implementation of `op` in `backend`; raises `BackendError` when it has none."""
    _import_backend(backend)
    try:
        return _REGISTRY[(op, backend)]
    except KeyError:
        raise BackendError(f"backend {backend!r} has no implementation of op {op!r}") from None


# What "auto" is on GPUs: measured on an H200 (BENCHMARKS.md, the decode step, 2026-12-03), the
# pallas attention and state kernels with XLA's norms and one-token conv, which XLA fuses with
# their neighbours (batch-1 forward 5.37 ms against 5.73 all-pallas and 5.50 with xla norms
# only; batch 64 within 1%).
GPU_DEFAULT = "pallas,rms_norm=xla,gated_rms_norm=xla,causal_conv1d_step=xla"
# Where tokamax is installed (the `cuda` extra on Python >= 3.12), its `ragged_dot` is the
# grouped matmul: 232 TFLOP/s against our Triton kernel's 99 on an H200 (8192 x 2048 -> 1408,
# 64 experts; BENCHMARKS.md, 2026-12-04), with the same greedy tokens as xla in the engine.
GPU_TOKAMAX = "grouped_matmul=tokamax"


@functools.cache
def _available(backend: str) -> bool:
    try:
        _import_backend(backend)
    except Exception:  # noqa: BLE001  (not installed, or installed but broken: not used)
        return False
    return True


def default_backend(platform: str | None = None) -> str:
    """What `"auto"` means on `platform` (default: jax's): the fastest backend (with per-op
    overrides) measured there: `GPU_DEFAULT` on GPUs (with `GPU_TOKAMAX` when tokamax imports),
    the xla reference elsewhere."""
    platform = jax.default_backend() if platform is None else platform
    if platform not in ("gpu", "cuda"):
        return "xla"
    return f"{GPU_DEFAULT},{GPU_TOKAMAX}" if _available("tokamax") else GPU_DEFAULT


def load_ops(backend: str = "xla", fallback: str | None = None) -> Ops:
    """Resolve every op for `backend`. Ops it lacks come from `fallback` only when one is given
    (e.g. `fallback="xla"`); otherwise a missing op raises `BackendError`.

    `backend` may name ops taken from other backends after a comma:
    `"xla,mamba2_step_paged=pallas"` is the xla table with the pallas state update (for
    measuring one kernel inside the engine); `Ops.backend` is then that whole string. `"auto"`
    is `default_backend()` (with any overrides after it applied last)."""
    base, *picks = (part.strip() for part in backend.split(","))
    if base == "auto":  # the default's own overrides first: the caller's take precedence
        backend = ",".join([default_backend(), *picks])
        base, *picks = (part.strip() for part in backend.split(","))
    overrides = {}
    for pick in picks:
        op, sep, name = pick.partition("=")
        if not sep or op not in OP_SIGNATURES:
            raise BackendError(
                f"bad backend override {pick!r} in {backend!r}: write OP=BACKEND with OP one of "
                f"{sorted(OP_SIGNATURES)}"
            )
        overrides[op] = get_op(op, name)
    table = {}
    for op in OP_SIGNATURES:
        if op in overrides:
            table[op] = overrides[op]
            continue
        try:
            table[op] = get_op(op, base)
        except BackendError:
            if fallback is None:
                raise
            table[op] = get_op(op, fallback)
    return Ops(backend=backend, **table)
