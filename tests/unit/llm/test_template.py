"""Chat templates: the plain fallback, and a model's own Jinja template as transformers renders it."""

from __future__ import annotations

import json

import pytest

from tritonguard.llm.errors import OpenAIError
from tritonguard.llm.template import PLAIN, ChatTemplate

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# the shape of a real model's template (raise_exception, bos_token, add_generation_prompt)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
            "{{ raise_exception('no tools') }}{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def test_the_plain_template_and_character_counts():
    t = ChatTemplate.load(None)
    assert t.source == PLAIN
    assert t.render(MESSAGES) == "System: Be brief.\nUser: Hi\nAssistant:"
    assert t.count("hello") == 5 and t.count("") == 0


def test_a_models_own_template_is_rendered(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    t = ChatTemplate.load(tmp_path)
    assert t.render(MESSAGES) == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    with pytest.raises(OpenAIError) as info:  # the template's own refusal is the client's 400
        t.render([{"role": "tool", "content": "x"}])
    assert info.value.status == 400 and info.value.param == "messages" and "no tools" in info.value.message


def test_a_template_cannot_reach_python(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(Exception, match="unsafe|access"):
        ChatTemplate.load(tmp_path).render(MESSAGES)


def test_a_folder_without_template_or_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="neither a chat template"):
        ChatTemplate.load(tmp_path)
