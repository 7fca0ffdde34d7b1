"""Relative-position ("qkvr") attention through the engine against numpy written from the
layer's docstring: `l[n, i, j] = scale q_n(i) . k(j) + r_n(i) . E[bucket(i - j)]`, causal, GQA,
NoPE. A tiny attention + MLP decoder, float32, prompt logits within 1e-5 of the logit scale,
with the xla and the pallas backends; distances reach past the last bucket start, so exact,
log-spaced and open buckets all occur (the pallas kernel's key-block regions are checked in
tests/backends/test_pallas_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from backends.protocol import load_ops
from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig, ConfigError, ModelConfig
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.models.hybrid import HybridModel
from hybridserve.runner.factory import make_runner
from hybridserve.weights.loader import read_config, save_converted

BUCKETS, EXACT, MAX_DIST = 12, 4, 24


def _config(window: int | None) -> ModelConfig:
    """attention, mlp, attention (sliding with a window), mlp."""
    d = read_config(DEFAULT_MODEL).to_dict()
    second = "attention" if window is None else "sliding_attention"
    d.update(hidden_size=32, layer_types=["attention", "mlp", second, "mlp"], ffn=None,
             mamba=None, moe=None, tie_word_embeddings=False, dtype="float32")  # fmt: skip
    rel = dict(rel_dim=8, rel_buckets=BUCKETS, rel_exact=EXACT, rel_max_distance=MAX_DIST)
    d["attention"] = dict(num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=None,
                          rotary_dim=None, sliding_window=window, **rel)  # fmt: skip
    d["mlp"] = dict(intermediate_size=48, activation="relu2", gated=False, bias=False)
    return ModelConfig.from_dict(d)


def _bucket(dist: np.ndarray) -> np.ndarray:
    """From the definition: distances below EXACT exact; then BUCKETS - EXACT starts spaced
    geometrically from EXACT to MAX_DIST (rounded, strictly increasing); the last one open."""
    starts = list(range(EXACT))
    n_log = BUCKETS - EXACT
    for i in range(n_log):
        start = round(EXACT * (MAX_DIST / EXACT) ** (i / (n_log - 1)))
        starts.append(max(start, starts[-1] + 1))
    return np.searchsorted(np.array(starts), np.maximum(dist, 0), side="right") - 1


def _reference(model: HybridModel, cfg: ModelConfig, ids: np.ndarray) -> np.ndarray:
    p = nnx.to_pure_dict(nnx.state(model))
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    att = cfg.attention
    n, kv, hd = att.num_heads, att.num_kv_heads, att.head_dim
    eps = cfg.norm_eps

    def norm(x, w):
        return f64(w) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)

    h = f64(p["embed"])[ids] * cfg.embedding_multiplier
    t = len(ids)
    dist = np.arange(t)[:, None] - np.arange(t)[None, :]
    for i, kind in enumerate(cfg.layer_types):
        blk = p["layers"][i]
        x = norm(h, blk["norm"]["weight"])
        m = blk["mixer"]
        if kind in ("attention", "sliding_attention"):
            visible = dist >= 0
            if kind == "sliding_attention":
                visible &= dist < att.sliding_window
            q = np.einsum("td,dnh->tnh", x, f64(m["q_proj"]["kernel"]))
            k = np.einsum("td,dkh->tkh", x, f64(m["k_proj"]["kernel"]))
            v = np.einsum("td,dkh->tkh", x, f64(m["v_proj"]["kernel"]))
            r = np.einsum("td,dnr->tnr", x, f64(m["r_proj"]["kernel"]))
            table = f64(m["rel_table"])
            out = np.zeros((t, n, hd))
            for head in range(n):
                g = head // (n // kv)
                logits = att.softmax_scale * q[:, head] @ k[:, g].T
                logits += np.take_along_axis(r[:, head] @ table.T, _bucket(dist), axis=1)
                logits = np.where(visible, logits, -np.inf)
                w = np.exp(logits - logits.max(1, keepdims=True))
                out[:, head] = (w / w.sum(1, keepdims=True)) @ v[:, g]
            y = np.einsum("tnh,nhd->td", out, f64(m["o_proj"]["kernel"]))
        else:
            up = x @ f64(m["up_proj"]["kernel"])
            y = (np.maximum(up, 0) ** 2) @ f64(m["down_proj"]["kernel"])
        h = h + cfg.residual_multiplier * y
    h = norm(h, p["norm_f"]["weight"])
    return h @ f64(p["lm_head"]) / cfg.logits_scaling


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("window", [None, 10])
def test_relative_attention_matches_numpy(tmp_path, window, backend):
    cfg = _config(window)
    model = HybridModel(cfg, load_ops("xla"), dtype=jnp.float32, rngs=nnx.Rngs(7))
    # Larger relative tables than the initialiser's: the term must matter in the logits.
    for blk in (model.layers[0], model.layers[2]):
        blk.mixer.rel_table[...] = blk.mixer.rel_table[...] * 4
    save_converted(model, cfg, tmp_path / "ckpt", DEFAULT_MODEL, jnp.float32)
    ids = np.random.default_rng(3).integers(3, cfg.vocab_size, 40)
    runner = make_runner(str(tmp_path / "ckpt"), dtype="float32", tp=1, backend=backend,
                         cache=CacheConfig(num_pages=64), max_model_len=64)  # fmt: skip
    got = np.asarray(runner.sequence_logits(ids.tolist()), np.float64)
    want = _reference(model, cfg, ids)
    scale = np.abs(want).max()
    assert scale > 0.5, "weak test: near-constant logits"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # The relative term is not negligible: without it the logits move well past the tolerance.
    for blk in (model.layers[0], model.layers[2]):
        blk.mixer.rel_table[...] = jnp.zeros_like(blk.mixer.rel_table[...])
    assert np.abs(_reference(model, cfg, ids) - want).max() > 1e-2 * scale


def test_greedy_decoding_past_the_window_matches_numpy(tmp_path):
    # Decode well past the window of the sliding layer (its pages leave the window and are
    # freed) and past the last bucket start: every token equals numpy's greedy choice.
    cfg = _config(6)
    model = HybridModel(cfg, load_ops("xla"), dtype=jnp.float32, rngs=nnx.Rngs(8))
    save_converted(model, cfg, tmp_path / "ckpt", DEFAULT_MODEL, jnp.float32)
    prompt = np.random.default_rng(4).integers(3, cfg.vocab_size, 30).tolist()
    llm = LLM(str(tmp_path / "ckpt"), dtype="float32", max_model_len=128, progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = list(llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
               .outputs[0].token_ids)  # fmt: skip
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(np.argmax(_reference(model, cfg, np.asarray(seq))[-1])))
    assert got == seq[len(prompt) :]


def test_window_and_sliding_layers_come_together():
    d = _config(6).to_dict()
    d["attention"]["sliding_window"] = None
    with pytest.raises(ConfigError, match="sliding_attention layers need"):
        ModelConfig.from_dict(d)
    d = _config(None).to_dict()
    d["attention"]["sliding_window"] = 8
    with pytest.raises(ConfigError, match="needs sliding_attention layers"):
        ModelConfig.from_dict(d)
