"""Block keys: a block of `block_size` tokens is named by hash(parent key, its token ids).

The chain starts from a salt of everything that changes what a block's KV
means: the model fingerprint, the KV dtype, the block size and the parallel
layout (tp/pp/cp sizes). The rank is deliberately not in the salt: keys are
identical on every rank by construction, each rank storing its own shard of
the block's KV (the rank only names the SSD directory).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

KEY_BYTES = 16


@dataclass(frozen=True)
class CacheSalt:
    model_fingerprint: str
    kv_dtype: str
    layout: str  # e.g. "tp1", "tp2"
    block_size: int

    @property
    def directory(self) -> str:
        """The SSD path component below the model fingerprint: everything else the salt holds,
        so another block size or dtype keeps its own files instead of finding ours foreign."""
        return f"{self.layout}-{self.kv_dtype}-b{self.block_size}"

    def root(self, cache_salt: str | None = None) -> bytes:
        """The chain's first parent; `cache_salt` (a request's, vLLM's): another chain, so only requests
        giving the same salt share blocks (a tenant cannot tell from timing what another one asked)."""
        text = f"meshlm-kv/1|{self.model_fingerprint}|{self.kv_dtype}|{self.layout}|{self.block_size}"
        root = hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()
        if cache_salt is None:
            return root
        return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass"), key=root,
                               digest_size=KEY_BYTES).digest()


def chain_key(parent: bytes, tokens) -> bytes:
    """The key of a block of `tokens` (valid token ids) whose predecessor's key is `parent`."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def block_keys(token_ids: list[int], salt: CacheSalt) -> list[bytes]:
    """Keys of every full block of `token_ids`, in order (a partial tail has none)."""
    bs = salt.block_size
    parent = salt.root()
    keys = []
    for start in range(0, len(token_ids) - bs + 1, bs):
        parent = chain_key(parent, token_ids[start : start + bs])
        keys.append(parent)
    return keys
