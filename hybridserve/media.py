"""Images and audio as the model's encoders take them, from what clients send.

  * an image (a PIL image, or the bytes of a PNG / JPEG / ... file, or a `data:image/...;base64,`
    URL) becomes a float32 array [H, W, C] with values in [0, 1] (8-bit channels / 255), C the
    vision config's `channels` (3: RGB, 1: grayscale, 4: RGBA);
  * audio (the bytes of a PCM WAV file, or their base64 text) becomes a mono float32 waveform in
    [-1, 1] (channels averaged), at the sample rate the file states, which must be the audio
    config's `sample_rate`.
Every malformed input is a ValueError that says what was expected. Images are checked from their
header before any pixel is decoded (`MAX_IMAGE_PIXELS`).
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from typing import Any

import numpy as np

MAX_IMAGE_PIXELS = 64 * 2**20  # 8192 x 8192: larger images are refused before decoding
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def b64_bytes(text: str, what: str) -> bytes:
    """The bytes of base64 `text` (ValueError naming `what` when it is not base64)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{what} is not valid base64: {err}") from err


def data_url_bytes(url: str, kind: str) -> bytes:
    """The payload of a `data:<kind>/...;base64,<data>` URL; other URLs are refused (the
    server fetches nothing: send the file's bytes inline)."""
    if not url.startswith("data:"):
        shown = url if len(url) <= 60 else url[:57] + "..."
        raise ValueError(
            f"only data URLs are accepted (data:{kind}/png;base64,...), got {shown!r}: this "
            "server does not fetch URLs"
        )
    head, sep, payload = url.partition(",")
    media_type, *options = head.removeprefix("data:").split(";")
    if not sep or "base64" not in options:
        raise ValueError(f"a {kind} data URL must be base64: data:{kind}/png;base64,<data>")
    if not media_type.startswith(f"{kind}/"):
        raise ValueError(f"a data URL of type {media_type!r} is not an {kind}")
    return b64_bytes(payload, f"the {kind} data URL")


def image_array(image: Any, channels: int = 3) -> np.ndarray:
    """[H, W, channels] float32 in [0, 1] from a PIL image or an image file's bytes."""
    from PIL import Image, UnidentifiedImageError

    if channels not in _MODES:
        raise ValueError(f"images of {channels} channels are not supported (1, 3 or 4)")
    if isinstance(image, bytes | bytearray):
        try:
            image = Image.open(io.BytesIO(image))
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"the image cannot be read: {err}") from err
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image must be a PIL image or a file's bytes, got {type(image)}")
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels are taken"
        )
    try:
        pixels = np.asarray(image.convert(_MODES[channels]), np.float32)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"the image cannot be decoded: {err}") from err
    return (pixels.reshape(height, width, channels) / 255.0).astype(np.float32)


def wav_waveform(data: bytes, sample_rate: int) -> np.ndarray:
    """A mono float32 waveform from a PCM WAV file's bytes (8-, 16-, 24- or 32-bit), which
    must be at `sample_rate` Hz."""
    try:
        with wave.open(io.BytesIO(data)) as f:
            rate, width, nch = f.getframerate(), f.getsampwidth(), f.getnchannels()
            frames = f.readframes(f.getnframes())
    except (wave.Error, EOFError, OSError) as err:
        raise ValueError(f"the audio is not a PCM WAV file: {err}") from err
    if rate != sample_rate:
        raise ValueError(
            f"the audio is sampled at {rate} Hz; this model takes {sample_rate} Hz (resample it)"
        )
    if width == 1:  # unsigned 8-bit
        samples = (np.frombuffer(frames, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 3:  # 24-bit little-endian: widen to 32
        raw = np.frombuffer(frames, np.uint8).reshape(-1, 3)
        wide = np.zeros((raw.shape[0], 4), np.uint8)
        wide[:, 1:] = raw
        samples = wide.view("<i4").reshape(-1).astype(np.float32) / 2.0**31
    elif width in (2, 4):
        kind = "<i2" if width == 2 else "<i4"
        samples = np.frombuffer(frames, kind).astype(np.float32) / 2.0 ** (8 * width - 1)
    else:
        raise ValueError(f"WAV samples of {width} bytes are not supported")
    samples = samples[: samples.size - samples.size % nch].reshape(-1, nch).mean(axis=1)
    if not samples.size:
        raise ValueError("the audio holds no samples")
    return samples.astype(np.float32)
