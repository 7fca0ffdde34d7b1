"""The paged hybrid cache, in one place.

  spec.py         per-layer specs (bytes per page per TP rank), kinds, pages per request
  plan.py         grouping, page unification, the shared pool and its size
  page_layout.py  where every byte of a page lies (K/V halves; x, B, C, ssm slabs; padding)
  view.py         typed device views of the raw regions, at the page layout's offsets (jax)
  regions.py      allocation of the regions and the `CacheRegions` handle (jax)

spec, plan and page_layout import no jax (`tests/test_layering.py`). The accounting over pages
(block pool, per-group managers, prefix cache) is `hybridserve.core`.
"""
