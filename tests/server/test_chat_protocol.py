"""Chat templates (rendered as transformers renders them) and the strict request models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.server.chat import ChatTemplate, ChatTemplateError
from hybridserve.server.protocol import ChatCompletionRequest, CompletionRequest

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Sort [3, 1]."},
]


def _model_with_template(tmp_path: Path, template) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, directory)
    conf = json.loads((directory / "tokenizer_config.json").read_text())
    conf["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(conf))
    return directory


def test_chat_template_renders_like_transformers(tmp_path):
    from transformers import AutoTokenizer

    directory = _model_with_template(tmp_path, CHATML)
    ours = ChatTemplate.load(directory)
    hf = AutoTokenizer.from_pretrained(directory)
    for add in (True, False):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=add)
        assert ours.render(MESSAGES, add) == want
    assert not ours.is_fallback


def test_named_templates_jinja_file_and_errors(tmp_path):
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": CHATML}]
    directory = _model_with_template(tmp_path, named)
    assert ChatTemplate.load(directory).render(MESSAGES[:1]).startswith("<|endoftext|><|im_start|>")
    (directory / "chat_template.jinja").write_text("{{ messages | length }}")
    assert ChatTemplate.load(directory).render(MESSAGES) == "4"
    failing = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        failing.render(MESSAGES)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        sandboxed.render(MESSAGES)


def test_fallback_template_of_the_default_model():
    template = ChatTemplate.load(DEFAULT_MODEL)
    assert template.is_fallback
    assert template.render(MESSAGES[:2]) == "system: Be brief.\nuser: Hi\nassistant:"
    assert template.render(MESSAGES[:2], add_generation_prompt=False).endswith("user: Hi\n")


def test_request_models_are_strict():
    """Types are strict and nested objects reject unknown fields; unknown top-level fields are
    dropped (as vLLM ignores them), batches of prompts are kept."""
    assert CompletionRequest.model_validate({"prompt": ["a"]}).prompt == "a"
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompt == [1, 2]
    batch = CompletionRequest.model_validate({"prompt": ["a", [1, 2]]})
    assert batch.prompts == ["a", [1, 2]]
    ignored = CompletionRequest.model_validate({"prompt": "a", "extra": 1})
    assert "extra" not in ignored.model_dump()
    for bad in (
        {"prompt": "a", "max_tokens": "3"},
        {"prompt": "a", "temperature": "0.5"},
        {"prompt": [1.0]},
        {"prompt": {"a": 1}},
        {"prompt": "a", "stream_options": {"extra": 1}},
        {"prompt": ["a", 1]},
        {"prompt": "a", "best_of": 2},
        {"prompt": "a", "logit_bias": {"1": 5.0}},
        {"prompt": "a", "kv_transfer_params": {"num_tokens": -1}},
        {"prompt": "a", "stop": ["x"] * 17},
    ):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(bad)
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 2}]}
    )
    assert chat.messages[0].text() == "a\na"
    extra = CompletionRequest.model_validate({"prompt": "a", "kv_transfer_params": {"x": 1}})
    assert extra.kv_transfer_params.model_dump(exclude_none=True) == {"x": 1}
