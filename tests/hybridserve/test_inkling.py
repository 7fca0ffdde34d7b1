"""The tiny Inkling model (`inkling_models.tiny_inkling`) through the engine against the
independent numpy reference (`inkling_reference`), float32, within 1e-5 of the logit scale;
the image and audio encoders against the reference's hMLP and dMel."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from engine_shapes import INKLING
from flax import nnx

from hybridserve import LLM, SamplingParams
from hybridserve.config import CacheConfig
from hybridserve.runner.factory import make_runner
from hybridserve.runner.multimodal_prompt import multimodal_prompt
from tests.hybridserve.inkling_models import (
    AUDIO_TOKEN,
    IMAGE_TOKEN,
    build_inkling,
    save_inkling,
    tiny_inkling,
)
from tests.hybridserve.inkling_reference import (
    dmel_bins,
    dmel_reference,
    hmlp_reference,
    reference_logits,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_inkling()
    model = build_inkling(cfg)
    path = save_inkling(model, cfg, tmp_path_factory.mktemp("inkling") / "ckpt")
    return cfg, model, nnx.to_pure_dict(nnx.state(model)), path


def _ids(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """Random token ids, none of them a placeholder."""
    ids = rng.integers(7, vocab, n)
    assert IMAGE_TOKEN not in ids and AUDIO_TOKEN not in ids
    return ids


def test_prompt_logits_match_numpy(tiny):
    cfg, _, params, path = tiny
    ids = _ids(np.random.default_rng(0), 30, cfg.vocab_size)
    runner = make_runner(path, dtype="float32", cache=CacheConfig(num_pages=64), max_model_len=64)
    got = np.asarray(runner.sequence_logits(ids.tolist()), np.float64)
    want = reference_logits(params, cfg, ids)
    scale = np.abs(want).max()
    assert scale > 0.5, "weak test: near-constant logits"
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # The sconvs matter: without their taps the logits move well past the tolerance.
    no_conv = {
        **params,
        "layers": {
            i: {
                **blk,
                "sconv": {
                    s: {**c, "weight": np.zeros_like(c["weight"])} for s, c in blk["sconv"].items()
                },
            }
            for i, blk in params["layers"].items()
        },
    }
    assert np.abs(reference_logits(no_conv, cfg, ids) - want).max() > 1e-2 * scale


def test_greedy_decoding_matches_numpy(tiny):
    # A 20-token prompt and 10 decoded tokens: past the sliding window (6) and across the
    # 16-token page boundary; every token is numpy's greedy choice.
    cfg, _, params, path = tiny
    prompt = _ids(np.random.default_rng(1), 20, cfg.vocab_size).tolist()
    llm = LLM(path, **INKLING, progress=False)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    seq = list(prompt)
    for _ in range(10):
        last = reference_logits(params, cfg, np.asarray(seq))[-1]
        top2 = np.sort(last)[-2:]
        assert top2[1] - top2[0] > 1e-4 * np.abs(last).max(), "near tie: pick another prompt"
        seq.append(int(np.argmax(last)))
    assert got == seq[len(prompt) :]


def test_image_encoder_matches_numpy(tiny):
    cfg = tiny[0]
    model = build_inkling(cfg, seed=1)  # its own model: the shared one stays as saved
    rng = np.random.default_rng(2)
    # non-zero biases so that they are checked too
    for b in model.vision.biases:
        b[...] = jnp.asarray(rng.standard_normal(b[...].shape), jnp.float32)
    params = nnx.to_pure_dict(nnx.state(model))
    image = rng.standard_normal((8, 8, 3)).astype(np.float32)  # 4-pixel patches: 2 x 2
    got = np.asarray(model.embed_image(jnp.asarray(image)), np.float64)
    want = hmlp_reference(params, cfg, image)
    assert want.shape == (4, cfg.hidden_size)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # raster order: the patches are distinct and each depends only on its own pixels
    moved = image.copy()
    moved[:4, 4:] += 1.0  # the second patch (row 0, column 1)
    changed = np.abs(hmlp_reference(params, cfg, moved) - want).max(axis=1) > 1e-6
    assert changed.tolist() == [False, True, False, False]


@pytest.mark.parametrize("samples", [400, 417, 30])
def test_audio_encoder_matches_numpy(tiny, samples):
    cfg, model, params, _ = tiny
    rng = np.random.default_rng(samples)
    t = np.arange(samples) / cfg.audio.sample_rate
    envelope = np.linspace(0.02, 1.5, samples)  # quiet to loud: bins spread over the range
    wave = envelope * (np.sin(2 * np.pi * 700 * t) + 0.5 * rng.standard_normal(samples))
    wave = wave.astype(np.float32)
    bins = dmel_bins(cfg, wave)
    frames = max(1, -(-(samples - cfg.audio.n_fft) // cfg.audio.hop) + 1)
    assert bins.shape == (frames, cfg.audio.n_mels)
    np.testing.assert_array_equal(np.asarray(model.audio.bins(jnp.asarray(wave))), bins)
    if samples > 100:
        assert len(np.unique(bins)) >= 4, "weak test: the bins hardly vary"
    got = np.asarray(model.embed_audio(jnp.asarray(wave)), np.float64)
    want = dmel_reference(params, cfg, wave)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_reference_splices_embeddings_at_placeholders(tiny):
    # The multimodal path of the reference: image patches then audio frames at their
    # placeholders, in order; positions before the first placeholder are unaffected.
    cfg, _, params, _ = tiny
    rng = np.random.default_rng(3)
    images = [rng.standard_normal((8, 8, 3)), rng.standard_normal((4, 8, 3))]  # 4 + 2 patches
    wave = rng.standard_normal(192)  # 5 frames
    text = _ids(rng, 12, cfg.vocab_size).tolist()
    ids = np.asarray(text[:4] + [IMAGE_TOKEN] * 6 + text[4:8] + [AUDIO_TOKEN] * 5 + text[8:])
    got = reference_logits(params, cfg, ids, images=images, audios=[wave])
    plain = reference_logits(params, cfg, ids)
    assert got.shape == (len(ids), cfg.vocab_size)
    np.testing.assert_allclose(got[:4], plain[:4], rtol=0, atol=1e-12)
    assert np.abs(got[4:] - plain[4:]).max() > 1e-2 * np.abs(plain).max()
    # the embeddings are what reaches the blocks: swapping the images changes the logits
    swapped = reference_logits(params, cfg, ids, images=images[::-1], audios=[wave])
    assert np.abs(swapped[4:] - got[4:]).max() > 1e-2 * np.abs(got).max()
    with pytest.raises(AssertionError, match="placeholders for"):
        reference_logits(params, cfg, ids, images=images + images[:1], audios=[wave])


def test_multimodal_prompt_logits_match_numpy(tmp_path):
    # Two images (6 and 4 patches) and a waveform (9 frames) spliced into a text prompt, one
    # placeholder per item expanded by the engine: the engine's prompt logits equal the numpy
    # reference, which embeds the inputs itself (hMLP, dMel) and splices them in order.
    cfg = tiny_inkling()
    model = build_inkling(cfg, seed=2)
    rng = np.random.default_rng(5)
    for b in model.vision.biases:
        b[...] = jnp.asarray(0.3 * rng.normal(size=b[...].shape), jnp.float32)
    path = save_inkling(model, cfg, tmp_path / "ckpt")
    params = nnx.to_pure_dict(nnx.state(model))
    runner = make_runner(path, dtype="float32", cache=CacheConfig(num_pages=64), max_model_len=64)
    images = [rng.normal(size=(8, 12, 3)).astype(np.float32), rng.random((8, 8, 3), np.float32)]
    wave = rng.normal(size=300).astype(np.float32)
    text = _ids(rng, 9, cfg.vocab_size).tolist()
    ids = text[:3] + [IMAGE_TOKEN] + text[3:5] + [AUDIO_TOKEN, IMAGE_TOKEN] + text[5:]
    full, mm = multimodal_prompt(
        ids, {"image": images, "audio": [wave]}, cfg, runner.embed_multimodal
    )
    assert len(full) == 9 + 6 + 4 + 9
    got = np.asarray(runner.sequence_logits(full, mm), np.float64)
    want = reference_logits(params, cfg, np.asarray(full), images=images, audios=[wave])
    scale = np.abs(want).max()
    assert scale > 0.5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # the inputs matter: the same prompt with the placeholders' own token embeddings differs
    plain = np.asarray(runner.sequence_logits(full), np.float64)
    assert np.abs(plain - want).max() > 1e-2 * scale
