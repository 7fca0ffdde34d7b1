"""PyTorch implementations of every op (`backend="torch"`), bridged to JAX in `bridge`.

Importing this package needs torch; without it the import raises ImportError, which
`backends.protocol.get_op` reports as "backend 'torch' is not available here".
"""

import torch  # noqa: F401  (ImportError here when torch is missing)

from backends.torch import attention, conv, fused, moe, norm, ssd  # noqa: F401  (registers the ops)
