"""A thin wrapper over a Hugging Face `tokenizers` tokenizer (`tokenizer.json`)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """Encode / decode with the special tokens named in `tokenizer_config.json`."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self._tok = _HFTokenizer.from_file(str(directory / "tokenizer.json"))
        conf_path = directory / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        self.add_bos = bool(conf.get("add_bos_token", False))
        self.bos_token_id = self._special_id(conf.get("bos_token"))
        self.eos_token_id = self._special_id(conf.get("eos_token"))

    @classmethod
    def maybe_load(cls, directory: str | Path) -> Tokenizer | None:
        """The tokenizer of a model directory, or None when it has no `tokenizer.json`."""
        return cls(directory) if (Path(directory) / "tokenizer.json").is_file() else None

    def _special_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return None if token is None else self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
