"""The chat templates the server renders (`hybridserve.chat_template`, shared with `LLM.chat`
and `Tokenizer.apply_chat_template`)."""

from hybridserve.chat_template import FALLBACK_TEMPLATE, ChatTemplate, ChatTemplateError

__all__ = ["FALLBACK_TEMPLATE", "ChatTemplate", "ChatTemplateError"]
