"""Reference ops in plain jax.numpy: the ground truth every backend is tested against."""

from backends.xla import attention, conv, fp8, linear, mamba_decode, moe, norm, ssd, ssd_paged  # noqa: F401  (registers the ops)
