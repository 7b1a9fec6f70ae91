"""A tokenizer's named chat templates: tokenizer_config.json's list form (`default`, `tool_use`, as
Hermes-2-Pro and Command-R ship), which transformers loads as a dict and renders by name (`tool_use`
when a request has tools).

mlx-lm infers the tool-call syntax (its tool parser) from a string template only, so a model whose tool
syntax lives in its `tool_use` template had none: its tools were described by meshlm's fallback prompt
and its own calls came back as text. `adopt_tool_parser` infers it from that template instead.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

from meshlm.platform import import_mlx_lm

log = logging.getLogger(__name__)


def template_texts(tokenizer) -> list[str]:
    """Every chat template the tokenizer holds: one string, or each named one."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return [template]
    if isinstance(template, dict):
        return [t for t in template.values() if isinstance(t, str)]
    return []


def tool_use_template(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict) and isinstance(template.get("tool_use"), str):
        return template["tool_use"]
    return None


def adopt_tool_parser(tokenizer) -> str | None:
    """Give mlx-lm's wrapper the tool parser its `tool_use` template implies, when mlx-lm found none;
    the parser's name, or None when nothing changed."""
    template = tool_use_template(tokenizer)
    if template is None or getattr(tokenizer, "tool_parser", None) is not None:
        return None
    try:  # mlx-lm's own inference, over the template it did not look at (a private function: guarded)
        infer = import_mlx_lm("mlx_lm.tokenizer_utils")._infer_tool_parser
        name = infer(SimpleNamespace(chat_template=template, get_vocab=tokenizer.get_vocab))
        if name is None:
            return None
        module = import_mlx_lm(f"mlx_lm.tool_parsers.{name}")
    except Exception as exc:  # an mlx-lm without it: tools keep meshlm's fallback syntax
        log.warning("the model's tool_use chat template names no tool-call syntax this mlx-lm knows (%s: %s)",
                    type(exc).__name__, exc)
        return None
    # The wrapper (mlx_lm.tokenizer_utils.TokenizerWrapper) reads these in its tool_* properties.
    tokenizer._tool_parser = module.parse_tool_call
    tokenizer._tool_call_start, tokenizer._tool_call_end = module.tool_call_start, module.tool_call_end
    inner = tokenizer._tokenizer
    tokenizer._tool_call_start_tokens = tuple(inner.encode(module.tool_call_start, add_special_tokens=False))
    tokenizer._tool_call_end_tokens = tuple(inner.encode(module.tool_call_end, add_special_tokens=False))
    return name
