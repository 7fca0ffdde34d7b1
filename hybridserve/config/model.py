"""`ModelConfig`: a hybrid decoder as a layer pattern plus the dimensions of each kind of layer.
Standard library only.

`hybridserve.config.hf.parse_hf_config(path)` reads a Hugging Face `config.json` (families
`nemotron_h`, `bamba`, `granitemoehybrid`, and our `inkling`); `to_dict` / `from_dict` give our
own JSON form.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hybridserve.config.errors import require
from hybridserve.config.layers import (
    LAYER_KINDS,
    AttentionConfig,
    AudioConfig,
    MambaConfig,
    MlpConfig,
    MoeConfig,
    MtpConfig,
    SconvConfig,
    VisionConfig,
)
from hybridserve.config.quant import QuantConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A hybrid decoder: `layer_types[i]` is the mixer of block i, one of LAYER_KINDS.

    Each block is `x += r * mixer(norm(x))`, followed, when `ffn` is set ("mlp" or "moe"), by
    `x += r * ffn(norm2(x))`, with r the residual multiplier. Logits are
    `lm_head(norm_f(x)) / logits_scaling`; embeddings are scaled by `embedding_multiplier`.
    With `sconv` (the Inkling blocks, attention mixers only), short convolutions act on the
    keys, values, attention output and ffn output (`SconvConfig`). `vision` / `audio` add the
    multimodal encoders whose embeddings replace placeholder tokens; `mtp` the chained draft
    heads of speculative decoding; `quant` how the checkpoint is quantised (ModelOpt FP8).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    norm_eps: float
    ffn: str | None = None
    attention: AttentionConfig | None = None
    mamba: MambaConfig | None = None
    mlp: MlpConfig | None = None
    moe: MoeConfig | None = None
    sconv: SconvConfig | None = None
    vision: VisionConfig | None = None
    audio: AudioConfig | None = None
    mtp: MtpConfig | None = None
    tie_word_embeddings: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str = "float32"
    quant: QuantConfig | None = None

    def __post_init__(self) -> None:
        bad = sorted({k for k in self.layer_types if k not in LAYER_KINDS})
        require(not bad, f"unknown layer kinds {bad}; expected some of {list(LAYER_KINDS)}")
        require(len(self.layer_types) > 0, "the layer pattern is empty")
        require(self.ffn in (None, "mlp", "moe"), f"ffn must be None, 'mlp' or 'moe': {self.ffn}")
        needs = set(self.layer_types) | ({self.ffn} if self.ffn else set())
        if self.mtp is not None and self.mtp.ffn is not None:
            needs.add(self.mtp.ffn)
        if "sliding_attention" in needs:
            needs.add("attention")
        for kind in ("attention", "mamba", "mlp", "moe"):
            if kind in needs:
                require(
                    getattr(self, kind) is not None,
                    f"the layer pattern uses {kind!r} layers but the {kind} config is missing",
                )
        require(self.vocab_size > 0 and self.hidden_size > 0, "vocab_size/hidden_size must be > 0")
        if self.attention is not None:
            sliding = "sliding_attention" in self.layer_types
            window = self.attention.sliding_window
            require(
                sliding == (window is not None),
                "sliding_attention layers need attention.sliding_window, and a sliding_window "
                "needs sliding_attention layers (attention layers are full)",
            )
            require(window is None or window > 0, f"sliding_window must be > 0, got {window}")

        if self.sconv is not None:
            require(
                set(self.layer_types) <= {"attention", "sliding_attention"},
                "sconv blocks need attention mixers only (sconvs act on keys and values)",
            )
        for enc in (self.vision, self.audio):
            if enc is not None:
                require(
                    0 <= enc.placeholder_id < self.vocab_size,
                    f"placeholder_id {enc.placeholder_id} is not a token id",
                )
        if self.mtp is not None:
            require(self.attention is not None, "mtp heads need the attention config")
        if self.vision is not None:
            require(
                self.vision.widths[-1] == self.hidden_size,
                "the last vision width must be the hidden size",
            )

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV cache dtype the checkpoint asks for (its FP8 KV scales), or None: the
        engine's `kv_dtype="auto"` then follows the model dtype."""
        return None if self.quant is None else self.quant.kv_cache_dtype

    def window(self, index: int) -> int | None:
        """The attention window of layer `index` (None: full attention or not attention)."""
        if self.layer_types[index] == "sliding_attention":
            return self.attention.sliding_window
        return None

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def pattern(self) -> str:
        """The layer pattern in Nemotron-H letters: M mamba, * attention, - mlp, E moe; and S
        sliding-window attention."""
        letters = {"mamba": "M", "attention": "*", "sliding_attention": "S", "mlp": "-", "moe": "E"}
        return "".join(letters[k] for k in self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (infinities as strings)."""
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`."""
        subs = {
            "attention": AttentionConfig,
            "mamba": MambaConfig,
            "mlp": MlpConfig,
            "moe": MoeConfig,
            "sconv": SconvConfig,
            "vision": VisionConfig,
            "audio": AudioConfig,
            "mtp": MtpConfig,
        }
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        require(not unknown, f"unknown ModelConfig fields {unknown}")
        kwargs = dict(data)
        for key, sub in subs.items():
            if kwargs.get(key) is not None:
                kwargs[key] = sub(**_unjson(kwargs[key]))
        if kwargs.get("quant") is not None:
            q = kwargs["quant"]
            kwargs["quant"] = QuantConfig(
                q["algo"],
                q.get("kv_cache_algo"),
                tuple(q.get("exclude_modules", ())),
                tuple(q.get("fp8_params", ())),
            )
        kwargs["layer_types"] = tuple(kwargs["layer_types"])
        kwargs["eos_token_ids"] = tuple(kwargs.get("eos_token_ids", ()))
        return cls(**kwargs)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _unjson(data: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if v in ("inf", "-inf") else v) for k, v in data.items()}
