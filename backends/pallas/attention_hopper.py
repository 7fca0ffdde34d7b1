"""Causal prefill attention for Hopper GPUs (sm90), written for Pallas's Mosaic GPU backend:
wgmma matmuls, TMA loads of K/V pages, warpgroup specialisation, and the learned relative bias
computed in the tile loop.

Same contract as `paged_attention` (backends/protocol.py) for prefill chunks without a sliding
window: q [B, T, N, H], pages [Pg, K, page, H] (or the joint [Pg, 2, K, page, H]), a block
table, absolute query positions and kv lengths; bf16 or f16, H a multiple of 64 (up to 256),
pages whose size divides the key block (`block_k`: 128 keys up to d 128, else 64).

Grid: (query head n, tile of 2 x 64 query rows, batch row b), three warpgroups per program.
Query head n reads kv head n // (N / K) (GQA: the N / K heads of a group re-read the same
pages, from L2). Each program walks the key blocks [lo, hi) that any of its rows may see; the
wrapper plans the loop bounds once, in XLA (`hopper_plan.plan_loops`, small int32 arrays):
per compute warpgroup, the blocks every row sees whole (no mask), and with a bias the far and
mid blocks below, and each block's bucket range.

Softmax in base 2 (float32), with `c = scale * log2(e)` and `bias2 = log2(e) * bias`:
  `s = c q k^T + bias2`,  `m' = max(m, rowmax s)`,  `p = 2^(s - m')`,
  `acc' = 2^(m - m') acc + p v`,  `l' = 2^(m - m') l + rowsum p`,  out = `acc / l`
(zeros for a row that sees no key).

Relative bias `bias[m, j] = rel_q[m] . table[bucket(pos[m] - j)]`, never a [T, S] array: the
wrapper computes each row's value at every bucket, `rel_q table^T` ([B, N, nb + 1, T], base 2,
float32), and the differences between neighbouring buckets. For a key block a warpgroup's
distances span `[d_lo, d_hi]`, so only buckets `bucket(d_lo)..bucket(d_hi)` occur: the tile
starts from the first one's per-row column and adds, for each further bucket b, its
difference where `pos[m] - j >= start(b)` (one compare and select per element and bucket).
Three loops: far blocks (every distance in the last bucket, most of a long prefill) add a
per-row constant; mid blocks (past the distance from which every bucket is at least as wide as
a block's span) add one select; the few blocks near the diagonal loop over their buckets.

Keys that are not visible may hold any bytes (NaN included): their logits are masked with a
select, and in the last block of a program (the only one that can reach past `kv_len`) each
compute warpgroup copies V through registers into its query buffer (free by then; 64 rows at a
time, two matmuls for a 128-key block), zeroing the rows at or past `kv_len`, so that `0 * NaN`
never reaches the output.

Lifecycle of one program (3 warpgroups: 0 and 1 compute, 2 memory):
 1. Memory warpgroup: for the first `stages` blocks of [lo, hi), TMA-copies each block's pages
    of K and V (kv head n // (N/K)) into ring slot `(i - lo) % stages`, each copy arriving on
    the slot's K or V barrier.
 2. Compute warpgroup w: TMA-copies its 64 query rows, their positions and (with a bias)
    their per-bucket columns into its own buffers and waits for them.
 3. For each block i: wait K(i); `S = Q K^T` (wgmma); arrive on K-consumed(i); mask / bias /
    online softmax; wait V(i); `acc += P V` (wgmma); arrive on V-consumed(i). A schedule
    barrier shared by the two compute warpgroups staggers them (one runs its softmax while the
    other's matmuls use the tensor cores).
 4. Memory warpgroup: for block i + stages, waits until both compute warpgroups consumed slot
    `(i - lo) % stages` (K, then V) before copying into it again.
 5. Compute warpgroup w: normalises, stores its rows to its buffer, TMA-copies them out and
    waits for the copy to finish.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm

from backends.pallas._common import interpret
from backends.pallas.hopper_plan import BLOCK_Q, default_block_k, plan_loops, supported
from backends.protocol import BackendError, RelativeBias, is_joint_kv

LOG2E = math.log2(math.e)
NEW_REF_API = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def _ref_t(ref):
    """A [K, H] SMEM ref seen as [H, K] (the wgmma B operand of Q K^T)."""
    return ref.transpose((1, 0)) if NEW_REF_API else plgpu.transpose_ref(ref, (1, 0))


SCHED = 8  # named barriers SCHED + w: compute warpgroup w's turn (Mosaic GPU uses the low ids)


def _bar(op: str, barrier: int, threads: int) -> None:
    """A hardware named barrier: `bar.arrive` or `bar.sync` on a static barrier id."""

    @plgpu.inline_mgpu()
    def ptx(_):
        void = ir.Type.parse("!llvm.void")
        llvm.inline_asm(void, [], f"bar.{op} {barrier}, {threads};", "", has_side_effects=True)

    ptx()


def _row(x):
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA.reduce(1))


def _bcast(v, shape):
    return lax.broadcast_in_dim(v, shape, [0])


def _kernel(
    plan_ref, lut_ref, starts_ref, table_ref, kvlen_ref, pos_ref, cols_ref, delta_ref, q_ref,
    k_ref, v_ref, o_ref, scoped, *, ratio, page, block_k, stages, scale, joint, nb, named,
):  # fmt: skip
    (q_smem2, k_smem, v_smem, row_smem), (k_bar, v_bar, q_bar), (k_free, v_free), sched = scoped
    b, head, tile = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("q_seq")
    wg = lax.axis_index("wg")
    dtype = q_ref.dtype
    hd = q_ref.shape[-1]
    lo, hi = plan_ref[b, tile, 0], plan_ref[b, tile, 1]
    ppb = block_k // page
    rel = cols_ref is not None
    wgmma_layout, row_layout = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)

    def sync():  # both compute warpgroups meet (the shared schedule mbarrier)
        plgpu.barrier_arrive(sched)
        plgpu.barrier_wait(sched)

    def pass_turn():  # named barriers: let the other compute warpgroup go on
        for w in (0, 1):
            pl.when(wg == w)(functools.partial(_bar, "arrive", SCHED + 1 - w, 256))

    def await_turn():  # named barriers: wait until the other one passed the turn
        for w in (0, 1):
            pl.when(wg == w)(functools.partial(_bar, "sync", SCHED + w, 256))

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_smem = q_smem2.at[wg]
        base = tile * 2 * BLOCK_Q + wg * BLOCK_Q
        rows = pl.ds(base, BLOCK_Q)
        pos_smem, cols_smem, delta_smem = (r.at[wg] if r is not None else None for r in row_smem)
        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, head], q_smem, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(pos_ref.at[b, rows], pos_smem, q_bar.at[wg])
        if rel:  # every bucket's per-row column and difference, [nb + 1, 64] each
            plgpu.copy_gmem_to_smem(cols_ref.at[b, head, :, rows], cols_smem, q_bar.at[wg])
            plgpu.copy_gmem_to_smem(delta_ref.at[b, head, :, rows], delta_smem, q_bar.at[wg])
        whole = plan_ref[b, tile, 2 + wg]  # blocks [lo, whole) every row sees whole
        far_end, mid_end = plan_ref[b, tile, 4 + wg], plan_ref[b, tile, 6 + wg]
        kv_len = kvlen_ref[b]
        shape = (BLOCK_Q, block_k)
        c = scale * LOG2E
        plgpu.barrier_wait(q_bar.at[wg])
        pos = plgpu.load(pos_smem, (), layout=row_layout)

        def key_col():  # [64, block_k] key index within the block (made where used: a
            # hoisted iota would hold 64 registers a thread through every loop)
            return plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma_layout)

        def column(ref, bucket):  # [64]: each row's value of `ref` at a (dynamic) bucket
            return plgpu.load(ref.at[bucket], (), layout=row_layout)

        def edge(s, i, bucket):  # add bucket's step where pos - j >= its start
            thr = pos - i * block_k - starts_ref[bucket]
            step = _bcast(column(delta_smem, bucket), shape)
            return s + jnp.where(key_col() <= _bcast(thr, shape), step, 0.0)

        # Each block class: `prep(i)` (loads that do not need the scores, issued before the
        # Q K^T matmul is waited for) and `logits(qk, i, prepared)`.
        def far_prep(i):  # one bucket (the last): a per-row constant
            del i
            return far_col

        def far_logits(qk, i, col):
            return qk * c + _bcast(col, shape)

        def mid_prep(i):  # at most two buckets: one select between two per-row columns
            b_lo = lut_ref[b, tile, wg, i] & 255
            thr = pos - i * block_k - starts_ref[b_lo + 1]
            return thr, column(cols_smem, b_lo), column(cols_smem, b_lo + 1)

        def mid_logits(qk, i, prepared):
            thr, lo_col, hi_col = (_bcast(v, shape) for v in prepared)
            return qk * c + jnp.where(key_col() <= thr, hi_col, lo_col)

        def near_prep(i):  # a loop over the buckets the block's distances span
            packed = lut_ref[b, tile, wg, i]
            return packed, column(cols_smem, packed & 255)

        def near_logits(qk, i, prepared):
            packed, first = prepared
            s = qk * c + _bcast(first, shape)
            return lax.fori_loop(
                (packed & 255) + 1, (packed >> 8) + 1, lambda n, s: edge(s, i, n), s
            )

        def plain_prep(i):
            del i

        def plain_logits(qk, i, col):  # left unscaled (c > 0): c goes into the exponent's FMA
            del i, col
            return qk if c > 0 else qk * c

        far_kind, mid_kind = (far_prep, far_logits), (mid_prep, mid_logits)
        near_kind, plain_kind = (near_prep, near_logits), (plain_prep, plain_logits)

        def step(i, carry, kind=plain_kind, masked=False, tail=False):
            prep, logits = kind
            prepared = prep(i)
            acc, m, den = carry
            slot = lax.rem(i - lo, stages)

            def qk_scope(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, _ref_t(k_smem.at[slot]))
                if named:
                    pass_turn()
                else:
                    sync()
                return acc_ref[...]

            qk = pl.run_scoped(qk_scope, plgpu.ACC(shape, jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            s = logits(qk, i, prepared)
            if masked:
                key = key_col() + i * block_k
                visible = (key <= _bcast(pos, shape)) & (key < kv_len)
                s = jnp.where(visible, s, -jnp.inf)
            unscaled = logits is plain_logits and c > 0  # s = q k^T: scale the max, FMA below
            m_new = jnp.maximum(m, s.max(axis=1) * c if unscaled else s.max(axis=1))
            # a row that has seen no key yet keeps m = -inf: its exponents count from 0
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            p = jnp.exp2((s * c if unscaled else s) - _bcast(m_use, shape))
            acc = acc * _bcast(alpha, acc.shape)
            den = den * alpha + p.sum(axis=1)
            p16 = p.astype(dtype)
            acc, den, m_new, p16 = lax.optimization_barrier((acc, den, m_new, p16))
            if named:  # tensor cores in turn: this one's P V after the other's Q K^T
                plgpu.barrier_wait(v_bar.at[slot])
                await_turn()
            else:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_wait(sched)

            def wait_next():
                nxt = i + 1

                @pl.when(nxt < hi)
                def _():
                    plgpu.barrier_wait(k_bar.at[lax.rem(nxt - lo, stages)])

            if not tail:

                def pv_scope(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                    wait_next()

                acc = pl.run_state(pv_scope)(plgpu.ACC.init(acc))
            else:  # keys at or past kv_len may hold NaN: V goes through the query buffer
                for part in range(block_k // BLOCK_Q):  # (free by now) with those rows zeroed
                    part_rows = pl.ds(part * BLOCK_Q, BLOCK_Q)
                    v = plgpu.load(v_smem.at[slot, part_rows], (), layout=wgmma_layout)
                    row = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=wgmma_layout)
                    first = i * block_k + part * BLOCK_Q
                    q_smem[...] = jnp.where(row + first < kv_len, v, jnp.zeros_like(v))
                    plgpu.commit_smem()
                    p_part = p16 if block_k == BLOCK_Q else p16[:, part * BLOCK_Q :][:, :BLOCK_Q]

                    def pv_part(acc_ref, p_part=p_part):
                        plgpu.wgmma(acc_ref, p_part, q_smem)

                    acc = pl.run_state(pv_part)(plgpu.ACC.init(acc))
                wait_next()
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, den

        m = _row(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32))
        den = _row(jnp.zeros((BLOCK_Q,), jnp.float32))
        acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, hd), jnp.float32), wgmma_layout)

        @pl.when(hi > lo)
        def _():
            plgpu.barrier_wait(k_bar.at[0])

        if named:  # warpgroup 1 starts once warpgroup 0 issued its first Q K^T
            pl.when(wg == 1)(functools.partial(_bar, "sync", SCHED + 1, 256))
        else:
            pl.when(wg == 1)(sync)
        last = jnp.maximum(hi - 1, lo)
        unmasked_end = jnp.clip(whole, lo, last)
        if rel:  # far, mid and near blocks (all seen whole), then the masked ones
            far_col = column(cols_smem, nb - 1)
            far = jnp.clip(far_end, lo, unmasked_end)
            mid = jnp.clip(mid_end, far, unmasked_end)
            loops = [(lo, far, far_kind), (far, mid, mid_kind), (mid, unmasked_end, near_kind)]
            masked_kind = near_kind
        else:
            loops = [(lo, unmasked_end, plain_kind)]
            masked_kind = plain_kind
        carry = (acc, m, den)
        for start, stop, kind in loops:
            carry = lax.fori_loop(start, stop, functools.partial(step, kind=kind), carry)
        body = functools.partial(step, kind=masked_kind, masked=True)
        carry = lax.fori_loop(unmasked_end, last, body, carry)
        body = functools.partial(step, kind=masked_kind, masked=True, tail=True)
        carry = lax.fori_loop(last, hi, body, carry)
        acc, m, den = carry
        if named:  # the turn warpgroup 1 waits for before its last P V
            pl.when(wg == 0)(functools.partial(_bar, "arrive", SCHED + 1, 256))
        else:
            pl.when(wg == 0)(sync)
        out = acc / _bcast(jnp.where(den == 0.0, 1.0, den), acc.shape)
        q_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[b, pl.ds(base, BLOCK_Q), head])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")
        kv_head = lax.div(head, jnp.int32(ratio))

        def fetch(i, slot, ref, bar, half):  # one block's pages of K (half 0) or V (1)
            for part in range(ppb):
                page_id = table_ref[b, i * ppb + part]
                src = ref.at[page_id, half, kv_head] if joint else ref.at[page_id, kv_head]
                plgpu.copy_gmem_to_smem(src, bar[0].at[slot, pl.ds(part * page, page)], bar[1])

        def fetch_k(i, slot):
            fetch(i, slot, k_ref, (k_smem, k_bar.at[slot]), 0)

        def fetch_v(i, slot):
            fetch(i, slot, v_ref, (v_smem, v_bar.at[slot]), 1)

        for n in range(stages):

            @pl.when(lo + n < hi)
            def _(n=n):
                fetch_k(lo + n, n)
                fetch_v(lo + n, n)

        @pl.loop(lo + stages, jnp.maximum(hi, lo + stages))
        def _(i):
            slot = lax.rem(i - lo, stages)
            plgpu.barrier_wait(k_free.at[slot])
            fetch_k(i, slot)
            plgpu.barrier_wait(v_free.at[slot])
            fetch_v(i, slot)


def prefill_attention_hopper(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array | None,
    block_table: jax.Array,
    q_positions: jax.Array,
    kv_lengths: jax.Array,
    scale: float,
    sliding_window: int | None = None,
    rel_q: jax.Array | None = None,
    rel_table: jax.Array | None = None,
    rel_bias: RelativeBias | None = None,
    *,
    block_k: int | None = None,
    stages: int = 2,
    named_barriers: bool = False,
) -> jax.Array:
    """`paged_attention` (backends/protocol.py) for prefill on sm90 GPUs: see the module
    docstring. `block_k` keys per step (64 or 128; default `default_block_k`), `stages` K/V
    blocks in flight (2: three of 128 keys overflow shared memory at d 128).
    `named_barriers` (experimental, unmeasured): the two compute warpgroups take turns on the
    tensor cores through hardware named barriers (`bar.arrive` / `bar.sync`, FA3's ping-pong)
    instead of meeting at a shared mbarrier twice a block. Raises
    `BackendError` for inputs it does not take (`supported` says why)."""
    block_k = default_block_k(q.shape[-1]) if block_k is None else block_k
    if block_k not in (64, 128):
        raise ValueError(f"block_k must be 64 or 128, got {block_k}")
    if (why := supported(q, k_pages, sliding_window, block_k)) is not None:
        raise BackendError(f"hopper prefill attention: {why}")
    bsz, t, nq, hd = q.shape
    joint = is_joint_kv(k_pages, v_pages)
    nkv, page = k_pages.shape[-3], k_pages.shape[-2]
    tile = 2 * BLOCK_Q
    tiles = -(-t // tile)
    tp = tiles * tile
    q_p = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    pos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, tp - t)), mode="edge")
    kv_len = kv_lengths.astype(jnp.int32)
    ppb = block_k // page
    n_blocks = -(-block_table.shape[1] // ppb)
    table = jnp.clip(block_table.astype(jnp.int32), 0, k_pages.shape[0] - 1)
    table = jnp.pad(table, ((0, 0), (0, n_blocks * ppb - block_table.shape[1])))
    starts = rel_bias.boundaries() if rel_bias is not None else ()
    nb = len(starts)
    plan, lut = plan_loops(pos, kv_len, tiles, block_k, n_blocks, starts)
    extra: tuple[jax.Array, ...] = ()
    if starts:
        # [B, N, nb + 1, Tp]: each row's logit term at every bucket (base 2), and the step
        # from the previous bucket; bucket nb (start past every distance) adds nothing
        cols = jnp.einsum(
            "btnr,kr->bnkt", rel_q.astype(jnp.float32), rel_table.astype(jnp.float32)
        ) * LOG2E  # fmt: skip
        cols = jnp.pad(cols, ((0, 0), (0, 0), (0, 1), (0, tp - t)), mode="edge")
        delta = jnp.concatenate([cols[:, :, :1], jnp.diff(cols, axis=2)], axis=2)
        extra = (cols, delta)
    starts_arr = jnp.asarray((*starts, 2**30), jnp.int32)
    kernel = functools.partial(
        _kernel, ratio=nq // nkv, page=page, block_k=block_k, stages=stages, scale=scale,
        joint=joint, nb=nb, named=named_barriers,
    )  # fmt: skip
    swz = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    bucket_rows = None if not starts else plgpu.SMEM((2, nb + 1, BLOCK_Q), jnp.float32)
    buffers = (
        plgpu.SMEM((2, BLOCK_Q, hd), q.dtype, transforms=swz),
        plgpu.SMEM((stages, block_k, hd), q.dtype, transforms=swz),
        plgpu.SMEM((stages, block_k, hd), q.dtype, transforms=swz),
        (plgpu.SMEM((2, BLOCK_Q), jnp.int32), bucket_rows, bucket_rows),
    )
    loaded = (
        plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),
        plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),
        plgpu.Barrier(num_arrivals=4 if starts else 2, num_barriers=2),
    )
    freed = (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2
    scratch = (buffers, loaded, freed, plgpu.Barrier(num_arrivals=2))

    def entry(plan_ref, lut_ref, starts_ref, table_ref, kvlen_ref, pos_ref, *refs):
        *refs, buffers, loaded, freed, sched = refs
        cols_ref = delta_ref = None
        if starts:
            cols_ref, delta_ref, *refs = refs
        q_ref, k_ref, v_ref, o_ref = refs
        kernel(
            plan_ref, lut_ref, starts_ref, table_ref, kvlen_ref, pos_ref, cols_ref, delta_ref,
            q_ref, k_ref, v_ref, o_ref, (buffers, loaded, freed, sched),
        )  # fmt: skip

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        grid=(nq, tiles, bsz),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret(),  # the CPU: Pallas's Mosaic GPU interpreter
    )(
        plan,
        lut,
        starts_arr,
        table,
        kv_len,
        pos,
        *extra,
        q_p,
        k_pages,
        k_pages if joint else v_pages,
    )
    return out[:, :t]
