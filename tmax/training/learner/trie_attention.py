"""Attention over a prefix trie (training.algo.prefix_trie): each node attends to its
ancestors and itself, so one forward over the trie's nodes gives every node the hidden
state it has in each sequence through it, and the backward sends each shared prefix the
sum of its sequences' gradients.

The trie's nodes are cut into chains (`PrefixTrie.chains`); a chain's queries attend to
its ancestors' keys (all of them) and to the chain's own keys causally, one
scaled-dot-product call per chain, its mask the lower-right causal bias (torch's
`causal_lower_right`: on CUDA a flash / memory-efficient kernel with no mask in memory; on
CPU the chain's [chain x keys] mask). No [nodes x nodes] mask is ever made: the cost is the
sum over nodes of their depth, what each sequence alone would cost minus the prefixes it
shares.

The function is registered with transformers' attention registry under `TRIE_ATTENTION`
and the learner's model uses it. The learner passes the chains of a forward as the
`prefix_trie` keyword (transformers hands layer keywords down to the attention function)
together with an `attention_mask` mapping that skips transformers' own mask building; a
forward without `prefix_trie` is plain causal SDPA. Models whose layers are not all
softmax attention (linear-attention hybrids) do not honour it, which the learner checks
once (`Learner._trie_works`) before relying on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import CausalBias, causal_lower_right

from tmax.training.algo.prefix_trie import PrefixTrie

TRIE_ATTENTION = "tmax_prefix_trie"


@dataclass
class TrieChains:
    """The attention plan of one trie on one device: per chain its query range, the key
    nodes it attends to (ancestors, then its own) and the mask over them (None: plain
    causal, a chain with no ancestors)."""

    ranges: list[tuple[int, int]]
    keys: list[torch.Tensor]
    masks: list[CausalBias | None]

    @classmethod
    def of(cls, trie: PrefixTrie, device: torch.device) -> "TrieChains":
        ranges, keys, masks = [], [], []
        for c in trie.chains():
            n, above = c.end - c.start, len(c.ancestors)
            ranges.append((c.start, c.end))
            keys.append(torch.tensor([*c.ancestors, *range(c.start, c.end)], dtype=torch.long, device=device))
            # Query j sees every ancestor and chain nodes 0..j: key k allowed iff k <= j + above,
            # causal aligned to the lower right.
            masks.append(causal_lower_right(n, above + n) if above else None)
        return cls(ranges, keys, masks)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def trie_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           prefix_trie: TrieChains | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, heads, nodes, dim], key and
    value [1, kv_heads, nodes, dim]; returns [1, nodes, heads, dim]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if prefix_trie is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") or query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("prefix-trie attention takes one row, no sliding window and no attention mask")
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    outs = []
    for (start, end), idx, mask in zip(prefix_trie.ranges, prefix_trie.keys, prefix_trie.masks):
        outs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], key.index_select(2, idx), value.index_select(2, idx),
            attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `TRIE_ATTENTION` a valid `attn_implementation` (idempotent): the attention
    function above, and SDPA's mask for the plain forwards that build one."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(TRIE_ATTENTION, trie_attention_forward)
    AttentionMaskInterface.register(TRIE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def no_mask(config) -> dict[str, None]:
    """The `attention_mask` argument that makes a transformers model skip its own mask
    building (one entry per layer type)."""
    return {t: None for t in set(getattr(config, "layer_types", None) or ["full_attention"])}
