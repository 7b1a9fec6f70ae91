"""vLLM's /tokenize and /detokenize: the server's own token ids for a text or a chat, and back.

Clients count tokens with them (a prompt's budget, a context's room) exactly as
this server will, template and tools included, instead of guessing with a
tokenizer of their own.
"""

from __future__ import annotations

from meshlm.api.errors import bad_request
from meshlm.api.schemas import DetokenizeRequest, TokenizeChatRequest, TokenizeRequest
from meshlm.api.serving import Serving
from meshlm.api.tools import ToolPlan


async def tokenize(serving: Serving, req: TokenizeRequest | TokenizeChatRequest, tools: ToolPlan | None) -> dict:
    """`count` may exceed `max_model_len`: the answer says so rather than refusing to count."""
    if isinstance(req, TokenizeChatRequest):
        ids = await serving.prompts.chat(req, tools)
    else:
        ids = await serving.prompts.text(req.prompt, req.add_special_tokens)
    strs = serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(serving: Serving, req: DetokenizeRequest) -> dict:
    """Every id is checked against the vocabulary; special tokens are shown (as vLLM)."""
    if len(req.tokens) > serving.max_model_len:
        raise bad_request(f"at most {serving.max_model_len} tokens (the context) may be detokenized at once",
                          param="tokens")
    serving.prompts.check_ids(req.tokens, "tokens")
    return {"prompt": serving.tokenizer.decode(req.tokens, skip_special_tokens=False)}
