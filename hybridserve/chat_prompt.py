"""Chat messages with images and audio: the prompt's token ids and its `multi_modal_data`.

Messages are OpenAI chat messages: `{"role", "content"}` with content a string or a list of
parts, `{"type": "text", "text"}`, `{"type": "image_url", "image_url": {"url": "data:image/
png;base64,..."}}` (or the URL as a string) and `{"type": "input_audio", "input_audio":
{"data": <base64 WAV>, "format": "wav"}}`. The server and `LLM.chat` build prompts the same way:
  1. each message's content becomes one string: its parts joined by newlines, each image or
     audio part replaced by a sentinel unique to this call;
  2. the chat template renders the messages (it sees the sentinels as text);
  3. the rendered text is cut at the sentinels; the pieces are tokenized (the first with the
     tokenizer's BOS, the others without), and each sentinel becomes its kind's placeholder
     token (the vision / audio config's `placeholder_id`), which the engine expands to one per
     embedding (`runner.multimodal_prompt`);
  4. the media are decoded (`hybridserve.media`): images to [H, W, C] in [0, 1], WAV to a mono
     waveform at the model's sample rate.
A media part on a model without that encoder, a template that drops or repeats a media part,
and any malformed medium are ValueErrors that say so.
"""

from __future__ import annotations

import dataclasses
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hybridserve.chat_template import ChatTemplate
from hybridserve.config import ModelConfig
from hybridserve.media import b64_bytes, data_url_bytes, image_array, wav_waveform

AUDIO_FORMATS = ("wav",)


@dataclasses.dataclass(frozen=True)
class ChatPrompt:
    """A rendered conversation: the text `pieces` around its media (one more piece than
    media), and the media `(kind, array)` in the order they appear."""

    pieces: tuple[str, ...]
    media: tuple[tuple[str, np.ndarray], ...]
    placeholders: dict[str, int]  # kind -> placeholder token id

    @property
    def text(self) -> str:
        """The rendered text (only when there is no medium)."""
        if self.media:
            raise ValueError("a prompt with media has no single text")
        return self.pieces[0]

    def token_ids(self, encode: Callable[[str, bool], list[int]]) -> list[int]:
        """Token ids: `encode(piece, first)` for each piece, a placeholder between pieces."""
        ids = encode(self.pieces[0], True)
        for (kind, _), piece in zip(self.media, self.pieces[1:], strict=True):
            ids = [*ids, self.placeholders[kind], *encode(piece, False)]
        return ids

    def multi_modal_data(self) -> dict[str, list[np.ndarray]] | None:
        """`{"image": [...], "audio": [...]}` for the engine, or None without media."""
        data: dict[str, list[np.ndarray]] = {}
        for kind, array in self.media:
            data.setdefault(kind, []).append(array)
        return data or None


def piece_encoder(tokenizer: Any, bos_token: str | None) -> Callable[[str, bool], list[int]]:
    """`encode(piece, first)` for `ChatPrompt.token_ids`: the tokenizer's BOS before the first
    piece unless the template already wrote `bos_token` there."""

    def encode(piece: str, first: bool) -> list[int]:
        add = first and not (bos_token and piece.startswith(bos_token))
        return tokenizer.encode(piece, add_special_tokens=add)

    return encode


def _medium(part: dict, cfg: ModelConfig) -> tuple[str, np.ndarray]:
    kind = part.get("type")
    if kind == "image_url":
        if cfg.vision is None:
            raise ValueError("this model takes no images (its config has no vision encoder)")
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str):
            raise ValueError('an image_url part needs {"image_url": {"url": "data:image/..."}}')
        return "image", image_array(data_url_bytes(url, "image"), cfg.vision.channels)
    if cfg.audio is None:
        raise ValueError("this model takes no audio (its config has no audio encoder)")
    value = part.get("input_audio")
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise ValueError('an input_audio part needs {"input_audio": {"data", "format": "wav"}}')
    fmt = value.get("format", "wav")
    if fmt not in AUDIO_FORMATS:
        raise ValueError(f"input_audio format {fmt!r} is not supported; send {AUDIO_FORMATS}")
    data = b64_bytes(value["data"], "input_audio data")
    return "audio", wav_waveform(data, cfg.audio.sample_rate)


def _content(message: dict, sentinel: str, found: list[tuple[str, np.ndarray]], cfg) -> str:
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"message content must be a string or a list of parts: {content!r}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_audio"):
            found.append(_medium(part, cfg))
            texts.append(f"{sentinel}{len(found) - 1}>")
        else:
            raise ValueError(
                f"unknown content part {kind!r}: text, image_url and input_audio are accepted"
            )
    return "\n".join(texts)


def render_chat(
    messages: Sequence[dict[str, Any]],
    template: ChatTemplate,
    cfg: ModelConfig,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """Render a conversation (steps 1, 2 and 4 of the module docstring); `ChatTemplateError`
    when the template fails, ValueError for a bad medium or a template that lost one."""
    sentinel = f"<|hs-media-{secrets.token_hex(8)}-"
    found: list[tuple[str, np.ndarray]] = []
    flat = []
    for message in messages:
        if not isinstance(message, dict):
            raise ValueError(f"a chat message must be a dict, got {type(message).__name__}")
        flat.append({**message, "content": _content(message, sentinel, found, cfg)})
    text = template.render(flat, add_generation_prompt)
    pieces = re.split(re.escape(sentinel) + r"(\d+)>", text)
    order = [int(i) for i in pieces[1::2]]
    if order != list(range(len(found))):
        raise ValueError(
            f"the chat template kept media parts {order} of {len(found)}: it must write every "
            "message's content once, in order"
        )
    placeholders = {}
    if cfg.vision is not None:
        placeholders["image"] = cfg.vision.placeholder_id
    if cfg.audio is not None:
        placeholders["audio"] = cfg.audio.placeholder_id
    return ChatPrompt(tuple(pieces[0::2]), tuple(found), placeholders)
