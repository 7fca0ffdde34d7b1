"""What one decode step must move through memory: the roofline floor of a step.

For B sequences decoding one token each at context c (tokens already cached), per rank:

    weights  = sum of the parameters the step reads, where
               the embedding table contributes only its B gathered rows (B * D * s),
               a MoE layer's routed experts contribute E_touched / E of their bytes, with
               E_touched = E * (1 - (1 - k/E)^B) (each of B tokens picks k of E at random),
               and the MTP heads and the image/audio encoders contribute nothing;
    kv       = sum over attention layers of B * min(c, window) * 2 * Hkv * D * s_kv   (read)
    state    = sum over Mamba layers of B * 2 * (ssm bytes + conv bytes)       (read + write)
    floor    = (weights + kv + state) / BW

(`../shared/reference/performance_and_users.md` section 2.5). Activations and the one new
K/V row per layer are left out (both are below 0.1% of the total at the sizes benchmarked).
The cache terms come from the cache plan's specs, so its dtypes (a float32 SSM state, say)
count as they are stored. Parameters sharded over TP count 1/TP per rank, replicated ones in
full.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from flax import nnx

from hybridserve.cache.plan import CachePlan
from hybridserve.cache.spec import FullAttentionSpec, MambaSpec, SconvSpec
from hybridserve.config import ModelConfig

NOT_IN_DECODE = ("mtp", "vision", "audio")


@dataclasses.dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step reads (and, for the state, writes) per rank."""

    weights: int
    kv: int
    state: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.state

    def floor_s(self, bandwidth: float) -> float:
        """The step's lower bound in seconds at `bandwidth` bytes/s."""
        return self.total / bandwidth


def expert_coverage(num_experts: int, top_k: int, batch: int) -> float:
    """Expected fraction of routed experts a step of `batch` tokens touches (uniform routing)."""
    return 1.0 - (1.0 - top_k / num_experts) ** batch


def weight_bytes(cfg: ModelConfig, params: nnx.State, batch: int) -> int:
    """Parameter bytes one decode step of `batch` tokens reads, per rank (module docstring)."""
    total = 0.0
    for path, var in nnx.to_flat_state(params):
        names = [str(p) for p in path]
        value = var.get_value()  # an array, or a ShapeDtypeStruct of an abstract model
        shards = getattr(value, "addressable_shards", None)
        local = shards[0].data if shards else value
        nbytes = math.prod(local.shape) * np.dtype(local.dtype).itemsize
        if names[0] in NOT_IN_DECODE:
            continue
        if names[0] == "embed":
            total += batch * nbytes / local.shape[0]
        elif _is_routed_expert(cfg, names, local.shape):
            total += nbytes * expert_coverage(cfg.moe.num_experts, cfg.moe.top_k, batch)
        else:
            total += nbytes
    return int(total)


def _is_routed_expert(cfg: ModelConfig, names: list[str], shape: tuple[int, ...]) -> bool:
    if cfg.moe is None or names[0] != "layers" or "mixer" not in names:
        return False
    after = names[names.index("mixer") + 1 :]
    return after[0] in ("up", "gate", "down") and shape[0] == cfg.moe.num_experts


def cache_bytes(plan: CachePlan, batch: int, context: int) -> tuple[int, int]:
    """(kv, state) bytes one decode step of `batch` rows at `context` cached tokens moves, per
    rank: K/V read over each attention layer's window, Mamba state read and written."""
    kv = state = 0
    for group in plan.groups:
        spec, layers = group.spec, [x for x in group.layers if x is not None]
        if isinstance(spec, MambaSpec):
            state += len(layers) * batch * 2 * spec.state_bytes
        elif isinstance(spec, FullAttentionSpec):
            window = getattr(spec, "sliding_window", None)
            tokens = context if window is None else min(context, window)
            if isinstance(spec, SconvSpec):
                tokens = min(context, spec.sliding_window)
            kv += len(layers) * batch * tokens * spec.bytes_per_token
    return kv, state


def decode_bytes(
    cfg: ModelConfig, plan: CachePlan, params: nnx.State, batch: int, context: int
) -> DecodeBytes:
    """The bytes of one decode step of `batch` rows at `context` tokens (module docstring)."""
    kv, state = cache_bytes(plan, batch, context)
    return DecodeBytes(weight_bytes(cfg, params, batch), kv, state)
