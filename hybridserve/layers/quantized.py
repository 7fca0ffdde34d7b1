"""Which parameters of a model may be stored in FP8, and storing them so (`ModelConfig.quant`).

FP8 candidates are the projection kernels (`Einsum`, path `....kernel`) and the routed-expert
stacks of MoE layers (path `....up` / `gate` / `down`); everything else (embeddings, norms, conv
taps, routers, the Mamba2 A, D and dt, the lm_head) stays in its own dtype, as ModelOpt leaves
it. `apply_fp8` turns the listed ones into e4m3 (`Einsum.to_fp8`, `Moe.to_fp8`) right after the
model is built, so that the abstract model has the checkpoint's dtypes and scale parameters.
"""

from __future__ import annotations

from flax import nnx

from hybridserve.config import ConfigError
from hybridserve.layers.linear import Einsum
from hybridserve.layers.moe import EXPERT_STACKS, Moe


def _modules(model: nnx.Module) -> list[tuple[str, nnx.Module]]:
    return [
        (".".join(str(k) for k in path), node)
        for path, node in nnx.iter_graph(model)
        if isinstance(node, Einsum | Moe)
    ]


def apply_fp8(model: nnx.Module, params: tuple[str, ...]) -> None:
    """Store each of `params` (projection kernels, expert stacks: `weights.fp8_names`) in
    e4m3 with its scales."""
    wanted = set(params)
    todo = []
    for where, node in _modules(model):
        if isinstance(node, Einsum) and f"{where}.kernel" in wanted:
            todo.append((node, None))
            wanted.discard(f"{where}.kernel")
        elif isinstance(node, Moe):
            for name in EXPERT_STACKS:
                if f"{where}.{name}" in wanted:
                    todo.append((node, name))
                    wanted.discard(f"{where}.{name}")
    if wanted:
        raise ConfigError(
            f"quant.fp8_params names parameters this model cannot hold in FP8: {sorted(wanted)}"
        )
    for node, name in todo:
        node.to_fp8() if name is None else node.to_fp8(name)
