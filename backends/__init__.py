"""Array-in / array-out ops behind one protocol; imports nothing from hybridserve."""

from backends.protocol import BackendError, Ops, get_op, load_ops, register

__all__ = ["BackendError", "Ops", "get_op", "load_ops", "register"]
