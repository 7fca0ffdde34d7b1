"""The fused decode ops from the torch backend's own ops: `linear` (and `fp8_linear`) with
torch's norms, and `mamba2_decode_paged` with torch's conv step and state update (the xla
compositions)."""

from __future__ import annotations

from backends.protocol import register
from backends.torch.conv import causal_conv1d_step
from backends.torch.norm import gated_rms_norm, rms_norm
from backends.torch.ssd import mamba2_step_paged
from backends.xla import fp8 as xla_fp8
from backends.xla import linear as xla_linear
from backends.xla import mamba_decode as xla_decode

register("linear", "torch")(xla_linear.through(rms_norm, gated_rms_norm))
register("mamba2_decode_paged", "torch")(xla_decode.through(causal_conv1d_step, mamba2_step_paged))
# FP8: torch's norms around the reference W8A8 matmul (XLA's FP8 GEMM on GPUs), and the
# reference expert matmul.
register("fp8_linear", "torch")(xla_fp8.through_fp8(rms_norm, gated_rms_norm))
register("fp8_grouped_matmul", "torch")(xla_fp8.fp8_grouped_matmul)
