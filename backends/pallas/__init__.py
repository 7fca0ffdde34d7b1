"""Pallas kernels (Triton lowering on GPU, `interpret=True` on CPU).

Importing this package registers its ops under the "pallas" backend. Ops it does not implement
are simply not registered: `load_ops("pallas")` then raises `BackendError` naming the missing
op, and `load_ops("pallas", fallback="xla")` fills them from the references.

`HYBRIDSERVE_PALLAS_INTERPRET=1` forces interpret mode (`=0` forces compiled kernels); unset,
interpret mode is chosen when the default jax backend is the CPU.
"""

from backends.pallas import attention, conv, moe, norm, ssd  # noqa: F401  (registers the ops)
