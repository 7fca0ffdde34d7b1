"""Does a Pallas op lower for CUDA with Triton kernels in it? Checked on a machine without a
GPU: exporting for the "cuda" platform runs the Pallas -> Triton lowering (the power-of-two
tile rule, the supported primitives, a fill value only with a mask); compiling the kernels to
PTX needs a GPU. Tests set HYBRIDSERVE_PALLAS_INTERPRET=0 first (the choice is made when the
op is traced)."""

from __future__ import annotations

import jax
from jax import export

TRITON = "__gpu$xla.gpu.triton"


def assert_lowers_to_triton(fn, *args) -> None:
    """`jax.jit(fn)` exports for CUDA on `args` (arrays or ShapeDtypeStructs) with at least one
    Triton kernel in it."""
    exported = export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)],
    )(*args)
    assert TRITON in exported.mlir_module()
