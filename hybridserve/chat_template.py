"""Chat templates: turn a list of messages into one prompt string.

The template comes from the model directory, as Hugging Face stores it: `chat_template.jinja`,
or the `chat_template` key of `tokenizer_config.json` (a string, or a list of `{"name",
"template"}` of which "default" is used). It is rendered as `transformers` does: a sandboxed
jinja2 environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, the
`tojson` filter, `raise_exception` and `strftime_now`, and the variables `messages`,
`add_generation_prompt`, `tools` (None) and the special tokens (`bos_token`, `eos_token`, ...).

Without a template the documented fallback is used, one line per message and an open assistant
line:

    system: You are terse.
    user: Hello
    assistant:
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """The template failed on these messages (it raised, or it is broken)."""


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _special(token: Any) -> str | None:
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class ChatTemplate:
    """A compiled chat template and the special tokens it may use."""

    def __init__(self, source: str | None, special_tokens: dict[str, str] | None = None) -> None:
        self.is_fallback = source is None
        self.source = FALLBACK_TEMPLATE if source is None else source
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _Generation],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(self.source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ChatTemplateError(f"the chat template does not parse: {err}") from err
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTemplate:
        """The template of a model directory, or the fallback when it has none."""
        model_dir = Path(model_dir)
        conf_path = model_dir / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.is_file() else {}
        source = conf.get("chat_template")
        if isinstance(source, list):  # named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.is_file():
            source = jinja_path.read_text()
        names = ("bos_token", "eos_token", "pad_token", "unk_token")
        special = {n: s for n in names if (s := _special(conf.get(n))) is not None}
        return cls(source if isinstance(source, str) else None, special)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt for `messages` (dicts with "role" and "content")."""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from err
        except (TypeError, ValueError, KeyError, AttributeError) as err:
            raise ChatTemplateError(
                f"the chat template failed: {type(err).__name__}: {err}"
            ) from err
