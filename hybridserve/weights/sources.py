"""`Source`: where one parameter comes from in a checkpoint (tensor names + a reshape hook).

Shared by the name tables `hf_names` (HF families) and `inkling_names` (our Inkling layout).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Hook = Callable[[list[np.ndarray], tuple[int, ...]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Source:
    """Tensors `names` of a checkpoint, turned into one parameter by `hook(arrays, shape)`."""

    names: tuple[str, ...]
    hook: Hook
