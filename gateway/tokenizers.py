"""Load a served model's ``tokenizer.json`` and chat template into a ``TokenKeyer`` (token mode).

Token mode is only worth having if the gateway's ids are *the worker's* ids: one token off and
every later block hash differs from what vLLM cached. So this module copies what vLLM 0.32 and
transformers 5 do, rather than approximating it: the Rust ``tokenizers`` library on the model's
own ``tokenizer.json`` (truncation and padding off, as vLLM encodes), and the chat template from
``chat_template.jinja`` (+ ``additional_chat_templates/*.jinja``), else ``tokenizer_config.json``'s
``chat_template`` (a string or a named list), rendered in transformers' Jinja sandbox
(``trim_blocks``, ``lstrip_blocks``, its ``tojson``, ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag) with the named special tokens (``bos_token``...) as variables.

It reads only a local directory: the gateway must not fetch models, and the operator points it at
the same files the workers serve. ``tokenizers`` and ``jinja2`` are imported lazily, so a gateway
without token mode does not need them.

Not reproduced (such requests still route, their chain just stops matching the worker's after
the difference): multimodal placeholders (vLLM expands media into model-specific tokens and keys
those blocks by the media hash anyway), a per-request ``chat_template``, Mistral tokenizers.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from scoring.token_mode import ContentFormat, TokenKeyer, TokenKeyError

__all__ = ["ChatTemplate", "TokenizerLoadError", "load_token_keyer"]

log = logging.getLogger("kvgate.tokenizers")

# transformers 5's SPECIAL_TOKENS_ATTRIBUTES: what apply_chat_template exposes to the template.
_SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TokenizerLoadError(RuntimeError):
    """A model directory cannot be used for token mode (missing files or packages)."""


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise TokenizerLoadError(
            f"token mode needs the `{module}` package (pip install tokenizers jinja2): {e}"
        ) from e


def _hf_environment() -> Any:
    """A Jinja environment that renders templates exactly as transformers' apply_chat_template."""
    jinja2 = _require("jinja2")
    ext = _require("jinja2.ext")
    sandbox = _require("jinja2.sandbox")

    class _Generation(ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (assistant-mask templates): the body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller: Callable[[], str]) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # transformers' override: Jinja's own tojson HTML-escapes, which changes the tokens.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """A model's chat template(s) as a ``scoring.token_mode.ChatRenderer``.

    With several named templates, ``tool_use`` serves requests with tools and ``default`` the rest
    (transformers' rule). ``continue_final_message`` cuts the text after the last message the way
    transformers does (a tag appended to it, everything from the tag on dropped), so a prefill
    continuation renders as the worker renders it.
    """

    def __init__(self, templates: Mapping[str, str], specials: Mapping[str, str]) -> None:
        env = _hf_environment()
        self.sources = dict(templates)
        self._compiled = {name: env.from_string(src) for name, src in templates.items()}
        self._specials = dict(specials)

    def _name(self, tools: Sequence[Any] | None) -> str:
        if not self.sources:
            raise TokenKeyError("the model has no chat template")
        if len(self.sources) == 1:
            return next(iter(self.sources))
        if tools is not None and "tool_use" in self.sources:
            return "tool_use"
        if "default" in self.sources:
            return "default"
        raise TokenKeyError(f"several chat templates and no default: {sorted(self.sources)}")

    def source(self, tools: Sequence[Any] | None = None) -> str:
        """The template a request with (or without) ``tools`` is rendered with."""
        return self.sources[self._name(tools)]

    def __call__(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, /, **kw: Any
    ) -> str:
        name = self._name(tools)
        src, tpl = self.sources[name], self._compiled[name]
        cont = kw.pop("continue_final_message", False)
        documents = kw.pop("documents", None)
        gen = bool(kw.pop("add_generation_prompt", False))
        final_text: str | None = None
        if cont and messages:
            field = cont if isinstance(cont, str) else "content"
            messages = [*messages[:-1], dict(messages[-1])]
            last = messages[-1]
            value = last.get(field)
            if value is None or field not in src:
                raise TokenKeyError("continue_final_message: nothing to continue")
            if isinstance(value, list):
                value = [dict(p) if isinstance(p, Mapping) else p for p in value]
                for p in reversed(value):
                    if isinstance(p, dict) and "text" in p:
                        final_text = str(p["text"])
                        p["text"] = final_text + _CONTINUE_TAG
                        break
                else:
                    raise TokenKeyError("continue_final_message: no text to continue")
                last[field] = value
            else:
                final_text = str(value)
                last[field] = final_text + _CONTINUE_TAG
        variables = {**self._specials, **kw}
        variables.update(messages=messages, tools=tools, documents=documents)
        variables["add_generation_prompt"] = gen
        text: str = tpl.render(**variables)
        if final_text is not None:
            tag = _CONTINUE_TAG.strip()
            if tag not in text:
                raise TokenKeyError("continue_final_message: the template dropped the message")
            at = text.rindex(tag)
            text = text[:at] if text[at:].startswith(_CONTINUE_TAG) else text[:at].rstrip()
        return text


def _detect_content_format(env: Any, source: str) -> ContentFormat:
    """``openai`` when the template loops over a message's ``content`` (expects a list of
    parts), else ``string`` -- vLLM's ``--chat-template-content-format auto``, simplified to
    "some for-loop iterates something's ``content``".
    """
    nodes = _require("jinja2.nodes")
    try:
        ast = env.parse(source)
    except Exception:
        return "string"

    def is_content(n: Any) -> bool:
        while isinstance(n, nodes.Filter | nodes.Test) or (
            isinstance(n, nodes.Getitem) and isinstance(n.arg, nodes.Slice)
        ):
            n = n.node
        if isinstance(n, nodes.Name):
            return bool(n.name == "content")
        if isinstance(n, nodes.Getattr):
            return bool(n.attr == "content")
        if isinstance(n, nodes.Getitem):
            return isinstance(n.arg, nodes.Const) and n.arg.value == "content"
        return False

    return "openai" if any(is_content(f.iter) for f in ast.find_all(nodes.For)) else "string"


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])  # a serialised AddedToken
    return None


def _read_json(p: Path) -> dict[str, Any]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot read {p}: {e}") from e
    return data if isinstance(data, dict) else {}


def _templates(d: Path, config: Mapping[str, Any], override: str | None) -> dict[str, str]:
    """transformers' priority: the .jinja files, then the config's ``chat_template``."""
    if override is not None:
        p = Path(override)
        return {"default": p.read_text(encoding="utf-8") if p.is_file() else override}
    out: dict[str, str] = {}
    if (d / "chat_template.jinja").is_file():
        out["default"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            out[f.stem] = f.read_text(encoding="utf-8")
    if out:
        return out
    ct = config.get("chat_template")
    if isinstance(ct, str):
        return {"default": ct}
    if isinstance(ct, list):
        return {
            str(t["name"]): str(t["template"])
            for t in ct
            if isinstance(t, Mapping) and "name" in t and "template" in t
        }
    return {}


def _specials(d: Path, config: Mapping[str, Any]) -> dict[str, str]:
    sources = [config]
    if (d / "special_tokens_map.json").is_file():
        sources.append(_read_json(d / "special_tokens_map.json"))
    out: dict[str, str] = {}
    for name in _SPECIAL_NAMES:
        for src in sources:
            t = _token_text(src.get(name))
            if t is not None:
                out[name] = t
                break
    return out


def _prepends_first_only(node: Any) -> bool:
    """A Metaspace that prepends only at offset 0 makes encode(a+b) != encode(a)+encode(b)."""
    if isinstance(node, Mapping):
        if node.get("type") == "Metaspace" and node.get("prepend_scheme", "always") not in (
            "always",
            "never",
        ):
            return True
        return any(_prepends_first_only(v) for v in node.values())
    if isinstance(node, list):
        return any(_prepends_first_only(v) for v in node)
    return False


def _boundary_tokens(tok: Any, spec: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(added tokens split out of the raw text, those after which encoding restarts).

    A token that is matched on the raw text (``normalized: false``) cuts the input before
    normalizers and pre-tokenizers run, so what follows it is encoded as if it began the text --
    unless the token swallows the whitespace after it (``rstrip``), only matches as a whole word
    (``single_word``), or a Metaspace pre-tokenizer treats the text's first piece specially.
    """
    raw: list[str] = []
    safe: list[str] = []
    for t in tok.get_added_tokens_decoder().values():
        if t.normalized or not t.content:
            continue
        raw.append(t.content)
        if not (t.rstrip or t.single_word):
            safe.append(t.content)
    if _prepends_first_only(spec.get("pre_tokenizer")) or _prepends_first_only(
        spec.get("normalizer")
    ):
        safe = []
    return raw, safe


