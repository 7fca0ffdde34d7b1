"""A plain-numpy (float64) reference of the Inkling model, written from the docstrings of
`models.hybrid`, `layers.sconv`, `layers.attention`, `layers.moe`, `layers.norm`,
`layers.multimodal` and `config.layers`; it calls no model code. `params` is
`nnx.to_pure_dict(nnx.state(model))`.

Per block (r the residual multiplier; sc_* the short convs of `width` taps):
  x = norm(h);  k, v = sc_kv([x W_k, x W_v]);  h += r * sc_out(o_proj(attention(x W_q, k, v)))
  h += r * sc_ffn(moe(ffn_norm(h)))
Supported: NoPE GQA attention (full or sliding), the relative term, the expert-sink MoE with
dense experts, no projection biases, no latent projection (anything else raises)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hybridserve.config import ModelConfig


def _f64(a) -> np.ndarray:
    return np.asarray(a, np.float64)


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU."""
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def _act(name: str, x: np.ndarray) -> np.ndarray:
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    if name == "relu2":
        return np.maximum(x, 0.0) ** 2
    if name == "relu":
        return np.maximum(x, 0.0)
    if name == "gelu":
        return _gelu(x)
    raise ValueError(name)


def _bucket(dist: np.ndarray, buckets: int, exact: int, max_dist: int) -> np.ndarray:
    """From the definition: distances below `exact` exact; then `buckets - exact` starts spaced
    geometrically from `exact` to `max_dist` (rounded, strictly increasing); the last open."""
    starts = list(range(exact))
    n_log = buckets - exact
    for i in range(n_log):
        start = round(exact * (max_dist / exact) ** (i / max(n_log - 1, 1)))
        starts.append(max(start, starts[-1] + 1))
    return np.searchsorted(np.array(starts), np.maximum(dist, 0), side="right") - 1


def _rms_norm(x: np.ndarray, w, eps: float) -> np.ndarray:
    return _f64(w) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _sconv(u: np.ndarray, p: dict) -> np.ndarray:
    """`y[t, c] = sum_{j < W} w[c, j] u[t - (W - 1) + j, c] + b[c]`, u before 0 zero."""
    w = _f64(p["weight"])  # [C, W]
    width = w.shape[1]
    t = u.shape[0]
    padded = np.concatenate([np.zeros((width - 1, u.shape[1])), u])
    y = sum(w[:, j] * padded[j : j + t] for j in range(width))
    return y + _f64(p["bias"]) if p.get("bias") is not None else y


def _attention(x: np.ndarray, m: dict, cfg: ModelConfig, window: int | None, kv_conv) -> np.ndarray:
    att = cfg.attention
    n, kv, hd = att.num_heads, att.num_kv_heads, att.head_dim
    t = x.shape[0]
    q = np.einsum("td,dnh->tnh", x, _f64(m["q_proj"]["kernel"]))
    k = np.einsum("td,dkh->tkh", x, _f64(m["k_proj"]["kernel"]))
    v = np.einsum("td,dkh->tkh", x, _f64(m["v_proj"]["kernel"]))
    kvc = kv_conv(np.concatenate([k.reshape(t, -1), v.reshape(t, -1)], axis=-1))
    k, v = kvc[:, : kv * hd].reshape(t, kv, hd), kvc[:, kv * hd :].reshape(t, kv, hd)
    dist = np.arange(t)[:, None] - np.arange(t)[None, :]
    visible = dist >= 0
    if window is not None:
        visible &= dist < window
    rel = None
    if att.rel_dim is not None:
        r = np.einsum("td,dnr->tnr", x, _f64(m["r_proj"]["kernel"]))
        buckets = _bucket(dist, att.rel_buckets, att.rel_exact, att.rel_max_distance)
        rel = (r, _f64(m["rel_table"]), buckets)
    out = np.zeros((t, n, hd))
    for head in range(n):
        g = head // (n // kv)
        logits = att.softmax_scale * q[:, head] @ k[:, g].T
        if rel is not None:
            r, table, buckets = rel
            logits = logits + np.take_along_axis(r[:, head] @ table.T, buckets, axis=1)
        logits = np.where(visible, logits, -np.inf)
        w = np.exp(logits - logits.max(1, keepdims=True))
        out[:, head] = (w / w.sum(1, keepdims=True)) @ v[:, g]
    return np.einsum("tnh,nhd->td", out, _f64(m["o_proj"]["kernel"]))


