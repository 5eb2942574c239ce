"""Chat messages -> the prompt the guard gets, and the token counts ``usage`` reports.

With ``--tokenizer DIR`` (a Hugging Face tokenizer folder: ``tokenizer_config.json``, and
``chat_template.jinja`` or ``tokenizer.json`` where the model ships them) the model's own chat
template is rendered the way ``transformers`` renders it (a sandboxed Jinja environment with
``trim_blocks``/``lstrip_blocks``, ``messages``, ``add_generation_prompt``, ``bos_token``,
``eos_token``, ``raise_exception``) and tokens are counted by its ``tokenizer.json``. Without one,
or for a model that ships no template, the plain template :data:`PLAIN` is used::

    System: <content>
    User: <content>
    Assistant: <content>
    Assistant:

and a token is a character (exact for a character-level model such as the example ``tinylm``; an
estimate for any other, documented as such in docs/llm.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from tritonguard.llm.errors import bad_request

PLAIN = "plain"


def _plain(messages: list[dict[str, str]]) -> str:
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def _token_text(value: Any) -> str:
    """``bos_token``/``eos_token`` as tokenizer_config.json writes them: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class ChatTemplate:
    """``render(messages)`` -> prompt; ``count(text)`` -> tokens. ``source`` says which template."""

    def __init__(self, template: str | None = None, *, bos: str = "", eos: str = "",
                 count: Callable[[str], int] | None = None, source: str = PLAIN) -> None:
        self.source = source
        self._count = count or len
        self._render: Callable[[list[dict[str, str]]], str] = _plain
        if template:
            from jinja2 import TemplateError  # noqa: PLC0415 - only for a model's own template
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            compiled = env.from_string(template)

            def render(messages: list[dict[str, str]]) -> str:
                try:
                    return compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                           eos_token=eos)
                except TemplateError as exc:  # the template's own refusal (e.g. roles must alternate)
                    raise bad_request(f"'messages' do not fit the model's chat template: {exc}", "messages",
                                      "invalid_value") from None
            self._render = render

    def render(self, messages: list[dict[str, str]]) -> str:
        return self._render(messages)

    def count(self, text: str) -> int:
        return self._count(text) if text else 0

    @classmethod
    def load(cls, folder: Path | str | None) -> ChatTemplate:
        """The template of a Hugging Face tokenizer folder (None: the plain one). A folder that
        cannot be read raises ValueError naming the file: the front does not start on it."""
        if folder is None:
            return cls()
        folder = Path(folder)
        cfg_path = folder / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{cfg_path}: {exc}") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja = folder / "chat_template.jinja"
        if not template and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        count = None
        tok_path = folder / "tokenizer.json"
        if tok_path.is_file():
            from tokenizers import Tokenizer  # noqa: PLC0415 - only with a tokenizer folder

            tok = Tokenizer.from_file(str(tok_path))

            def count(text: str) -> int:
                return len(tok.encode(text, add_special_tokens=False).ids)
        if not template and count is None:
            raise ValueError(f"{folder}: neither a chat template nor a tokenizer.json")
        return cls(template if isinstance(template, str) else None, bos=_token_text(cfg.get("bos_token")),
                   eos=_token_text(cfg.get("eos_token")), count=count,
                   source=f"{folder.name} (chat template)" if template else PLAIN)
