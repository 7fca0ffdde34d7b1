"""Offline conversion of Hugging Face checkpoints to our orbax layout, and verification against
transformers. Imports hybridserve; nothing in the engine imports this package (the CLI
dispatches to it)."""