def _moe_sink(u: np.ndarray, p: dict, cfg: ModelConfig) -> np.ndarray:
    """p = softmax(u W_r) over E routed + S shared; top-k routed weighted by p (no renorm);
    every shared expert weighted by its p."""
    mc = cfg.moe
    e = mc.num_experts
    logits = u @ _f64(p["router"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)

    def expert(x, up, gate, down):
        h = x @ _f64(up)
        h = _act(mc.activation, x @ _f64(gate)) * h if gate is not None else _act(mc.activation, h)
        return h @ _f64(down)

    out = np.zeros_like(u)
    gate, sgate = p.get("gate"), p.get("sink_gate")
    for i in range(u.shape[0]):
        top = np.argsort(-probs[i, :e], kind="stable")[: mc.top_k]
        for j in top:
            g = None if gate is None else gate[j]
            out[i] += probs[i, j] * expert(u[i], p["up"][j], g, p["down"][j])
        for s in range(mc.num_shared_experts):
            g = None if sgate is None else sgate[s]
            out[i] += probs[i, e + s] * expert(u[i], p["sink_up"][s], g, p["sink_down"][s])
    return out


def hmlp_reference(params: dict, cfg: ModelConfig, image: np.ndarray) -> np.ndarray:
    """Image [H, W, C] -> patch embeddings [H/P * W/P, D] in raster order: stage 0 a linear map
    (+ gelu) of each s x s x C sub-patch flattened (row, column, channel); stage i of each 2 x 2
    group of stage i-1 cells flattened (row, column, feature); no gelu after the last."""
    vp, s = params["vision"], cfg.vision.sub_patch
    ws = [_f64(vp["weights"][i]) for i in range(len(vp["weights"]))]
    bs = [_f64(vp["biases"][i]) for i in range(len(vp["biases"]))]
    last = len(ws) - 1
    img = _f64(image)

    def cell(level: int, r: int, c: int) -> np.ndarray:
        if level == 0:
            x = img[r * s : (r + 1) * s, c * s : (c + 1) * s, :].reshape(-1)
        else:
            x = np.concatenate(
                [cell(level - 1, 2 * r + dr, 2 * c + dc) for dr in (0, 1) for dc in (0, 1)]
            )
        y = x @ ws[level] + bs[level]
        return y if level == last else _gelu(y)

    patch = cfg.vision.patch
    rows, cols = img.shape[0] // patch, img.shape[1] // patch
    assert rows * patch == img.shape[0] and cols * patch == img.shape[1], "whole patches only"
    return np.stack([cell(last, r, c) for r in range(rows) for c in range(cols)])


def mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """HTK mel triangles [n_fft // 2 + 1, n_mels], edges equally spaced in mel from 0 Hz to
    sample_rate / 2; the rfft bin k sits at k * sample_rate / n_fft Hz."""
    top = 2595.0 * math.log10(1.0 + (sample_rate / 2) / 700.0)
    edges = [700.0 * (10.0 ** (top * i / (n_mels + 1) / 2595.0) - 1.0) for i in range(n_mels + 2)]
    bank = np.zeros((n_fft // 2 + 1, n_mels))
    for k in range(n_fft // 2 + 1):
        f = k * sample_rate / n_fft
        for m in range(n_mels):
            lo, mid, hi = edges[m], edges[m + 1], edges[m + 2]
            if lo <= f <= mid:
                bank[k, m] = (f - lo) / (mid - lo)
            elif mid < f <= hi:
                bank[k, m] = (hi - f) / (hi - mid)
    return bank


def dmel_bins(cfg: ModelConfig, wave: np.ndarray) -> np.ndarray:
    """The discretised log-mel channels [frames, n_mels] of a waveform: frames of n_fft samples
    every hop (zero-padded at the end to whole frames, at least one), Hann window, |rfft|^2,
    mel filters, log(mel + 1e-6), `mel_bins` equal bins over mel_range (clipped)."""
    a = cfg.audio
    wave = _f64(wave)
    frames = max(1, -(-(len(wave) - a.n_fft) // a.hop) + 1)
    padded = np.zeros(max((frames - 1) * a.hop + a.n_fft, len(wave)))
    padded[: len(wave)] = wave
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(a.n_fft) / a.n_fft)
    chunks = np.stack([padded[i * a.hop : i * a.hop + a.n_fft] for i in range(frames)])
    power = np.abs(np.fft.rfft(chunks * hann, axis=-1)) ** 2
    logmel = np.log(power @ mel_filters(a.sample_rate, a.n_fft, a.n_mels) + 1e-6)
    lo, hi = a.mel_range
    width = (hi - lo) / a.mel_bins
    return np.clip(np.floor((logmel - lo) / width), 0, a.mel_bins - 1).astype(np.int64)


def dmel_reference(params: dict, cfg: ModelConfig, wave: np.ndarray) -> np.ndarray:
    """Waveform [S] -> frame embeddings [frames, D]: `sum_c E[c, bin_c]`."""
    bins = dmel_bins(cfg, wave)
    table = _f64(params["audio"]["table"])
    return np.stack([sum(table[c, b[c]] for c in range(len(b))) for b in bins])


def reference_logits(
    params: dict,
    cfg: ModelConfig,
    tokens: np.ndarray,
    images: Sequence[np.ndarray] = (),
    audios: Sequence[np.ndarray] = (),
) -> np.ndarray:
    """Tokens [T] -> logits [T, V]. The prompt holds one placeholder per image patch / audio
    frame: the i-th embedding of a kind (items in order) replaces the i-th placeholder's token
    embedding (as the engine does; placeholders past those, e.g. decoded ones, stay tokens)."""
    att, mc = cfg.attention, cfg.moe
    assert att is not None and att.rope_theta is None and not att.bias, "NoPE, no biases only"
    assert cfg.ffn == "moe" and mc.router == "softmax_sink" and mc.expert_format == "dense"
    assert not mc.bias and not mc.latent_size and cfg.sconv is not None
    tokens = np.asarray(tokens)
    h = _f64(params["embed"])[tokens] * cfg.embedding_multiplier
    inserts = []
    if cfg.vision is not None:
        inserts.append(
            (cfg.vision.placeholder_id, [hmlp_reference(params, cfg, i) for i in images])
        )
    if cfg.audio is not None:
        inserts.append((cfg.audio.placeholder_id, [dmel_reference(params, cfg, w) for w in audios]))
    assert (not images or cfg.vision) and (not audios or cfg.audio), "no encoder for inputs"
    for placeholder, embeds in inserts:  # the i-th embedding at the i-th placeholder
        at = np.flatnonzero(tokens == placeholder)
        stacked = np.concatenate(embeds) if embeds else np.zeros((0, h.shape[1]))
        assert len(stacked) <= len(at), f"{len(at)} placeholders for {len(stacked)} embeddings"
        h[at[: len(stacked)]] = stacked  # later ones (decoded tokens) keep the token embedding
    r = cfg.residual_multiplier
    for i, kind in enumerate(cfg.layer_types):
        blk = params["layers"][i]
        sc = blk["sconv"]
        assert kind in ("attention", "sliding_attention"), kind
        x = _rms_norm(h, blk["norm"]["weight"], cfg.norm_eps)
        window = att.sliding_window if kind == "sliding_attention" else None
        y = _attention(x, blk["mixer"], cfg, window, lambda u, sc=sc: _sconv(u, sc["kv"]))
        h = h + r * _sconv(y, sc["out"])
        u = _rms_norm(h, blk["ffn_norm"]["weight"], cfg.norm_eps)
        h = h + r * _sconv(_moe_sink(u, blk["ffn"], cfg), sc["ffn"])
    h = _rms_norm(h, params["norm_f"]["weight"], cfg.norm_eps)
    head = params.get("lm_head")
    w = _f64(params["embed"]).T if head is None else _f64(head)
    return h @ w / cfg.logits_scaling
