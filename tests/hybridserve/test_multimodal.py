"""Image (hMLP stem) and audio (dMel) encoders and the splice, against numpy written from the
module docstring (float32 inputs, float64 references, 1e-5 of the output scale)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybridserve.layers.multimodal import DmelEncoder, HmlpPatchEncoder, splice


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def test_hmlp_stem_matches_numpy():
    enc = HmlpPatchEncoder(3, 2, (6, 10, 8), dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    for b in enc.biases:  # non-zero biases, so that they are checked too
        b[...] = jnp.asarray(rng.standard_normal(b[...].shape), jnp.float32)
    image = rng.standard_normal((16, 24, 3)).astype(np.float32)  # patches of 8: 2 x 3 of them
    got = np.asarray(enc(jnp.asarray(image)), np.float64)
    ws = [np.asarray(w[...], np.float64) for w in enc.weights]
    bs = [np.asarray(b[...], np.float64) for b in enc.biases]

    def cell(level, r, c):
        if level == 0:
            x = image[2 * r : 2 * r + 2, 2 * c : 2 * c + 2, :].astype(np.float64).reshape(-1)
        else:
            parts = [cell(level - 1, 2 * r + dr, 2 * c + dc) for dr in (0, 1) for dc in (0, 1)]
            x = np.concatenate(parts)
        y = x @ ws[level] + bs[level]
        return y if level == 2 else _gelu(y)

    want = np.stack([cell(2, r, c) for r in range(2) for c in range(3)])
    assert got.shape == (6, 8)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="8-pixel patches"):
        enc(jnp.ones((12, 16, 3)))


def _mel_reference(sr, n_fft, n_mels):
    def to_mel(f):
        return 2595 * np.log10(1 + f / 700)

    def to_hz(m):
        return 700 * (10 ** (m / 2595) - 1)

    pts = to_hz(np.linspace(0, to_mel(sr / 2), n_mels + 2))
    bank = np.zeros((n_fft // 2 + 1, n_mels))
    for j, f in enumerate(np.linspace(0, sr / 2, n_fft // 2 + 1)):
        for m in range(n_mels):
            lo, mid, hi = pts[m], pts[m + 1], pts[m + 2]
            bank[j, m] = max(0.0, min((f - lo) / (mid - lo), (hi - f) / (hi - mid)))
    return bank


def test_dmel_matches_numpy():
    sr, n_fft, hop, n_mels, bins, lo, hi = 8000, 64, 32, 12, 10, -8.0, 6.0
    enc = DmelEncoder(16, sample_rate=sr, n_fft=n_fft, hop=hop, n_mels=n_mels, mel_bins=bins,
                      mel_range=(lo, hi), dtype=jnp.float32, rngs=nnx.Rngs(2))  # fmt: skip
    rng = np.random.default_rng(3)
    t = np.arange(1000) / sr
    wave = (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(1000)).astype(np.float32)
    frames = math.ceil((1000 - n_fft) / hop) + 1
    padded = np.pad(wave.astype(np.float64), (0, (frames - 1) * hop + n_fft - 1000))
    hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n_fft) / n_fft)
    spec = np.stack([np.abs(np.fft.rfft(padded[f * hop : f * hop + n_fft] * hann)) ** 2
                     for f in range(frames)])  # fmt: skip
    logmel = np.log(spec @ _mel_reference(sr, n_fft, n_mels) + 1e-6)
    scaled = (logmel - lo) / ((hi - lo) / bins)
    want_bins = np.clip(np.floor(scaled), 0, bins - 1).astype(int)
    got_bins = np.asarray(enc.bins(jnp.asarray(wave)))
    assert got_bins.shape == (frames, n_mels) and enc.frames(jnp.asarray(wave)) == frames
    near_edge = np.abs(scaled - np.round(scaled)) < 1e-3  # float32 may round across an edge
    assert (got_bins == want_bins)[~near_edge].all()
    assert len(np.unique(want_bins)) > 3, "weak test: few distinct bins"
    table = np.asarray(enc.table[...], np.float64)
    want = table[np.arange(n_mels)[None, :], want_bins].sum(1)
    got = np.asarray(enc(jnp.asarray(wave)), np.float64)
    rows = ~near_edge.any(1)
    assert rows.sum() > frames // 2
    np.testing.assert_allclose(got[rows], want[rows], rtol=0, atol=1e-5 * np.abs(want).max())


def test_splice_puts_the_inserts_at_the_placeholders_in_order():
    tokens = jnp.asarray([5, 9, 9, 7, 9, 3])
    embeds = jnp.arange(6 * 4, dtype=jnp.float32).reshape(6, 4)
    inserts = -jnp.arange(3 * 4, dtype=jnp.float32).reshape(3, 4) - 1
    got = np.asarray(jax.jit(splice, static_argnums=2)(embeds, tokens, 9, inserts))
    np.testing.assert_array_equal(got[[0, 3, 5]], np.asarray(embeds)[[0, 3, 5]])
    np.testing.assert_array_equal(got[[1, 2, 4]], np.asarray(inserts))
