"""The paged-cache plan of the full-size Inkling (`inkling_full`) for one 1M-token request.

Context 1,048,576 tokens, kv and conv dtype bfloat16, kernel block 16, TP 1 and 8:

  cache entries  66 layers + 66 x 9 sconv entries (per layer: kv 1, out 4, ffn 4, each entry
                 2 * 8 * 128 = 2048 channels, 7168 = 3.5 entries) = 660
  buckets        full attention 11, sliding window (4096) 55, sconv (window 3) 594
  groups         group size 11 (the smallest bucket): 1 full + 5 sliding + 54 sconv = 60
  regions        11, no padding slots
  block / page   16 tokens (ratio 1); page per rank 65,536 B at TP 1 (16 tokens x 8 KV heads x
                 (K, V) x 128 x 2 B), 8,192 B at TP 8 (1 KV head per rank); one page id takes a
                 page in each of the 11 regions (704 KiB at TP 1, 88 KiB at TP 8)

One 1M-token request at steady state (decode, its largest step), per rank:

  kind        groups  pages/group  page ids  TP 1 bytes                 TP 8 bytes
  full             1       65,536    65,536  47,244,640,256 (44.0 GiB)  5,905,580,032 (5.5 GiB)
  sliding          5          257     1,285     926,351,360 (883 MiB)     115,793,920 (110 MiB)
  sconv           54            2       108      77,856,768 (74.3 MiB)      9,732,096 (9.3 MiB)
  total           60                 66,929  48,248,848,384 (44.9 GiB)  6,031,106,048 (5.6 GiB)

Full attention holds 97.9% of it. A prefill chunk of C tokens holds, for a step, up to
cdiv(4096 + C, 16) + 1 pages per sliding group and cdiv(3 + C, 16) + 1 per sconv group (C = 256:
273 and 18, i.e. 54 x 18 sconv page ids; C = 8192: 54 x 514 = 27,756, 42% of the full group's).
The page counts come from running the real `CacheCoordinator` over a 1M-token request.
`CacheCoordinator.pages_for` (the engine's max_model_len check) counts each window group's
window plus one step's chunk (67,873 page ids for steps of 256 tokens).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools

import pytest

from hybridserve.cache.plan import plan_cache
from hybridserve.cache.spec import (
    FullAttentionSpec,
    SconvSpec,
    SlidingWindowSpec,
    layer_specs,
    sconv_entries,
)
from hybridserve.config import SchedulerConfig
from hybridserve.config.inkling_presets import (
    active_param_count,
    inkling_full,
    inkling_mid,
    param_count,
)
from hybridserve.core.cache_manager import CacheCoordinator, cdiv
from hybridserve.core.request import Request
from hybridserve.core.scheduler import Scheduler

CONTEXT = 1 << 20
BLOCK = 16
WINDOW = 4096
CHUNK = 256  # the default max_prefill_chunk
DECODE = 48  # decode steps at the end: every position modulo the block
KINDS = {FullAttentionSpec: "full", SlidingWindowSpec: "sliding", SconvSpec: "sconv"}
# the written-down plan: kind -> (groups, pages per group at steady state)
PLAN = {
    "full": (1, cdiv(CONTEXT, BLOCK)),
    "sliding": (5, cdiv(WINDOW, BLOCK) + 1),
    "sconv": (54, 2),
}
BYTES_TP1 = {"full": 47_244_640_256, "sliding": 926_351_360, "sconv": 77_856_768}


def kind(group) -> str:
    return KINDS[type(group.spec)]


@functools.cache
def plan(tp: int):
    return plan_cache(layer_specs(inkling_full(), tp, "bfloat16", "bfloat16"), tp, 16)


@functools.cache
def simulated_pages() -> dict[str, tuple[int, int, int]]:
    """Run one request of CONTEXT tokens through the real cache manager (prefill in CHUNK
    chunks, then DECODE single-token steps) in a pool of exactly the plan's size plus the
    prefill transient; per kind: (most pages one group held during prefill, during decode,
    at the last step)."""
    p = plan(1)
    prefill_peak = {
        "full": PLAN["full"][1],
        "sliding": cdiv(WINDOW + CHUNK, BLOCK) + 1,
        "sconv": cdiv(3 + CHUNK, BLOCK) + 1,
    }
    pool = 1 + sum(prefill_peak[kind(g)] for g in p.groups)
    coord = CacheCoordinator(p, pool, enable_prefix_caching=False)
    request = Request("r", [1] * (CONTEXT - DECODE), DECODE)
    kinds = [kind(g) for g in p.groups]
    peaks = [[0] * len(kinds), [0] * len(kinds)]

    def step(n: int, phase: int) -> list[int]:
        assert coord.allocate_slots(request, n)
        tables = coord._tables["r"]
        held = [len(t) - bisect.bisect_left(t, True, key=bool) for t in tables]
        assert all(0 not in t[len(t) - h :] for t, h in zip(tables, held, strict=True))
        peaks[phase] = [max(a, b) for a, b in zip(peaks[phase], held, strict=True)]
        request.num_computed_tokens += n
        return held

    while request.num_computed_tokens < CONTEXT - DECODE:
        step(min(CHUNK, CONTEXT - DECODE - request.num_computed_tokens), 0)
    for _ in range(DECODE):
        last = step(1, 1)
    # the freed pages (the null page 0) form a prefix of each table: `held` counted the rest
    assert [len(t) - t.count(0) for t in coord._tables["r"]] == last
    assert request.num_computed_tokens == CONTEXT
    out = {}
    for k in PLAN:
        idx = [i for i, x in enumerate(kinds) if x == k]
        per = {(peaks[0][i], peaks[1][i], last[i]) for i in idx}
        assert len(per) == 1, (k, per)  # every group of a kind behaves alike
        out[k] = per.pop()
    return out


@pytest.mark.parametrize("tp", [1, 8])
def test_grouping_of_the_full_size_plan(tp):
    cfg = inkling_full()
    entries = sconv_entries(cfg)
    assert all(len(e["kv"]) == 1 and len(e["out"]) == len(e["ffn"]) == 4 for e in entries)
    per_layer = 1 + 2 * cdiv(7168, 2 * 8 * 128)
    assert per_layer == 9 and {sum(map(len, e.values())) for e in entries} == {per_layer}
    specs = layer_specs(cfg, tp, "bfloat16", "bfloat16")
    assert len(specs) == 66 + 66 * 9 and all(s is not None for s in specs)
    assert sum(isinstance(s, SconvSpec) for s in specs) == 594
    p = plan(tp)
    counts = {k: sum(kind(g) == k for g in p.groups) for k in PLAN}
    assert counts == {k: v[0] for k, v in PLAN.items()}
    assert len(p.groups) == 60 and p.num_regions == 11
    assert all(None not in g.layers for g in p.groups)  # no padding slots
    assert p.block_size == BLOCK and p.ratio == 1
    kv_local = 8 // tp
    assert p.page_size_bytes == BLOCK * kv_local * 2 * 128 * 2 == 65536 // tp
    assert {g.kind for g in p.groups if kind(g) == "sconv"} == {"sliding_window"}
    assert {g.spec.sliding_window for g in p.groups if kind(g) == "sconv"} == {3}
    assert [g.layers for g in p.groups] == [g.layers for g in plan(1).groups]


def test_cache_manager_holds_the_written_down_pages():
    sim = simulated_pages()
    for k, (_, pages) in PLAN.items():
        prefill, decode, _ = sim[k]
        assert decode == pages, (k, sim[k])
    assert sim["full"][2] == cdiv(CONTEXT, BLOCK)
    assert sim["sliding"][0] <= cdiv(WINDOW + CHUNK, BLOCK) + 1
    assert sim["sconv"][0] <= cdiv(3 + CHUNK, BLOCK) + 1


@pytest.mark.parametrize("tp", [1, 8])
def test_bytes_per_rank_of_a_1m_request(tp):
    p, sim = plan(tp), simulated_pages()
    got = {k: 0 for k in PLAN}
    for g in p.groups:  # a page id takes one page in every region
        got[kind(g)] += sim[kind(g)][1] * p.num_regions * p.page_size_bytes
    kv_local, hd, bf16 = 8 // tp, 128, 2
    per_token = 2 * kv_local * hd * bf16  # K and V (or one sconv entry's channels)
    hand = {
        "full": 11 * CONTEXT * per_token,
        "sliding": 55 * (cdiv(WINDOW, BLOCK) + 1) * BLOCK * per_token,
        "sconv": 66 * 9 * 2 * BLOCK * per_token,
    }
    assert got == hand == {k: v // tp for k, v in BYTES_TP1.items()}
    assert got["full"] > 0.95 * sum(got.values())
    assert sum(got.values()) == 48_248_848_384 // tp


def test_pages_for_counts_what_a_1m_request_holds():
    # The engine's max_model_len check and the scheduler's pool check: a step of up to 256
    # tokens holds the window plus the chunk in each window group, all 1M tokens in the full
    # group: 65,536 + 5 * (cdiv(4096 + 256, 16) + 1) + 54 * (cdiv(3 + 256, 16) + 1).
    coord = CacheCoordinator(plan(8), 2, enable_prefix_caching=False)
    assert coord.pages_for(CONTEXT, 256) == 65_536 + 5 * 273 + 54 * 18
    assert coord.pages_for(CONTEXT) == 60 * 65_536  # steps of any size: every page may be held


def colocated_held(p, n: int, pool: int) -> list[int]:
    """Pages per group a colocated engine holds at a request's first decode step: the prompt
    but its last token prefilled in CHUNK steps, then one token (the real cache manager)."""
    coord = CacheCoordinator(p, pool, enable_prefix_caching=False)
    request = Request("c", [1] * (n + 1), 1)
    while request.num_computed_tokens < n:
        step = min(CHUNK, n - request.num_computed_tokens)
        assert coord.allocate_slots(request, step)
        request.num_computed_tokens += step
    assert coord.allocate_slots(request, 1)
    return [len(t) - t.count(0) for t in coord.block_tables(request)]


@pytest.mark.parametrize("n", [20_000, 100_000, 500_000])
def test_pd_admission_of_long_prompts_at_tp8(n):
    # The decode side of P/D admits a prompt whose first n tokens the prefill engine computed
    # into the engine's minimum pool for max_model_len 1M (what `LLMEngine` requires:
    # `pages_for(max_model_len, max_prefill_chunk)`), holding per group at most one page more
    # than a colocated engine at the same point (window groups: their window, not n tokens).
    p = plan(8)
    pool = CacheCoordinator(p, 2).pages_for(CONTEXT, CHUNK)
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, max_prefill_chunk=CHUNK, max_model_len=CONTEXT
    )
    s = Scheduler(p, pool, config)
    tokens = [(7 * i) % 50_000 for i in range(n + 1)]
    slots = s.add_remote_request(Request("d", tokens, 16), n)
    assert slots is not None
    held = [len(t) - t.count(0) for t in slots.block_tables]
    colocated = colocated_held(p, n, pool)
    assert all(h <= c + 1 for h, c in zip(held, colocated, strict=True)), (held, colocated)
    assert s.coordinator.pool.num_used == sum(held) <= sum(colocated) + len(held)
    by_kind = {kind(g): h for g, h in zip(p.groups, held, strict=True)}
    assert by_kind == {"full": cdiv(n + 1, BLOCK), "sliding": 257, "sconv": 1 + (n % 16 < 3)}


def test_param_counts():
    full, mid = inkling_full(), inkling_mid()
    assert param_count(full) == 763_050_396_672
    assert active_param_count(full) == 36_387_228_672
    assert active_param_count(full, with_embeddings=False) == 34_038_418_432
    assert param_count(mid) == 3_315_443_712
    assert active_param_count(mid) == 1_126_017_024
    assert mid.pattern == "SSSSS*SSSSS*" and full.pattern == "SSSSS*" * 11


@pytest.mark.parametrize("bias", [False, True])
def test_param_count_matches_the_model(bias):
    """The formula against a real HybridModel at a tiny size (biases, ungated, tied, three
    shared experts when `bias`)."""
    import jax
    from flax import nnx

    from backends.protocol import load_ops
    from hybridserve.config import SconvConfig
    from hybridserve.models.hybrid import HybridModel

    mid = inkling_mid()
    attention = dataclasses.replace(
        mid.attention, num_heads=4, num_kv_heads=2, head_dim=8, sliding_window=8, bias=bias,
        rel_dim=4, rel_buckets=8, rel_exact=4, rel_max_distance=20,
    )  # fmt: skip
    moe = dataclasses.replace(
        mid.moe, num_experts=6, top_k=2, intermediate_size=12, shared_intermediate_size=10,
        num_shared_experts=3 if bias else 2, gated=not bias,
    )  # fmt: skip
    cfg = dataclasses.replace(
        mid, vocab_size=96, hidden_size=40, attention=attention, moe=moe,
        sconv=SconvConfig(width=3 if bias else 4, bias=bias), tie_word_embeddings=bias,
    )  # fmt: skip
    assert cfg.vision is None and cfg.audio is None
    # shapes only (no weights computed): the same parameters as a built model
    model = nnx.eval_shape(lambda: HybridModel(cfg, load_ops("xla"), rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model))) == param_count(cfg)
