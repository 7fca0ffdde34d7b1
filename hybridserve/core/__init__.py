"""Host-side bookkeeping in plain Python (no jax): requests, the block pool, the cache managers
and the scheduler. `outputs` is the only contract with the device-side runner."""
