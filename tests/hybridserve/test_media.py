"""`hybridserve.media` and `hybridserve.chat_prompt` without an engine: WAV and image decoding
against numpy on the values written, the errors a client can cause, and where the template puts
the media."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
from PIL import Image

from hybridserve import media
from hybridserve.chat_prompt import render_chat
from hybridserve.chat_template import ChatTemplate
from tests.hybridserve.inkling_models import AUDIO_TOKEN, IMAGE_TOKEN, tiny_inkling


def _wav(samples: np.ndarray, width: int, rate: int = 8000, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(channels), f.setsampwidth(width), f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return out.getvalue()


def _png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_wav_samples_of_every_width_scale_to_one(width):
    rng = np.random.default_rng(width)
    bits = 8 * width
    values = rng.integers(-(2 ** (bits - 1)), 2 ** (bits - 1), 257)
    if width == 1:  # unsigned, offset 128
        raw = (values + 128).astype(np.uint8)
    elif width == 3:  # little-endian 3-byte words
        raw = (values.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3]).copy()
    else:
        raw = values.astype(f"<i{width}")
    got = media.wav_waveform(_wav(raw, width), 8000)
    np.testing.assert_allclose(got, values / 2.0 ** (bits - 1), atol=1e-7)


def test_stereo_wav_is_averaged_and_rate_checked():
    rng = np.random.default_rng(1)
    left, right = rng.integers(-3000, 3000, (2, 100)).astype(np.int16)
    frames = np.stack([left, right], axis=1).reshape(-1)
    got = media.wav_waveform(_wav(frames, 2, channels=2), 8000)
    np.testing.assert_allclose(got, (left / 32768 + right / 32768) / 2, atol=1e-7)
    with pytest.raises(ValueError, match="sampled at 8000 Hz; this model takes 16000"):
        media.wav_waveform(_wav(frames, 2, channels=2), 16000)
    with pytest.raises(ValueError, match="not a PCM WAV"):
        media.wav_waveform(b"RIFF....not a wav", 8000)


@pytest.mark.parametrize("channels,mode", [(3, "RGB"), (1, "L"), (4, "RGBA")])
def test_images_become_unit_pixels(channels, mode):
    rng = np.random.default_rng(channels)
    shape = (6, 10) if channels == 1 else (6, 10, channels)
    pixels = rng.integers(0, 256, shape, dtype=np.uint8)
    got = media.image_array(_png(pixels, mode), channels)
    assert got.shape == (6, 10, channels) and got.dtype == np.float32
    np.testing.assert_array_equal(got.reshape(shape), pixels / np.float32(255))
    rgb = media.image_array(Image.fromarray(pixels, mode), 3)  # a PIL image, converted
    assert rgb.shape == (6, 10, 3)


def test_bad_images_and_urls_are_value_errors():
    with pytest.raises(ValueError, match="cannot be read"):
        media.image_array(b"\x89PNG broken", 3)
    with pytest.raises(ValueError, match="does not fetch URLs"):
        media.data_url_bytes("http://example.com/a.png", "image")
    with pytest.raises(ValueError, match="must be base64"):
        media.data_url_bytes("data:image/png,abc", "image")
    with pytest.raises(ValueError, match="is not an image"):
        media.data_url_bytes("data:text/plain;base64,YWJj", "image")
    with pytest.raises(ValueError, match="not valid base64"):
        media.data_url_bytes("data:image/png;base64,@@@", "image")


def test_chat_media_become_placeholders_where_they_stand():
    cfg = tiny_inkling()
    png = base64.b64encode(_png(np.zeros((4, 8, 3), np.uint8))).decode()
    wav = base64.b64encode(_wav(np.ones(80, np.int16), 2)).decode()
    parts = [
        {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}},
        {"type": "text", "text": "between"},
        {"type": "image_url", "image_url": "data:image/png;base64," + png},
    ]
    chat = render_chat([{"role": "user", "content": parts}], ChatTemplate(None), cfg)
    assert chat.pieces == ("user: ", "\nbetween\n", "\nassistant:")
    assert [kind for kind, _ in chat.media] == ["audio", "image"]
    ids = chat.token_ids(lambda piece, first: [len(piece), int(first)])
    assert ids == [6, 1, AUDIO_TOKEN, 9, 0, IMAGE_TOKEN, 11, 0]
    data = chat.multi_modal_data()
    assert data["image"][0].shape == (4, 8, 3) and data["audio"][0].shape == (80,)
    dropping = ChatTemplate("{{ messages[0]['role'] }}")  # writes no content
    with pytest.raises(ValueError, match="kept media parts"):
        render_chat([{"role": "user", "content": parts}], dropping, cfg)
    with pytest.raises(ValueError, match="unknown content part 'video'"):
        render_chat([{"role": "user", "content": [{"type": "video"}]}], ChatTemplate(None), cfg)
    text_cfg = cfg.__class__.from_dict({**cfg.to_dict(), "vision": None})
    with pytest.raises(ValueError, match="takes no images"):
        render_chat([{"role": "user", "content": parts[2:]}], ChatTemplate(None), text_cfg)
