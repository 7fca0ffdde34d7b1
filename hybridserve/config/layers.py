"""Frozen configs of the layer kinds a `ModelConfig` is assembled from (mixers, feed-forwards,
short convolutions, multi-token prediction, multimodal encoders). Standard library only."""

from __future__ import annotations

import dataclasses
import math

from hybridserve.config.errors import require

LAYER_KINDS = ("mamba", "attention", "sliding_attention", "mlp", "moe")
ACTIVATIONS = ("relu2", "silu", "gelu", "relu")
ROUTERS = ("sigmoid_group", "softmax_topk", "softmax_sink")


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """A Mamba2 mixer: `num_heads` heads of `head_dim` channels, `n_groups` groups of B/C."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool = True
    use_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        require(self.num_heads > 0 and self.head_dim > 0, "mamba num_heads/head_dim must be > 0")
        require(
            self.num_heads % self.n_groups == 0,
            f"mamba num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})",
        )
        require(self.conv_kernel >= 1, f"mamba conv_kernel must be >= 1, got {self.conv_kernel}")
        require(self.chunk_size >= 1, f"mamba chunk_size must be >= 1, got {self.chunk_size}")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """GQA attention. `scale=None` means `head_dim ** -0.5`; `rope_theta=None` means no RoPE
    (NoPE); RoPE rotates the first `rotary_dim` channels of each head. `sliding_window` is the
    window of the `sliding_attention` layers (`attention` layers see every earlier token; both
    kinds share the other fields). `rel_dim` (None: none)
    adds a learned relative-position term to the logits: an r projection gives each query head
    a `rel_dim` vector, dotted with a table of `rel_buckets` distance embeddings (`rel_exact`
    exact distances, then log-spaced buckets up to `rel_max_distance`, the last bucket open)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float | None = None
    bias: bool = False
    rope_theta: float | None = None
    rotary_dim: int | None = None
    sliding_window: int | None = None
    rel_dim: int | None = None
    rel_buckets: int = 32
    rel_exact: int = 16
    rel_max_distance: int = 4096

    def __post_init__(self) -> None:
        if self.rel_dim is not None:
            require(self.rel_dim > 0, f"rel_dim must be > 0, got {self.rel_dim}")
            require(
                0 < self.rel_exact <= self.rel_buckets
                and (self.rel_exact == self.rel_buckets or self.rel_max_distance > self.rel_exact),
                f"relative buckets: need 0 < rel_exact ({self.rel_exact}) <= rel_buckets "
                f"({self.rel_buckets}) and rel_max_distance ({self.rel_max_distance}) > rel_exact",
            )
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"num_attention_heads ({self.num_heads}) must be a multiple of "
            f"num_key_value_heads ({self.num_kv_heads})",
        )
        if self.rope_theta is not None:
            rd = self.rotary_dim
            require(
                rd is not None and 0 < rd <= self.head_dim and rd % 2 == 0,
                f"rotary_dim ({rd}) must be even and in (0, head_dim={self.head_dim}]",
            )

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """A dense MLP: `down(act(up x))`, or `down(act(gate x) * up x)` when gated."""

    intermediate_size: int
    activation: str = "relu2"
    gated: bool = False
    bias: bool = False

    def __post_init__(self) -> None:
        require(self.activation in ACTIVATIONS, f"unknown MLP activation {self.activation!r}")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Mixture of experts.

    `router="sigmoid_group"` (nemotron_h): sigmoid scores, a correction bias used only to select,
    group-limited top-k, optional renormalisation, `routed_scaling_factor`. `"softmax_topk"`
    (granitemoehybrid): top-k of the raw logits, softmax over those k. A shared expert of width
    `shared_intermediate_size` (0 = none) always runs on the un-projected input.
    `"softmax_sink"` (the expert sink): one softmax over the routed and `num_shared_experts`
    shared experts' logits, top-k among the routed only, no renormalisation; the shared experts
    always run, weighted by their own probabilities (see `layers.moe.route_sink`).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "sigmoid_group"
    activation: str = "relu2"
    gated: bool = False
    bias: bool = False
    shared_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    latent_size: int | None = None
    num_shared_experts: int = 1
    expert_format: str = "dense"  # or "nvfp4": routed experts in 4 bits (backends.nvfp4)

    def __post_init__(self) -> None:
        require(self.router in ROUTERS, f"unknown MoE router {self.router!r}")
        require(
            self.expert_format in ("dense", "nvfp4"),
            f"expert_format must be 'dense' or 'nvfp4', got {self.expert_format!r}",
        )
        if self.expert_format == "nvfp4":
            require(
                self.intermediate_size % 32 == 0 and (self.latent_size or 32) % 32 == 0,
                "nvfp4 experts need intermediate_size and latent_size to be multiples of 32 "
                "(without a latent projection, the hidden size is checked when quantising)",
            )
        if self.router == "softmax_sink":
            require(
                self.num_shared_experts >= 1 and self.shared_intermediate_size > 0,
                "the expert sink needs shared experts (num_shared_experts >= 1 and "
                "shared_intermediate_size > 0)",
            )
        else:
            require(
                self.num_shared_experts == 1,
                f"router {self.router!r} has at most one shared expert (num_shared_experts=1)",
            )
        require(self.activation in ACTIVATIONS, f"unknown MoE activation {self.activation!r}")
        require(
            0 < self.top_k <= self.num_experts,
            f"num_experts_per_tok ({self.top_k}) must be in [1, n_routed_experts="
            f"{self.num_experts}]",
        )
        require(
            self.num_experts % self.n_group == 0,
            f"n_routed_experts ({self.num_experts}) must be a multiple of n_group ({self.n_group})",
        )
        require(
            0 < self.topk_group <= self.n_group,
            f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]",
        )


