"""Multimodal prompts: placeholder expansion and the embeddings that replace placeholders.

A prompt dict may carry `"multi_modal_data": {"image": images, "audio": waveforms}` (one item
or a list each; images [H, W, C] arrays with H and W multiples of the patch, or PIL images / image
files' bytes, taken as [0, 1] pixels (`hybridserve.media`); waveforms 1-D at the config's sample
rate). Each image becomes (H/P) * (W/P) embeddings, each waveform one per
frame. The prompt holds the placeholder token of each kind either once per item (expanded here
to the item's count) or already once per embedding; items fill their kind's placeholders in
order. Anything else is a ValueError that says what the prompt should hold.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence

import numpy as np

from hybridserve.config import ModelConfig
from hybridserve.core.request import MultimodalInput
from hybridserve.media import image_array

KINDS = ("image", "audio")


def _items(data: dict, kind: str, cfg: ModelConfig) -> list[np.ndarray]:
    value = data.get(kind)
    if value is None:
        return []
    single = isinstance(value, np.ndarray | bytes) or hasattr(value, "convert")  # PIL image
    items = [value] if single else list(value)
    if kind == "image" and cfg.vision is not None:  # PIL images / file bytes: [0, 1] pixels
        channels = cfg.vision.channels
        items = [v if isinstance(v, np.ndarray) else _image(v, channels) for v in items]
    return [np.asarray(v, np.float32) for v in items]


def _image(item: object, channels: int) -> object:
    if isinstance(item, bytes) or hasattr(item, "convert"):
        return image_array(item, channels)
    return item


def _count(cfg: ModelConfig, kind: str, item: np.ndarray) -> int:
    """Embeddings of one item, with its shape checked."""
    if kind == "image":
        v = cfg.vision
        if item.ndim != 3 or item.shape[2] != v.channels:
            raise ValueError(f"an image must be [H, W, {v.channels}], got {list(item.shape)}")
        h, w, _ = item.shape
        if h % v.patch or w % v.patch or not h or not w:
            raise ValueError(f"image {h}x{w} is not a whole number of {v.patch}-pixel patches")
        return (h // v.patch) * (w // v.patch)
    a = cfg.audio
    if item.ndim != 1 or not item.size:
        raise ValueError(f"a waveform must be 1-D and non-empty, got shape {list(item.shape)}")
    return max(1, math.ceil((item.shape[0] - a.n_fft) / a.hop) + 1)


_Plan = dict[int, tuple[str, list[np.ndarray], list[int]]]


def expand_placeholders(
    ids: Sequence[int], data: dict, cfg: ModelConfig
) -> tuple[list[int], _Plan]:
    """(token ids with one placeholder per embedding, placeholder id -> (kind, items, their
    embedding counts)): the checks of `multimodal_prompt` without running an encoder."""
    unknown = sorted(set(data) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown multi_modal_data keys {unknown}; known: {list(KINDS)}")
    ids = list(ids)
    plan: _Plan = {}
    for kind in KINDS:
        items = _items(data, kind, cfg)
        if not items:
            continue
        enc = cfg.vision if kind == "image" else cfg.audio
        if enc is None:
            raise ValueError(f"this model takes no {kind} inputs (its config has no encoder)")
        counts = [_count(cfg, kind, item) for item in items]
        have = ids.count(enc.placeholder_id)
        if have == len(items) and have != sum(counts):
            expanded: list[int] = []
            queue = iter(counts)
            for t in ids:
                expanded += [t] * next(queue) if t == enc.placeholder_id else [t]
            ids = expanded
        elif have != sum(counts):
            raise ValueError(
                f"the prompt holds {have} {kind} placeholder tokens (id {enc.placeholder_id}); "
                f"{len(items)} {kind} item(s) need one each, or {sum(counts)} (one per embedding)"
            )
        plan[enc.placeholder_id] = (kind, items, counts)
    return ids, plan


def multimodal_prompt(
    ids: Sequence[int],
    data: dict,
    cfg: ModelConfig,
    embed: Callable[[str, np.ndarray], np.ndarray],
) -> tuple[list[int], MultimodalInput]:
    """(expanded token ids, the embeddings at their placeholders) for `data` (see the module
    docstring); `embed(kind, item)` computes one item's embeddings [n, D]."""
    ids, plan = expand_placeholders(ids, data, cfg)
    digest = hashlib.sha256()
    for kind, items, _ in plan.values():
        for item in items:
            digest.update(kind.encode() + str(item.shape).encode() + item.tobytes())
    positions, rows = [], []
    for token, (kind, items, counts) in plan.items():
        at = [p for p, t in enumerate(ids) if t == token]
        positions += at
        for item, n in zip(items, counts, strict=True):
            values = np.asarray(embed(kind, item), np.float32)
            if values.shape[0] != n:
                raise AssertionError(f"{kind} encoder gave {values.shape[0]} rows, expected {n}")
            rows.append(values)
    order = np.argsort(positions, kind="stable")
    embeds = np.concatenate(rows)[order] if rows else np.zeros((0, cfg.hidden_size), np.float32)
    return ids, MultimodalInput(tuple(int(positions[i]) for i in order), embeds, digest.digest())
