"""The chat templates a tokenizer holds, and the tool-call syntax each asks for.

Named templates are tokenizer_config.json's list form (`default`, `tool_use`, as Hermes-2-Pro and
Command-R ship), which transformers loads as a dict and renders by name: `tool_use` when a request passes
tools, `default` otherwise. mlx-lm infers the tool-call syntax (its tool parser) from a string template
only, once, at load: a model whose tool syntax lives in its `tool_use` template had none, and a template
given with --chat-template kept the parser of the model's own. `set_tool_syntax` infers it from the
template that is used.
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


def rendering_template(tokenizer, with_tools: bool) -> str | None:
    """The template transformers renders a request with: a named set's `tool_use` when the request passes
    tools (and the set has one), else its `default`; the one template either way."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        chosen = template.get("tool_use") if with_tools and "tool_use" in template else template.get("default")
        return chosen if isinstance(chosen, str) else None
    return template if isinstance(template, str) else None


# vLLM's --tool-call-parser names, and what each is here: an mlx-lm parser module, or one of meshlm's
# readers (_MESHLM_READERS: api/llama3_calls.py, api/pythonic_calls.py). Any mlx-lm parser module's own
# name is taken too. vLLM's `pythonic` reads a bare list; mlx-lm's module of that name wants LFM2's
# markers (inferred from their templates), so the name means meshlm's reader here.
TOOL_CALL_PARSERS = {"hermes": "json_tools", "mistral": "mistral", "llama3_json": "llama3", "llama4_json": "llama3",
                     "pythonic": "pythonic-bare", "llama4_pythonic": "pythonic-bare", "qwen3_coder": "qwen3_coder",
                     "kimi_k2": "kimi_k2", "minimax_m2": "minimax_m2", "glm45": "glm47"}
_MESHLM_READERS = {"llama3": ("llama3", "Llama 3 JSON (meshlm's parser)"),
                   "pythonic-bare": ("pythonic", "a bare pythonic list (meshlm's parser)")}


def check_tool_call_parser(name: str) -> None:
    """ValueError unless `name` is "auto" or a parser `force_tool_syntax` knows (before a model loads)."""
    if name != "auto" and TOOL_CALL_PARSERS.get(name, name) not in (*_MESHLM_READERS, *_mlx_lm_parsers()):
        known = ", ".join(sorted({*TOOL_CALL_PARSERS, *_mlx_lm_parsers()}))
        raise ValueError(f"--tool-call-parser {name!r}: no such parser (known: auto, {known})")


def force_tool_syntax(tokenizer, name: str) -> str:
    """--tool-call-parser: read calls in the syntax `name` says whatever the template (which still renders
    the tools when it shows any); a description for the log. ValueError for a name nothing knows."""
    module_name = TOOL_CALL_PARSERS.get(name, name)
    if module_name in _MESHLM_READERS:
        _adopt(tokenizer, None)
        tokenizer._meshlm_tool_syntax, described = _MESHLM_READERS[module_name]
        return described
    check_tool_call_parser(name)
    _adopt(tokenizer, import_mlx_lm(f"mlx_lm.tool_parsers.{module_name}"))
    tokenizer._meshlm_tool_syntax = "mlx-lm"
    return f"mlx-lm's {module_name}"


def _mlx_lm_parsers() -> list[str]:
    import pkgutil

    package = import_mlx_lm("mlx_lm.tool_parsers")
    return [m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")]


def set_tool_syntax(tokenizer, template: str) -> str | None:
    """Give mlx-lm's wrapper the tool parser `template` implies, or none when it implies none (its calls
    are then read in meshlm's fallback syntax); the parser's name, or None."""
    try:  # mlx-lm's own inference (a private function: guarded), over the template it did not look at
        infer = import_mlx_lm("mlx_lm.tokenizer_utils")._infer_tool_parser
        name = infer(SimpleNamespace(chat_template=template, get_vocab=tokenizer.get_vocab))
        module = None if name is None else import_mlx_lm(f"mlx_lm.tool_parsers.{name}")
    except Exception as exc:  # an mlx-lm without it: tools get meshlm's fallback syntax
        log.warning("cannot tell the chat template's tool-call syntax (%s: %s): tools get meshlm's fallback "
                    "prompt", type(exc).__name__, exc)
        name = module = None
    _adopt(tokenizer, module)
    return name


def _adopt(tokenizer, module) -> None:
    """Give mlx-lm's wrapper (mlx_lm.tokenizer_utils.TokenizerWrapper, which reads these in its tool_*
    properties) `module`'s parser and markers, or none."""
    if module is None:
        tokenizer._tool_parser = tokenizer._tool_call_start = tokenizer._tool_call_end = None
        tokenizer._tool_call_start_tokens = tokenizer._tool_call_end_tokens = None
        return
    tokenizer._tool_parser = module.parse_tool_call
    tokenizer._tool_call_start, tokenizer._tool_call_end = module.tool_call_start, module.tool_call_end
    inner = tokenizer._tokenizer
    tokenizer._tool_call_start_tokens = tuple(inner.encode(module.tool_call_start, add_special_tokens=False))
    tokenizer._tool_call_end_tokens = tuple(inner.encode(module.tool_call_end, add_special_tokens=False))


def adopt_tool_parser(tokenizer) -> str | None:
    """The parser a named set's `tool_use` template implies, when mlx-lm found none; its name, or None
    when nothing changed."""
    template = tool_use_template(tokenizer)
    if template is None or getattr(tokenizer, "tool_parser", None) is not None:
        return None
    return set_tool_syntax(tokenizer, template)
