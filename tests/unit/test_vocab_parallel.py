"""The vocabulary-split LM head of tensor parallelism (model/vocab_parallel.py): the ranks' zero-padded
slices sum to exactly the whole head's logits, an untied head's or a tied table's, and only a head that
splits evenly is split."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from meshlm.model import cpu_kernels
from meshlm.model.vocab_parallel import TiedVocabSplit, VocabShardedHead, shard_vocab_head

NATIVE, NATIVE_STATUS = cpu_kernels.native_ops()


@dataclass
class Group:  # what shard_vocab_head reads of an MLX group
    _rank: int
    _size: int

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("size", [2, 4])
def test_the_slices_sum_to_the_whole_heads_logits(bias, size):
    head = nn.Linear(64, 160, bias=bias)
    x = mx.random.normal((1, 5, 64))
    parts = [VocabShardedHead(head, r, size, Group(r, size)) for r in range(size)]
    assert all(p.local.weight.shape == (160 // size, 64) for p in parts)
    total = sum(p.padded(x) for p in parts)
    assert total.shape == (1, 5, 160)
    assert mx.abs(total - head(x)).max().item() < 1e-5


def test_a_packed_slice_keeps_its_logits():
    native, _ = cpu_kernels.native_ops()
    head = nn.Linear(64, 64)
    part = VocabShardedHead(head, 1, 2, Group(1, 2))
    x = mx.random.normal((3, 64))
    want = part.padded(x)
    assert cpu_kernels.transpose_linears(part, native) == 1  # its slice, like any linear layer
    assert mx.abs(part.padded(x) - want).max().item() < 1e-5
    assert mx.abs(part.padded(x)[:, :32]).max().item() == 0.0  # rank 0's columns are left to rank 0


def test_only_an_untied_float_head_the_ranks_divide_is_split():
    from mlx_lm.models import llama

    def model(vocab: int, tied: bool = False) -> nn.Module:
        args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=vocab,
                               tie_word_embeddings=tied)
        return llama.Model(args)

    m = model(96)
    whole = m.lm_head.weight
    assert shard_vocab_head(m, Group(1, 2))
    assert isinstance(m.lm_head, VocabShardedHead)
    assert mx.array_equal(m.lm_head.local.weight, whole[48:])
    tied = model(96, tied=True)
    table = tied.model.embed_tokens
    assert shard_vocab_head(tied, Group(1, 2))  # the head is the embedding table: split, the table kept whole
    assert isinstance(tied.model.embed_tokens, TiedVocabSplit) and tied.model.embed_tokens.table is table
    assert not shard_vocab_head(model(80, tied=True), Group(0, 2))  # 40 rows a rank: not whole 16-row panels
    assert not shard_vocab_head(model(97), Group(0, 2))  # an uneven split
    assert not shard_vocab_head(model(96), Group(0, 1))  # one rank
    quantized = model(96)
    quantized.lm_head = quantized.lm_head.to_quantized(group_size=32, bits=4)
    assert not shard_vocab_head(quantized, Group(0, 2))
    with pytest.raises(ValueError, match="does not split"):
        VocabShardedHead(nn.Linear(8, 10), 0, 4, Group(0, 4))


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.skipif(
    NATIVE is None or not NATIVE.packed_gemm, reason=f"packed GEMM not built: {NATIVE_STATUS}"))])
@pytest.mark.parametrize("size", [2, 4])
def test_a_tied_tables_slices_sum_to_its_logits_and_lookups_stay_whole(size, packed):
    table = nn.Embedding(128, 48)
    ids = mx.array([[0, 5, 127, 64, 31]])
    x = mx.random.normal((1, 5, 48))
    want = table.as_linear(x)
    splits = [TiedVocabSplit(table, r, size, Group(r, size)) for r in range(size)]
    if packed:  # what adapt does on the CPU: the table inside the split is packed
        for split in splits:
            split.table = cpu_kernels.PackedEmbedding(table, NATIVE)
    assert all(mx.array_equal(s(ids), table(ids)).item() for s in splits)
    parts = [s.padded(x) for s in splits]
    per = 128 // size
    for r, part in enumerate(parts):  # each rank fills its own columns only
        outside = mx.concatenate([part[..., : r * per], part[..., (r + 1) * per:]], axis=-1)
        assert outside.size == 0 or mx.abs(outside).max().item() == 0.0
    assert mx.abs(sum(parts) - want).max().item() < 1e-5


@pytest.mark.skipif(NATIVE is None or not NATIVE.packed_gemm, reason=f"packed GEMM not built: {NATIVE_STATUS}")
def test_adapt_packs_the_table_inside_a_tied_split():
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96,
                           tie_word_embeddings=True)
    m = llama.Model(args)
    assert shard_vocab_head(m, Group(0, 2))
    assert cpu_kernels.pack_tied_embedding(m, NATIVE)
    split = m.model.embed_tokens
    assert type(split) is TiedVocabSplit and type(split.table) is cpu_kernels.PackedEmbedding
    x = mx.random.normal((3, 64))
    assert mx.abs(split.padded(x)[:, :48] - split.table.as_linear(x)[:, :48]).max().item() < 1e-5
    params = [name for name, _ in tree_flatten(m.parameters())]
    assert sum(1 for name in params if "embed_tokens" in name) == 1  # the panels once: no cached view counted
    assert cpu_kernels.half_table(m) is None
    rounded = llama.Model(args)  # a bf16 checkpoint's table: packed as bf16 inside the split too
    rounded.model.embed_tokens.weight = rounded.model.embed_tokens.weight.astype(mx.bfloat16).astype(mx.float32)
    assert shard_vocab_head(rounded, Group(1, 2)) and cpu_kernels.pack_tied_embedding(rounded, NATIVE)
    assert cpu_kernels.half_table(rounded) == "bfloat16"
    assert mx.array_equal(rounded.model.embed_tokens.padded(x)[:, 48:],
                          rounded.model.embed_tokens.table.as_linear(x)[:, 48:]).item()