def _self_check(encode: Callable[[str], Sequence[int]], safe: list[str], sample: str) -> list[str]:
    """Keep only boundary tokens for which splitting after them really leaves ids unchanged."""
    ok: list[str] = []
    for t in safe:
        texts = [f"Hello there{t}\n\n  next part {t} x{t}{t}y", sample]
        good = True
        for text in texts:
            whole = list(encode(text))
            at = text.find(t)
            while at >= 0 and good:
                b = at + len(t)
                good = list(encode(text[:b])) + list(encode(text[b:])) == whole
                at = text.find(t, b)
            if not good:
                break
        if good:
            ok.append(t)
        else:
            log.warning("token mode: %r is not a safe cut point; not caching after it", t)
    return ok


def load_token_keyer(
    path: str | os.PathLike[str],
    *,
    chat_template: str | None = None,
    content_format: Literal["auto", "string", "openai"] = "auto",
    cache_tokens: int = 1 << 20,
    cache_min_chars: int = 1024,
) -> TokenKeyer:
    """A ``TokenKeyer`` for the model in local directory ``path`` (the files vLLM serves).

    ``chat_template`` (a file or the template itself) and ``content_format`` mirror vLLM's
    ``--chat-template`` and ``--chat-template-content-format``: set them as the workers are
    started. ``cache_tokens`` bounds the prefix-ids cache (4 bytes per token held).
    """
    tokenizers = _require("tokenizers")
    d = Path(path)
    tj = d / "tokenizer.json"
    if not tj.is_file():
        raise TokenizerLoadError(f"{d}: no tokenizer.json (token mode needs a fast tokenizer)")
    try:
        tok = tokenizers.Tokenizer.from_file(str(tj))
    except Exception as e:
        raise TokenizerLoadError(f"cannot load {tj}: {e}") from e
    tok.no_truncation()
    tok.no_padding()
    spec = _read_json(tj)
    cfg_path = d / "tokenizer_config.json"
    config = _read_json(cfg_path) if cfg_path.is_file() else {}
    templates = _templates(d, config, chat_template)
    renderer = ChatTemplate(templates, _specials(d, config))
    if not templates:
        log.warning("token mode: %s has no chat template; chat requests fall back", d)

    # encode_batch_fast releases the GIL and skips offsets: the cheapest call (see the report).
    batch = getattr(tok, "encode_batch_fast", tok.encode_batch)

    def encode(text: str) -> list[int]:
        ids: list[int] = batch([text], add_special_tokens=False)[0].ids
        return ids

    def encode_special(text: str) -> list[int]:
        ids: list[int] = batch([text], add_special_tokens=True)[0].ids
        return ids

    default_src = renderer.source() if templates else ""
    fmt: ContentFormat = "string"
    if content_format != "auto":
        fmt = content_format
    elif templates:
        fmt = _detect_content_format(_hf_environment(), default_src)
    # vLLM turns `developer` into `system` for templates that never mention the role.
    developer = any(q in default_src for q in ('"developer"', "'developer'"))
    raw, safe = _boundary_tokens(tok, spec)
    if safe and cache_tokens > 0:
        sample = ""
        if templates:
            probe = {
                "messages": [
                    {"role": "system", "content": "You route requests. " * 8},
                    {"role": "user", "content": "Explain how a hash map works."},
                    {"role": "assistant", "content": "It hashes keys into buckets.\n"},
                    {"role": "user", "content": " And  collisions?\n\n"},
                ]
            }
            probe_keyer = TokenKeyer(encode, renderer, content_format=fmt, cache_tokens=0)
            try:
                sample = probe_keyer.render(probe)
            except TokenKeyError:
                sample = ""
        safe = _self_check(encode, safe, sample)
    return TokenKeyer(
        encode,
        renderer,
        encode_special=encode_special,
        content_format=fmt,
        developer_role=developer,
        added_tokens=raw,
        safe_boundaries=safe,
        cache_tokens=cache_tokens,
        cache_min_chars=cache_min_chars,
    )


SIM_TOKENIZER = "sim"


def sim_token_keyer(cache_tokens: int = 1 << 20) -> TokenKeyer:
    """Token mode for the simulated workers (``models = { "sim-llama" = "sim" }``): their own
    tokenizer and chat template, so `make run` and the benches key requests exactly as the
    simulators cache them and publish them in their KV events."""
    from workers.sim.tokenizer import encode, render_chat

    def render(
        messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, /, **kw: Any
    ) -> str:
        return render_chat(
            messages, tools, add_generation_prompt=kw.get("add_generation_prompt", True)
        )

    return TokenKeyer(encode, render, cache_tokens=cache_tokens)
