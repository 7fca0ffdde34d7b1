"""The Inkling checkpoint layout: our parameter path <-> safetensors tensor name(s), both ways.

`inkling_rules(cfg)` gives, for every parameter of `HybridModel(cfg)` (architecture "inkling"),
a `Rule`: the tensor names it is stored under and a `Codec` that converts between the stored
form and ours (and knows the stored shape, so that a wrong shape is reported with the tensor's
name, even one whose element count fits). `hf_sources` reads through `inkling_sources`; the
exporter (`inkling_export`) writes through `Codec.to_hf`. The layout is documented in
docs/inkling_checkpoint.md.

To map new parameters, add a section function to `SECTIONS` (and a row to the doc, and bump
`hybridserve.config.inkling.LAYOUT_VERSION`): parameters without a rule make both the exporter
and the loader fail, naming them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from hybridserve.config import ModelConfig
from hybridserve.weights.safetensors_io import WeightError
from hybridserve.weights.sources import Source

BLOCK = 32  # K rows per packed block of our NVFP4 codes (backends.nvfp4.BLOCK)


class Codec:
    """Stored tensor(s) <-> one parameter of ours. Subclasses override the three methods."""

    dtype: np.dtype | None = None  # the stored dtype when only one is valid (packed codes)
    convention = "stored as ours"

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each stored tensor, given our parameter's shape."""
        return shape

    def to_ours(self, arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(arrs[0]).reshape(shape)

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        return [value]


class Linear(Codec):
    """torch Linear `[out, in]` <-> ours `[*in, *out]`, the first `n_in` of our axes the input."""

    convention = "torch Linear [out, in]"

    def __init__(self, n_in: int = 1) -> None:
        self.n_in = n_in

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(shape[self.n_in :]), math.prod(shape[: self.n_in]))

    def to_ours(self, arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(arrs[0]).T.reshape(shape)

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        n_in = math.prod(value.shape[: self.n_in])
        return [value.reshape(n_in, -1).T]


class Nvfp4Codes(Codec):
    """One expert's e2m1 codes: stored `[N, K/2]` uint8, two consecutive K values per byte (even
    k in the low nibble) <-> ours `[K/2, N]` block-planar (`backends.nvfp4`: byte row 16 j + r
    holds rows 32 j + r (low nibble) and 32 j + 16 + r (high))."""

    dtype = np.dtype(np.uint8)
    convention = "uint8 [out, in/2], in-pairs per byte (low nibble first)"

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[1], shape[0])

    def to_ours(self, arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        packed = np.asarray(arrs[0])  # [N, K/2]
        n, half = packed.shape
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, 2 * half).T  # [K, N]
        blocks = codes.reshape(2 * half // BLOCK, 2, BLOCK // 2, n)
        return (blocks[:, 0] | (blocks[:, 1] << 4)).reshape(shape)

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        half, n = value.shape  # ours [K/2, N]
        blocks = value.reshape(half // (BLOCK // 2), 1, BLOCK // 2, n)
        codes = np.concatenate([blocks & 15, blocks >> 4], axis=1).reshape(2 * half, n).T
        return [(codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)]


class PerExpert(Codec):
    """One stored tensor per expert (leading axis of ours), each through `inner`."""

    def __init__(self, inner: Codec) -> None:
        self.inner = inner
        self.dtype, self.convention = inner.dtype, f"one per expert, {inner.convention}"

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return self.inner.hf_shape(shape[1:])

    def to_ours(self, arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        return np.stack([self.inner.to_ours([a], shape[1:]) for a in arrs]).reshape(shape)

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        return [self.inner.to_hf(v)[0] for v in value]


SAME = Codec()


@dataclasses.dataclass(frozen=True)
class Rule:
    """Our parameter is stored as the tensors `names` (several: one per expert) via `codec`."""

    names: tuple[str, ...]
    codec: Codec = SAME

    def load(self, arrs: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Stored arrays -> ours; raises WeightError naming a tensor of the wrong shape/dtype."""
        want = tuple(self.codec.hf_shape(shape))
        for name, arr in zip(self.names, arrs, strict=True):
            if tuple(arr.shape) != want:
                raise WeightError(
                    f"tensor shape mismatch: {name} has shape {tuple(arr.shape)}, expected "
                    f"{want} ({self.codec.convention})"
                )
            if self.codec.dtype is not None and arr.dtype != self.codec.dtype:
                raise WeightError(
                    f"tensor {name} has dtype {arr.dtype}, expected {self.codec.dtype}"
                )
        return self.codec.to_ours(arrs, shape)

    def save(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """Our parameter -> {tensor name: array}."""
        arrs = self.codec.to_hf(np.asarray(value))
        arrs = [np.asarray(a) for a in arrs]  # (np.ascontiguousarray makes 0-d arrays 1-d)
        arrs = [a if a.flags.c_contiguous else a.copy(order="C") for a in arrs]
        return dict(zip(self.names, arrs, strict=True))


Table = dict[str, Rule]


def _linear(t: Table, ours: str, hf: str, n_in: int, bias: bool) -> None:
    t[f"{ours}.kernel"] = Rule((f"{hf}.weight",), Linear(n_in))
    if bias:
        t[f"{ours}.bias"] = Rule((f"{hf}.bias",))


def _experts(t: Table, ours: str, hf: str, proj: str, count: int, nvfp4: bool) -> None:
    """Stacked experts `ours [E, in, out]` <- `{hf}.{e}.{proj}_proj.weight` [out, in] each
    (NVFP4: the codes, their e4m3 scales per 16 inputs and a float32 scale per expert)."""

    def names(suffix: str) -> tuple[str, ...]:
        return tuple(f"{hf}.{e}.{proj}_proj.{suffix}" for e in range(count))

    if not nvfp4:
        t[ours] = Rule(names("weight"), PerExpert(Linear()))
        return
    t[f"{ours}.codes"] = Rule(names("weight"), PerExpert(Nvfp4Codes()))
    t[f"{ours}.scales"] = Rule(names("weight_scale"), PerExpert(Linear()))
    t[f"{ours}.tensor_scale"] = Rule(names("weight_scale_2"), PerExpert(SAME))


def _globals(cfg: ModelConfig, t: Table) -> None:
    t["embed"] = Rule(("model.embed_tokens.weight",))
    t["norm_f.weight"] = Rule(("model.norm.weight",))
    if not cfg.tie_word_embeddings:
        t["lm_head"] = Rule(("lm_head.weight",), Linear())


def _attention(cfg: ModelConfig, t: Table, ours: str, hf: str) -> None:
    bias = cfg.attention.bias
    for proj in ("q_proj", "k_proj", "v_proj", "r_proj"):
        if proj != "r_proj" or cfg.attention.rel_dim is not None:
            _linear(t, f"{ours}.{proj}", f"{hf}.{proj}", 1, bias)
    _linear(t, f"{ours}.o_proj", f"{hf}.o_proj", 2, bias)
    if cfg.attention.rel_dim is not None:
        t[f"{ours}.rel_table"] = Rule((f"{hf}.rel_table",))


def _moe(cfg: ModelConfig, t: Table, ours: str, hf: str) -> None:
    moe = cfg.moe
    nvfp4 = moe.expert_format == "nvfp4"
    t[f"{ours}.router"] = Rule((f"{hf}.router.weight",), Linear())
    for name in ("up", "gate", "down") if moe.gated else ("up", "down"):
        _experts(t, f"{ours}.{name}", f"{hf}.experts", name, moe.num_experts, nvfp4)
        shared = moe.num_shared_experts
        _experts(t, f"{ours}.sink_{name}", f"{hf}.shared_experts", name, shared, False)


def _block(cfg: ModelConfig, t: Table, ours: str, hf: str, sconv: bool) -> None:
    """One `Block`: norms, attention, MoE ffn and (`sconv`, a base-model layer) its sconvs."""
    t[f"{ours}.norm.weight"] = Rule((f"{hf}.input_layernorm.weight",))
    t[f"{ours}.ffn_norm.weight"] = Rule((f"{hf}.post_attention_layernorm.weight",))
    _attention(cfg, t, f"{ours}.mixer", f"{hf}.self_attn")
    _moe(cfg, t, f"{ours}.ffn", f"{hf}.mlp")
    if sconv and cfg.sconv is not None:
        for site in ("kv", "out", "ffn"):
            t[f"{ours}.sconv.{site}.weight"] = Rule((f"{hf}.sconv_{site}.weight",))
            if cfg.sconv.bias:
                t[f"{ours}.sconv.{site}.bias"] = Rule((f"{hf}.sconv_{site}.bias",))


def _layers(cfg: ModelConfig, t: Table) -> None:
    for i in range(cfg.num_layers):
        _block(cfg, t, f"layers.{i}", f"model.layers.{i}", sconv=True)


def _mtp(cfg: ModelConfig, t: Table) -> None:
    """The MTP heads (`models.mtp.MtpHead`, layout_version 2): norms, the [2D, D] input
    projection (rows: the normed hidden state's D, then the normed embedding's) and a block
    named like a layer's (full attention, no sconvs)."""
    for i in range(0 if cfg.mtp is None else cfg.mtp.num_heads):
        ours, hf = f"mtp.{i}", f"model.mtp.{i}"
        for norm in ("norm_h", "norm_e", "norm_o"):
            t[f"{ours}.{norm}.weight"] = Rule((f"{hf}.{norm}.weight",))
        t[f"{ours}.proj"] = Rule((f"{hf}.proj.weight",), Linear())
        _block(cfg, t, f"{ours}.block", hf, sconv=False)


def _encoders(cfg: ModelConfig, t: Table) -> None:
    if cfg.vision is not None:
        for j in range(len(cfg.vision.widths)):
            t[f"vision.weights.{j}"] = Rule((f"model.vision.stages.{j}.weight",), Linear())
            t[f"vision.biases.{j}"] = Rule((f"model.vision.stages.{j}.bias",))
    if cfg.audio is not None:
        t["audio.table"] = Rule(("model.audio.table",))


SECTIONS: tuple[Callable[[ModelConfig, Table], None], ...] = (_globals, _layers, _mtp, _encoders)


def inkling_rules(cfg: ModelConfig) -> Table:
    """Our dotted parameter path -> its `Rule`, for every parameter of `HybridModel(cfg)`."""
    table: Table = {}
    for section in SECTIONS:
        section(cfg, table)
    return table


def inkling_sources(cfg: ModelConfig) -> dict[str, list[Source]]:
    """The rules as the loader's `hf_sources` table (one candidate each)."""
    return {k: [Source(r.names, r.load)] for k, r in inkling_rules(cfg).items()}


def unmapped(params: set[str], rules: Table) -> None:
    """Raise WeightError when model parameters have no rule, or rules no parameter."""
    extra, missing = sorted(params - set(rules)), sorted(set(rules) - params)
    if extra:
        raise WeightError(
            f"no Inkling tensor name for parameters {extra}: add a rule in "
            "hybridserve/weights/inkling_names.py (SECTIONS) and docs/inkling_checkpoint.md"
        )
    if missing:
        raise WeightError(f"the Inkling rules name parameters the model lacks: {missing}")
