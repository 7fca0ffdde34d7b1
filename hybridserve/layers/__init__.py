"""Flax NNX building blocks. They know nothing of requests or scheduling.

Dimension legend, used in every einsum and shape comment:
  B batch rows, T tokens per row, D model width, F MLP width, N query heads, K kv heads,
  H head dim, V vocab, E experts, L MoE latent width, S cache length,
  Hs ssm heads, P ssm head dim, G ssm groups, Ns ssm state dim, C conv channels, W conv width.

Every parameter carries logical axis names (`axes` metadata) that `hybridserve.parallel` maps
onto the device mesh.
"""
