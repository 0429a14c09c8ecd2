"""Tokenizer from tokenizer.json (`tokenizers`), chat template from tokenizer_config.json
(jinja2, HF globals), and an incremental detokenizer that never emits broken UTF-8."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from .config import EngineError
from .spec.checkpoint import tokenizer_file
from .text_bound import max_chars_per_token


def _tok_str(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    def __init__(self, path: str | Path, extra_eos_ids: list[int] | None = None):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(path)
        tj = tokenizer_file(d)
        try:
            self._tok = HFTokenizer.from_file(str(tj))
        except Exception as exc:  # noqa: BLE001
            raise EngineError(f"{tj}: cannot load tokenizer ({exc})") from None
        cfg: dict[str, Any] = {}
        tc = d / "tokenizer_config.json"
        if tc.exists():
            try:
                cfg = json.loads(tc.read_text())
            except (OSError, ValueError) as exc:
                raise EngineError(f"{tc}: cannot read ({exc})") from None
        self.bos_token = _tok_str(cfg.get("bos_token"))
        self.eos_token = _tok_str(cfg.get("eos_token"))
        self.pad_token = _tok_str(cfg.get("pad_token"))
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        jf = d / "chat_template.jinja"
        if tmpl is None and jf.exists():
            tmpl = jf.read_text()
        self.chat_template: str | None = tmpl
        self._compiled = None
        eos: list[int] = []
        if self.eos_token is not None:
            i = self._tok.token_to_id(self.eos_token)
            if i is not None:
                eos.append(i)
        for i in extra_eos_ids or []:
            if i not in eos:
                eos.append(i)
        self.eos_token_ids = eos
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.max_chars_per_token = max_chars_per_token(self._tok)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template
    def set_chat_template(self, text: str) -> None:
        """Serve this template instead of the model's (`--chat-template`); compiled now, so
        a broken one fails at start (EngineError)."""
        self.chat_template = text
        self._compiled = compile_chat_template(text)

    def compile_chat_template(self) -> None:
        """Compile the template now if there is one (the engine does so before READY)."""
        if self._compiled is None and self.chat_template is not None:
            self._compiled = compile_chat_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            documents: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """The rendered prompt text; encode it with add_special_tokens=False."""
        if self.chat_template is None:
            raise EngineError("this model has no chat template (tokenizer_config.json has no chat_template)")
        self.compile_chat_template()
        ctx = dict(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                   pad_token=self.pad_token or "")
        ctx.update(kwargs)
        return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, documents=documents, **ctx)


def compile_chat_template(text: str):
    """A chat template compiled as transformers compiles it (its apply_chat_template): a
    sandboxed environment with trim_blocks / lstrip_blocks, loop controls, the
    `{% generation %}` tag (renders its body), `raise_exception`, `strftime_now`, a
    `tojson` that does not escape HTML, and `dict` / `namespace` that refuse dunder names."""
    import jinja2
    from jinja2.exceptions import SecurityError, TemplateError
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's part for training
        masks; rendering a prompt keeps the body as it is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                f"on a namespace, got {name!r}")

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = lambda *a, **k: dict(*a, **k)
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(text)
    except Exception as exc:  # noqa: BLE001
        raise EngineError(f"chat template does not compile: {exc}") from None


class IncrementalDetokenizer:
    """Text of a growing token sequence, emitted in pieces that are always valid UTF-8.

    `tokenizers`' own DecodeStream (Rust): it holds back an incomplete byte sequence until
    a later token completes it, and decodes against the end of the prompt so a leading
    space or word piece comes out as it would in one decode. Measured 2.3x cheaper per
    token than decoding windows from Python (128K-entry vocabulary). Ids outside the
    vocabulary decode to "".
    """

    def __init__(self, tok: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self._tok = tok._tok
        self._vocab = tok.vocab_size
        ctx = [i for i in (prompt_ids or [])[-6:] if 0 <= i < self._vocab]
        self._stream = DecodeStream(ctx, skip_special_tokens=skip_special_tokens)

    def add(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab:
            return ""
        return self._stream.step(self._tok, token_id) or ""

    def flush(self) -> str:
        """At the end: text is emitted as soon as it is whole, so nothing complete is held;
        a trailing broken byte sequence is dropped."""
        return ""