@dataclasses.dataclass(frozen=True)
class SconvConfig:
    """Short causal depthwise convolutions (sconv) of `width` taps at four sites of every block:
    the keys and the values (after their projections, before the cache and attention), the
    attention output (after `o_proj`) and the feed-forward output. Per channel c:
      `y[t, c] = sum_{j < W} w[c, j] * u[t - (W - 1) + j, c]  (+ b[c] when `bias`)`,
    u before position 0 being zero. The last `W - 1` inputs are the state (cached per token as
    a virtual sliding-window layer, see `cache.spec.SconvSpec`)."""

    width: int = 4
    bias: bool = False

    def __post_init__(self) -> None:
        require(self.width >= 2, f"sconv width must be >= 2, got {self.width}")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Images through the hMLP patch stem (`layers.multimodal.HmlpPatchEncoder`): stage widths
    `widths` (the last is the model width), the first stage over `sub_patch`-pixel squares; each
    patch becomes one embedding put at one `placeholder_id` token of the prompt."""

    placeholder_id: int
    sub_patch: int
    widths: tuple[int, ...]
    channels: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", tuple(self.widths))
        require(self.sub_patch > 0 and len(self.widths) >= 1, "vision: sub_patch, widths")

    @property
    def patch(self) -> int:
        """Pixels per side of one image token."""
        return self.sub_patch * 2 ** (len(self.widths) - 1)


@dataclasses.dataclass(frozen=True)
class AudioConfig:
    """Audio as dMel embeddings (`layers.multimodal.DmelEncoder`): one embedding per frame of
    `n_fft` samples every `hop`, put at one `placeholder_id` token each."""

    placeholder_id: int
    sample_rate: int = 16000
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 80
    mel_bins: int = 16
    mel_range: tuple[float, float] = (-10.0, 10.0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mel_range", tuple(self.mel_range))
        lo, hi = self.mel_range
        require(hi > lo and self.mel_bins > 0, "audio: mel_range must grow, mel_bins > 0")
        require(self.hop > 0 and self.n_fft > 0, "audio: n_fft and hop must be > 0")


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """Multi-token prediction: `num_heads` chained heads, head i proposing the token i + 1
    places after the base model's next token (`layers.mtp.MtpHead`). Each head is one block of
    the model's full-attention kind (own KV cache) with the model's ffn (or `ffn`: "mlp" or
    "moe", for a model whose blocks have none, such as Nemotron-H's attention-then-MoE MTP
    layers), no sconv."""

    num_heads: int = 8
    ffn: str | None = None

    def __post_init__(self) -> None:
        require(self.num_heads >= 1, f"mtp num_heads must be >= 1, got {self.num_heads}")
        require(self.ffn in (None, "mlp", "moe"), f"mtp ffn must be mlp or moe, got {self.ffn}")
