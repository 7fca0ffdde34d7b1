"""FP8 ops of the pallas backend: the pallas norms around the reference W8A8 matmul, which XLA
lowers to an FP8 GEMM (cuBLASLt) on GPUs that have one, and the reference expert matmul.
No Pallas kernel of our own yet: measured beside XLA's FP8 GEMM first (BENCHMARKS.md)."""

from __future__ import annotations

from backends.pallas.norm import gated_rms_norm, rms_norm
from backends.protocol import register
from backends.xla import fp8 as xla_fp8

fp8_linear = register("fp8_linear", "pallas")(xla_fp8.through_fp8(rms_norm, gated_rms_norm))
fp8_grouped_matmul = register("fp8_grouped_matmul", "pallas")(xla_fp8.fp8_grouped_matmul)
