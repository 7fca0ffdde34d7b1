"""Pallas kernels (Triton lowering on GPU, `interpret=True` on CPU).

Importing this package registers its ops under the "pallas" backend. Ops it does not implement
are simply not registered: `load_ops("pallas")` then raises `BackendError` naming the missing
op, and `load_ops("pallas", fallback="xla")` fills them from the references.

`HYBRIDSERVE_PALLAS_INTERPRET=1` forces interpret mode (`=0` forces compiled kernels); unset,
interpret mode is chosen when the default jax backend is the CPU.
"""

from backends.pallas import attention, conv, fp8, linear, mamba_decode, moe, norm, ssd, ssd_paged  # noqa: F401  (registers the ops)
from backends.protocol import BackendError

PLATFORMS = ("cpu", "gpu", "cuda", "rocm")  # interpret mode on the CPU, Triton on GPUs


def check_platform(platform: str) -> None:
    """Raise `BackendError` on hardware the kernels do not target (their Triton lowering runs on
    GPUs only; a TPU would need Mosaic kernels)."""
    if platform not in PLATFORMS:
        raise BackendError(
            f"backend 'pallas' has kernels for GPUs (Triton) and the CPU (interpret mode), "
            f"not for {platform!r}; use backend='xla'"
        )
