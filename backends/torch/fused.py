"""The fused decode ops from the torch backend's own ops: `linear` with torch's norms, and
`mamba2_decode_paged` with torch's conv step and state update (the xla compositions)."""

from __future__ import annotations

from backends.protocol import register
from backends.torch.conv import causal_conv1d_step
from backends.torch.norm import gated_rms_norm, rms_norm
from backends.torch.ssd import mamba2_step_paged
from backends.xla import linear as xla_linear
from backends.xla import mamba_decode as xla_decode

register("linear", "torch")(xla_linear.through(rms_norm, gated_rms_norm))
register("mamba2_decode_paged", "torch")(xla_decode.through(causal_conv1d_step, mamba2_step_paged))
