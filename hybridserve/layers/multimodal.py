"""Multimodal inputs: an hMLP patch stem for images, dMel embeddings for audio, and the splice of
their embeddings into the token stream.

hMLP image stem (patch P = s * 2^m pixels, s the first sub-patch, m the merges). An image
[H, W, C] (H, W multiples of P, values as given) becomes H/P * W/P tokens in raster order:
  stage 0: every s x s x C sub-patch, flattened (row, column, channel), `h0 = gelu(x W_0 + b_0)`;
  stage i = 1 .. m: every 2 x 2 group of stage i-1 cells, flattened (row, column, feature),
    `h_i = gelu(x W_i + b_i)`, except the last stage, which has no activation (width D).
So each layer is a linear map over a progressively larger sub-patch (s, 2s, ..., P pixels).

dMel audio (waveform at `sample_rate`, mono). Frames of `n_fft` samples every `hop` (the
waveform zero-padded at the end to whole frames), Hann window, power spectrum `|rfft|^2`, an
HTK mel filterbank of `n_mels` triangles between 0 Hz and the Nyquist frequency, then
`v = log(mel + 1e-6)`. Each channel c is discretised into `mel_bins` equal bins over
[mel_min, mel_max] (clipped): `bin_c = clip(floor((v_c - mel_min) / width), 0, bins - 1)`, and
the frame's embedding is `sum_c E[c, bin_c]` (E [n_mels, bins, D]): one token per frame.

Splice: the prompt holds one placeholder token per embedding; `splice` puts the i-th
embedding at the i-th placeholder position (in order), other positions keep their token
embedding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybridserve.layers.linear import param


class HmlpPatchEncoder(nnx.Module):
    """Image [H, W, C] -> [H/P * W/P, D] tokens (see the module docstring)."""

    def __init__(
        self,
        channels: int,
        sub_patch: int,
        widths: tuple[int, ...],
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        """`widths`: the output width of stage 0 .. m (the last is the model width D)."""
        self.sub_patch, self.merges = sub_patch, len(widths) - 1
        fan_ins = [sub_patch * sub_patch * channels] + [4 * w for w in widths[:-1]]
        shapes = list(zip(fan_ins, widths, strict=True))
        self.weights = nnx.List([param(rngs, s, (None, None), dtype, fan_in=s[0]) for s in shapes])
        self.biases = nnx.List([param(None, (o,), (None,), dtype, init="zeros") for o in widths])

    @property
    def patch(self) -> int:
        return self.sub_patch * 2**self.merges

    def __call__(self, image: jax.Array) -> jax.Array:
        h, w, c = image.shape
        if h % self.patch or w % self.patch:
            raise ValueError(f"image {h}x{w} is not a whole number of {self.patch}-pixel patches")
        s = self.sub_patch
        # cells [H/s, W/s, s*s*C]: each sub-patch flattened (row, column, channel)
        x = image.reshape(h // s, s, w // s, s, c).transpose(0, 2, 1, 3, 4)
        x = x.reshape(h // s, w // s, s * s * c)
        for i, (wt, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            if i > 0:  # merge 2 x 2 cells, flattened (row, column, feature)
                gh, gw, f = x.shape
                x = x.reshape(gh // 2, 2, gw // 2, 2, f).transpose(0, 2, 1, 3, 4)
                x = x.reshape(gh // 2, gw // 2, 4 * f)
            x = x @ wt[...] + b[...]
            if i < self.merges:
                x = jax.nn.gelu(x, approximate=False)
        return x.reshape(-1, x.shape[-1])


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    """HTK mel triangles [n_fft // 2 + 1, n_mels] between 0 Hz and sample_rate / 2."""
    mel = lambda f: 2595.0 * np.log10(1.0 + f / 700.0)  # noqa: E731
    hz = lambda m: 700.0 * (10.0 ** (m / 2595.0) - 1.0)  # noqa: E731
    edges = hz(np.linspace(mel(0.0), mel(sample_rate / 2), n_mels + 2))
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    lo, mid, hi = edges[:-2], edges[1:-1], edges[2:]
    up = (freqs[:, None] - lo) / (mid - lo)
    down = (hi - freqs[:, None]) / (hi - mid)
    return np.maximum(0.0, np.minimum(up, down)).astype(np.float32)


class DmelEncoder(nnx.Module):
    """Waveform [S] -> [frames, D] tokens (see the module docstring)."""

    def __init__(
        self,
        hidden: int,
        *,
        sample_rate: int,
        n_fft: int,
        hop: int,
        n_mels: int,
        mel_bins: int,
        mel_range: tuple[float, float],
        dtype: jnp.dtype,
        rngs: nnx.Rngs | None,
    ) -> None:
        self.n_fft, self.hop, self.mel_bins, self.mel_range = n_fft, hop, mel_bins, mel_range
        self.sample_rate, self.n_mels = sample_rate, n_mels
        self.table = param(rngs, (n_mels, mel_bins, hidden), (None, None, "embed"), dtype, 1)

    def frames(self, wave: jax.Array) -> int:
        """Tokens for a waveform of `len(wave)` samples."""
        return max(1, math.ceil((wave.shape[0] - self.n_fft) / self.hop) + 1)

    def bins(self, wave: jax.Array) -> jax.Array:
        """The discretised log-mel channels [frames, n_mels] int32."""
        n = self.frames(wave)
        total = (n - 1) * self.hop + self.n_fft
        wave = jnp.pad(wave.astype(jnp.float32), (0, max(total - wave.shape[0], 0)))
        idx = jnp.arange(n)[:, None] * self.hop + jnp.arange(self.n_fft)[None, :]
        window = 0.5 - 0.5 * jnp.cos(2 * jnp.pi * jnp.arange(self.n_fft) / self.n_fft)
        power = jnp.abs(jnp.fft.rfft(wave[idx] * window, axis=-1)) ** 2
        filters = jnp.asarray(mel_filterbank(self.sample_rate, self.n_fft, self.n_mels))
        logmel = jnp.log(power @ filters + 1e-6)
        lo, hi = self.mel_range
        width = (hi - lo) / self.mel_bins
        return jnp.clip(jnp.floor((logmel - lo) / width), 0, self.mel_bins - 1).astype(jnp.int32)

    def __call__(self, wave: jax.Array) -> jax.Array:
        bins = self.bins(wave)  # [F, M]
        channels = jnp.arange(bins.shape[1])[None, :]
        return self.table[...][channels, bins].sum(axis=1)  # [F, D]


def splice(embeds: jax.Array, tokens: jax.Array, placeholder: int, inserts: jax.Array) -> jax.Array:
    """Put `inserts` [N, D] at the positions of `placeholder` in `tokens` [T] (in order), over
    the token embeddings `embeds` [T, D]. The number of placeholders must be N."""
    at = tokens == placeholder
    order = jnp.clip(jnp.cumsum(at) - 1, 0, max(inserts.shape[0] - 1, 0))
    return jnp.where(at[:, None], inserts[order].astype(embeds.dtype), embeds)
