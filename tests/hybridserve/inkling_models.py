"""A tiny Inkling config and checkpoint for the tests (float32, random weights)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from backends.protocol import load_ops
from hybridserve.config import ModelConfig
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.models.hybrid import HybridModel
from hybridserve.weights.loader import read_config, save_converted

IMAGE_TOKEN, AUDIO_TOKEN = 5, 6


def tiny_inkling(
    window: int = 6, hidden: int = 48, nvfp4: bool = False, kv_heads: int = 2
) -> ModelConfig:
    """full, sliding, full attention (GQA, NoPE, relative term), an expert-sink MoE ffn, four
    sconvs of width 4 per block, an hMLP image stem and dMel audio. hidden 48 over sconv
    entries of 32 channels: the out/ffn sites span two entries, the second half padding.
    `kv_heads` (2 or 4) of the 4 query heads."""
    d = read_config(DEFAULT_MODEL).to_dict()
    d.update(
        architecture="inkling",
        hidden_size=hidden,
        layer_types=["attention", "sliding_attention", "attention"],
        ffn="moe",
        mamba=None,
        mlp=None,
        tie_word_embeddings=False,
        dtype="float32",
    )
    d["attention"] = dict(num_heads=4, num_kv_heads=kv_heads, head_dim=8, rope_theta=None,
                          rotary_dim=None, sliding_window=window, rel_dim=4, rel_buckets=8,
                          rel_exact=4, rel_max_distance=20)  # fmt: skip
    d["moe"] = dict(num_experts=8, top_k=2, intermediate_size=32, router="softmax_sink",
                    activation="silu", gated=True, shared_intermediate_size=32,
                    num_shared_experts=2, expert_format="nvfp4" if nvfp4 else "dense")  # fmt: skip
    d["sconv"] = dict(width=4, bias=True)
    d["vision"] = dict(placeholder_id=IMAGE_TOKEN, sub_patch=2, widths=[16, hidden], channels=3)
    d["audio"] = dict(placeholder_id=AUDIO_TOKEN, sample_rate=8000, n_fft=64, hop=32, n_mels=8,
                      mel_bins=6, mel_range=[-6.0, 4.0])  # fmt: skip
    return ModelConfig.from_dict(d)


def build_inkling(cfg: ModelConfig, seed: int = 0) -> HybridModel:
    """Random weights; sconv taps and biases made large enough to matter."""
    model = HybridModel(cfg, load_ops("xla"), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    rng = nnx.Rngs(seed + 100)
    for blk in model.layers:
        for conv in (blk.sconv or {}).values():
            conv.weight[...] = 0.5 * jax_normal(rng, conv.weight[...].shape)
            conv.bias[...] = 0.1 * jax_normal(rng, conv.bias[...].shape)
        blk.mixer.rel_table[...] = blk.mixer.rel_table[...] * 4
    return model


def jax_normal(rngs: nnx.Rngs, shape: tuple[int, ...]):
    import jax

    return jax.random.normal(rngs.params(), shape, jnp.float32)


def save_inkling(model: HybridModel, cfg: ModelConfig, path: Path) -> str:
    save_converted(model, cfg, path, DEFAULT_MODEL, jnp.float32)
    return str(path)


def one_pass_greedy(runner, ids: list[int], n: int, mm=None) -> list[int]:
    """`n` greedy tokens after `ids`, each the argmax of one-pass logits of the whole sequence
    so far (`runner.sequence_logits`: no paged decode, no batching; `mm` its multimodal
    embeddings): the reference for what the engine generates."""
    import numpy as np

    seq = list(ids)
    for _ in range(n):
        logits = np.asarray(runner.sequence_logits(seq, mm))
        seq.append(int(np.argmax(logits[-1])))
    return seq[len(ids) :]


def emulating_heads(model: HybridModel) -> None:
    """Set every MTP head of a one-block Inkling (full attention, no sconv) to the weights that
    training it to predict the base model converges to here: the base block itself, reading
    the look-ahead token's embedding. Head i at position t, fed E[x_{t+i+1}], attends over its
    own cache, whose entry at s was computed from x_{s+i+1}: so it computes the base model at
    position t + i + 1 but for the first i + 1 tokens of the sequence (outside its cache), and
    its logits are the base model's next-token logits up to that. Concretely, in place:
      embedding rows rescaled to one RMS rho (so norm_e(E[x]) = E[x] with norm_e's weight = rho)
      W_i = [0 ; I] (the hidden half unused), Block_i = the base block, norm_o = norm_f"""
    cfg = model.config
    base = model.layers[0]
    assert cfg.num_layers == 1 and base.sconv is None and base.kind == "attention", cfg
    e = model.embed[...]
    rms = jnp.sqrt(jnp.mean(e * e, axis=-1, keepdims=True))
    model.embed[...] = e / rms * jnp.mean(rms)
    rho = jnp.mean(rms) * cfg.embedding_multiplier
    d = cfg.hidden_size
    weights = nnx.state(base, nnx.Param)
    for head in model.mtp:
        nnx.update(head.block, weights)
        head.proj[...] = jnp.concatenate([jnp.zeros((d, d)), jnp.eye(d)]).astype(e.dtype)
        head.norm_e.weight[...] = jnp.full((d,), rho, e.dtype)
        head.norm_o.weight[...] = model.norm_f.weight[...]
