"""A thin wrapper over a Hugging Face `tokenizers` tokenizer (`tokenizer.json`), with the
model's chat template (`apply_chat_template`, as transformers' tokenizers have it)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from hybridserve.chat_template import ChatTemplate


class Tokenizer:
    """Encode / decode with the special tokens named in `tokenizer_config.json`."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        self.directory = directory
        self._chat_template: ChatTemplate | None = None
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the BOS first when the tokenizer adds one (and
        `add_special_tokens`)."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str) -> dict[str, list[int]]:
        """`{"input_ids": encode(text)}`, as a transformers tokenizer answers a call."""
        return {"input_ids": self.encode(text)}

    @property
    def chat_template(self) -> ChatTemplate:
        """The model's chat template (`chat_template.jinja` or `tokenizer_config.json`; the
        documented fallback without one), loaded once."""
        if self._chat_template is None:
            self._chat_template = ChatTemplate.load(self.directory)
        return self._chat_template

    def template(self, chat_template: str | None = None) -> ChatTemplate:
        """The model's chat template, or the jinja source `chat_template` with the model's
        special tokens."""
        if chat_template is None:
            return self.chat_template
        return ChatTemplate(chat_template, self.chat_template.special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
    ) -> str | list[int]:
        """The prompt for `messages` ({"role", "content"} dicts) by the model's template (or
        the jinja source `chat_template`): token ids, or the text with `tokenize=False`.
        Raises `ChatTemplateError` (a ValueError) when the template fails on them."""
        text = self.template(chat_template).render(
            messages, add_generation_prompt=add_generation_prompt
        )
        return self.encode(text) if tokenize else text
