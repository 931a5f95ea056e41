"""The DFlash block-diffusion drafter, in one file, compatible with z-lab checkpoints.

A few Qwen3-style decoder layers read (a) the target's hidden states from a handful
of its layers, fused by ``fc`` + ``hidden_norm`` into one context vector per
committed token, and (b) a block of embeddings: the last committed token followed
by ``mask_token_id`` slots. Block queries attend, non-causally, to the context
keys and to the whole block, so one forward pass gives a distribution for every
slot. The target's embedding and lm_head are shared, never owned, by the drafter.

Context keys and values never change once written, so inference keeps them in a
``DraftContext`` and feeds only the newly committed tokens' features each step.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import EngineError
from engine.models.rows import linear_rows

ARCHITECTURE = "DFlashDraftModel"
SCRIPT = "script.json"  # beside a drafter config: the known continuations of a ``ScriptedDrafter``


class DrafterError(EngineError):
    """A drafter checkpoint or setting that cannot be used; the message says why."""


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` target layers spread from the second to the fourth-from-last."""
    if count == 1:
        return [num_target_layers // 2]
    first, last = 1, num_target_layers - 3
    return [round(first + i * (last - first) / (count - 1)) for i in range(count)]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    input_embedding_scale: float = 1.0
    # measured τ on prompts the drafter never saw: {"prompts", "max_new_tokens", "dflash", "ddtree": {budget: τ}}
    acceptance: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ["full_attention"] * self.num_hidden_layers

    @staticmethod
    def from_json(raw: dict) -> DrafterConfig:
        """Read a z-lab ``config.json`` (``dflash_config`` overrides top-level keys)."""
        architectures = raw.get("architectures") or []
        if ARCHITECTURE not in architectures:
            raise DrafterError(
                f"config.json declares architectures {architectures}, expected {ARCHITECTURE!r}: "
                "this is not a DFlash drafter checkpoint"
            )
        dflash = raw.get("dflash_config") or {}

        def get(name, default=None):
            return dflash.get(name, raw.get(name, default))

        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise DrafterError(f"drafter rope type {rope_type!r} is not supported (only 'default')")
        target_layer_ids = get("target_layer_ids")
        if target_layer_ids is None:
            raise DrafterError("drafter config lacks dflash_config.target_layer_ids")
        mask_token_id = get("mask_token_id")
        if mask_token_id is None:
            raise DrafterError("drafter config lacks dflash_config.mask_token_id")
        try:
            return DrafterConfig(
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=raw["num_attention_heads"],
                num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
                vocab_size=raw["vocab_size"],
                num_target_layers=raw.get("num_target_layers", max(target_layer_ids) + 1),
                target_layer_ids=list(target_layer_ids),
                mask_token_id=int(mask_token_id),
                block_size=int(get("block_size", 16)),
                rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1e6)),
                max_position_embeddings=raw.get("max_position_embeddings", 32768),
                attention_bias=raw.get("attention_bias", False),
                layer_types=list(raw.get("layer_types") or []),
                sliding_window=raw.get("sliding_window"),
                is_causal=raw.get("is_causal"),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=get("final_logit_softcapping"),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                acceptance=dict(raw.get("acceptance") or {}),
            )
        except KeyError as exc:
            raise DrafterError(f"drafter config.json lacks required key {exc}") from exc

    def to_json(self) -> dict:
        """The z-lab layout, so z-lab tooling reads our checkpoints too."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "layer_types": self.layer_types,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": False,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": self.target_layer_ids,
            },
        } | ({"acceptance": self.acceptance} if self.acceptance else {})


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Many blocks of one sequence in one pass (training, the doctor's probe): token ids ``[b, n*B]``
    (anchor token, then masks) and their positions ``[b, n*B]``."""
    b, n = anchors.shape
    tokens = torch.full((b, n, block_size), mask_token_id, dtype=ids.dtype, device=ids.device)
    tokens[:, :, 0] = ids.gather(1, anchors)
    positions = anchors[:, :, None] + torch.arange(block_size, device=ids.device)
    return tokens.view(b, n * block_size), positions.view(b, n * block_size)


def block_visibility(anchors: torch.Tensor, context_length: int, block_size: int, causal: bool = False,
                     window: int | None = None) -> torch.Tensor:
    """Attention mask ``[b, 1, n*B, context_length + n*B]`` (True: visible). A query of block
    j sees context positions strictly before ``anchor_j`` and every slot of block j; a causal layer's
    queries the slots up to their own, a sliding one's the keys less than ``window`` positions away:
    what ``Attention._window_mask`` shows one block at inference, where context row ``r`` is position ``r``."""
    b, n = anchors.shape
    device = anchors.device
    sees_context = torch.arange(context_length, device=device) < anchors[:, :, None]  # [b, n, S]
    sees_context = sees_context.repeat_interleave(block_size, dim=1)  # [b, n*B, S]
    block_of = torch.arange(n * block_size, device=device) // block_size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)  # [b, n*B, n*B]
    visible = torch.cat([sees_context, sees_block], dim=-1)
    if causal or window is not None:
        slots = torch.arange(block_size, device=device)
        queries = (anchors[:, :, None] + slots).view(b, n * block_size, 1)
        keys = torch.cat([torch.arange(context_length, device=device).expand(b, -1), queries[:, :, 0]], dim=1)[:, None]
        visible = narrowed(visible, queries, keys, causal, window)
    return visible[:, None]


def narrowed(visible: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor, causal: bool,
             window: int | None) -> torch.Tensor:
    """``visible`` cut to what a causal and/or sliding-window layer shows (``queries``, ``keys``: positions,
    broadcast against each other)."""
    if causal:
        visible = visible & (keys <= queries)
    if window is not None:
        visible = visible & (queries - keys < window)
        if not causal:
            visible = visible & (keys - queries < window)
    return visible


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [b, heads, len, dim]`` rotated by per-position ``cos``/``sin [b, len, dim]``."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Rotary(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[b, len, head_dim]`` for ``positions [b, len]``."""
        freqs = positions.float()[..., None] * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


@dataclass
class DraftContext:
    """Per-layer keys/values of the committed context, grown as tokens commit."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    length: int = 0

    @staticmethod
    def empty(num_layers: int) -> DraftContext:
        return DraftContext([None] * num_layers, [None] * num_layers)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def visible(self, block: int, added, causal: bool = False, window: int | None = None) -> None:
        return None  # every cached row is real: each layer's own window mask is enough

    def advance(self, added) -> None:
        self.length += added


class StaticDraftContext:
    """The committed context's keys/values in preallocated buffers, so every draft pass has
    the same shapes and can be replayed as a CUDA graph. A pass may bring padding rows after
    its ``added`` real ones: they are written past ``length`` and masked, and the next pass
    overwrites them. Causal and sliding-window layers (z-lab's) see what the growing context's
    ``Attention._window_mask`` shows them: row ``r`` of the context stands at index ``r``, the
    block after the real rows."""

    def __init__(self, config: DrafterConfig, capacity: int, device, dtype: torch.dtype):
        shape = (1, config.num_key_value_heads, capacity, config.head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in config.layer_types]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in config.layer_types]
        self.rows = torch.arange(capacity, device=device)
        self.length = torch.zeros((), dtype=torch.long, device=device)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.length + self.rows[: k.shape[2]]
        self.keys[layer].index_copy_(2, rows, k)
        self.values[layer].index_copy_(2, rows, v)
        return self.keys[layer], self.values[layer]

    def visible(self, block: int, added, causal: bool = False, window: int | None = None) -> torch.Tensor:
        """``[1, 1, 1 or block, capacity + block]`` bool: the real context rows, then the block; a
        causal layer's queries see the block up to themselves, a sliding one's the last ``window``."""
        count = self.length + added
        shown = torch.cat([self.rows < count, torch.ones(block, dtype=torch.bool, device=self.rows.device)])[None, :]
        if not causal and window is None:
            return shown[None, None]
        slots = torch.arange(block, device=self.rows.device)
        queries = count + slots[:, None]
        keys = torch.cat([self.rows, count + slots])[None, :]
        return narrowed(shown, queries, keys, causal, window)[None, None]

    def advance(self, added) -> None:
        self.length += added


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig, layer_type: str):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        bias = config.attention_bias
        self.q_proj = nn.Linear(h, self.heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        # z-lab: sliding-window layers are causal unless the config says otherwise
        sliding = layer_type == "sliding_attention"
        self.is_causal = sliding if config.is_causal is None else bool(config.is_causal)
        self.sliding_window = config.sliding_window if sliding else None

    @property
    def mask_kind(self) -> tuple[bool, int | None]:
        """What decides which keys a query sees: causality and the window."""
        return self.is_causal, self.sliding_window

    def _heads(self, x: torch.Tensor, proj: nn.Linear, count: int) -> torch.Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, count, self.head_dim).transpose(1, 2)

    def forward(self, x, context, rope_block, rope_context, cache: DraftContext | None, layer: int, mask):
        q = apply_rope(self.q_norm(self._heads(x, self.q_proj, self.heads)), *rope_block)
        k_ctx = apply_rope(self._normed_keys(context), *rope_context)
        v_ctx = self._heads(context, self.v_proj, self.kv_heads)
        if cache is not None:
            k_ctx, v_ctx = cache.extend(layer, k_ctx, v_ctx)
        k_blk = apply_rope(self._normed_keys(x), *rope_block)
        v_blk = self._heads(x, self.v_proj, self.kv_heads)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        if mask is None and (self.is_causal or self.sliding_window is not None):
            mask = self._window_mask(q.shape[2], k.shape[2], q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        b, _, n, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))

    def _normed_keys(self, x: torch.Tensor) -> torch.Tensor:
        return self.k_norm(self._heads(x, self.k_proj, self.kv_heads))

    def _window_mask(self, q_len: int, k_len: int, device) -> torch.Tensor:
        query = k_len - q_len + torch.arange(q_len, device=device)[:, None]
        key = torch.arange(k_len, device=device)[None, :]
        visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
        return narrowed(visible, query, key, self.is_causal, self.sliding_window)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_type: str):
        super().__init__()
        self.self_attn = Attention(config, layer_type)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, context, rope_block, rope_context, cache, layer, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, rope_context, cache, layer, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config, t) for t in config.layer_types)
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    graphable = True  # its pass can be captured and replayed as a CUDA graph (``engine.loop.draft_pass``)

    @property
    def hidden_state_indices(self) -> list[int]:
        """Where the tapped layers sit in HF's ``output_hidden_states`` (index 0 is the embeddings,
        so layer ``i``'s output is ``i + 1``: z-lab's convention for ``target_layer_ids``)."""
        return [i + 1 for i in self.config.target_layer_ids]

    def context_features(self, hidden_states) -> torch.Tensor:
        """Concatenate the tapped target layers' outputs; ``hidden_states`` is indexed as HF's."""
        return torch.cat([hidden_states[i] for i in self.hidden_state_indices], dim=-1)

    def embed(self, ids: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, embedding) * self.config.input_embedding_scale

    def forward(
        self,
        block_embeddings: torch.Tensor,
        context_features: torch.Tensor,
        block_positions: torch.Tensor,
        context_positions: torch.Tensor,
        cache: DraftContext | StaticDraftContext | None = None,
        mask: torch.Tensor | None = None,
        context_count: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[b, q, hidden]`` for the block.

        ``context_features [b, c, taps*hidden]`` are the context tokens not yet in
        ``cache`` (all of them when there is no cache); with a ``StaticDraftContext`` only
        the first ``context_count`` of them are real. ``mask`` (bool, ``[b or 1, 1,
        q, ctx + q]``, or a list of them, one per layer) overrides the default visibility;
        training uses it to keep many blocks of one sequence apart, the doctor's probe to run
        layers as other kinds than their own.
        """
        added = context_features.shape[1] if context_count is None else context_count
        kinds = [layer.self_attn.mask_kind for layer in self.layers]
        if cache is not None and mask is None:  # one mask per kind of layer, not per layer
            masks = {kind: cache.visible(block_embeddings.shape[1], added, *kind) for kind in set(kinds)}
            layer_masks = [masks[kind] for kind in kinds]
        elif isinstance(mask, list):
            layer_masks = mask
        else:
            layer_masks = [mask] * len(kinds)
        dtype = block_embeddings.dtype
        context = self.hidden_norm(self.fc(context_features))
        rope_block = self.rotary(block_positions, dtype)
        rope_context = self.rotary(context_positions, dtype)
        x = block_embeddings
        for i, (layer, layer_mask) in enumerate(zip(self.layers, layer_masks)):
            x = layer(x, context, rope_block, rope_context, cache, i, layer_mask)
        if cache is not None:
            cache.advance(added)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        logits = linear_rows(hidden, lm_head) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def initialize(self, seed: int) -> DFlashDrafter:
        """Fresh weights (untrained): small normal linears, unit norms."""
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.data = torch.randn(module.weight.shape, generator=generator) * 0.02
                if module.bias is not None:
                    module.bias.data.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.data.fill_(1.0)
        return self

    def with_extra_layers(self, count: int, seed: int) -> DFlashDrafter:
        """This drafter with ``count`` fresh layers after its own, each adding nothing at first
        (output projections zero), so it drafts exactly what this one does and training grows it
        from there instead of from scratch."""
        config = replace(self.config, num_hidden_layers=self.config.num_hidden_layers + count,
                         layer_types=self.config.layer_types + self.config.layer_types[-1:] * count)
        grown = DFlashDrafter(config).initialize(seed).to(device=self.fc.weight.device, dtype=self.dtype)
        missing, unexpected = grown.load_state_dict(self.state_dict(), strict=False)
        assert not unexpected and all(name.startswith("layers.") and
                                      int(name.split(".")[1]) >= self.config.num_hidden_layers for name in missing)
        for layer in grown.layers[self.config.num_hidden_layers:]:
            layer.self_attn.o_proj.weight.data.zero_()
            layer.mlp.down_proj.weight.data.zero_()
        return grown


class ScriptedDrafter(DFlashDrafter):
    """A drafter that knows the answer: for debugging acceptance and testing exactness deep in trees.

    ``sequences`` are token sequences the target itself produced (prompt + AR output). When a
    block's root (token r at position p) sits in one (``s[p] == r``), slot j proposes the
    sequence's next tokens ``s[p + 1 + j]`` with most of the mass and spreads the rest over
    siblings (the tokens after it in the vocabulary), so a tree is accepted levels deep and
    its branches are really walked. At every ``demote_every``-th position the true token
    ranks third: a chain stops there, a wide enough tree goes on. Elsewhere it proposes
    nothing in particular. A lossless decoder outputs the target's own tokens whatever a
    drafter proposes; this one only decides how deep acceptance goes. Its network runs as
    any drafter's (the cost is real), but the proposals come from the host, so it never
    runs as a CUDA graph.
    """

    TRUE, SIBLINGS, DEMOTED = 20.0, (15.0, 14.0), (22.0, 21.0)  # logits; every other token 0
    graphable = False

    def __init__(self, config: DrafterConfig, sequences: list[list[int]], demote_every: int = 3):
        super().__init__(config)
        self.sequences, self.demote_every = [list(s) for s in sequences], demote_every
        self.roots: list[int] = []  # per block of the pass: its root and where the block starts
        self.block_starts: list[int] = []

    def embed(self, ids: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        self.roots = ids[:, 0].tolist()
        return super().embed(ids, embedding)

    def forward(self, block_embeddings, context_features, block_positions, *args, **kwargs):
        self.block_starts = block_positions[:, 0].tolist()
        return super().forward(block_embeddings, context_features, block_positions, *args, **kwargs)

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """``[..., slots, vocab]`` for ``hidden [..., slots, hidden]``: one block per root of the pass."""
        vocab, slots = lm_head.shape[0], hidden.shape[-2]
        logits = torch.zeros(len(self.roots), slots, vocab, dtype=hidden.dtype)
        for block, (root, start) in enumerate(zip(self.roots, self.block_starts)):
            known = next((s for s in self.sequences if len(s) > start and s[start] == root), [])
            for slot, position in enumerate(range(start + 1, min(start + 1 + slots, len(known)))):
                true = known[position]
                demoted = position % self.demote_every == 0
                logits[block, slot, true] = self.TRUE
                for offset, value in enumerate(self.DEMOTED if demoted else self.SIBLINGS, start=1):
                    logits[block, slot, (true + offset) % vocab] = value
        return logits.to(hidden.device).reshape(*hidden.shape[:-1], vocab)


def write_scripted_drafter(folder: str | Path, config: DrafterConfig, sequences: list[list[int]],
                           demote_every: int = 3) -> Path:
    """A ``ScriptedDrafter`` folder that ``load_drafter`` (and so the app, the bench and the
    vLLM engine's workers) loads like any drafter: its config and its continuations."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config.to_json(), indent=1))
    (folder / SCRIPT).write_text(json.dumps({"sequences": sequences, "demote_every": demote_every}))
    return folder


def fresh_config(target_config, *, num_layers: int, mask_token_id: int, block_size: int = 16,
                 num_taps: int = 5, target_layer_ids: list[int] | None = None) -> DrafterConfig:
    """A drafter shaped like ``target_config`` (a transformers config)."""
    num_target_layers = target_config.num_hidden_layers
    heads = target_config.num_attention_heads
    return DrafterConfig(
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads) or heads,
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        vocab_size=target_config.vocab_size,
        num_target_layers=num_target_layers,
        target_layer_ids=target_layer_ids or spread_layer_ids(num_target_layers, min(num_taps, num_target_layers)),
        mask_token_id=mask_token_id,
        block_size=block_size,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_theta=_rope_theta(target_config),
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 32768),
    )


def _rope_theta(target_config) -> float:
    rope = getattr(target_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(target_config, "rope_theta", 1e4)))


def load_drafter(folder: str | Path, random_weights: bool = False) -> DFlashDrafter:
    """Load a DFlash checkpoint folder (``config.json`` + safetensors, sharded or not); with
    ``random_weights``, its ``config.json`` alone, initialised in place (timing only)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_drafter_config(folder)
    if (folder / SCRIPT).is_file():
        script = json.loads((folder / SCRIPT).read_text())
        return ScriptedDrafter(config, script["sequences"], script.get("demote_every", 3)).initialize(0)
    if random_weights:
        return DFlashDrafter(config).initialize(0)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise DrafterError(f"drafter folder {str(folder)!r} has no .safetensors weights")
    state = {}
    try:
        for path in weight_files:
            state.update(load_file(str(path)))
    except (SafetensorError, OSError) as exc:
        raise DrafterError(f"drafter weights in {str(folder)!r} are unreadable (corrupt or truncated?): {exc}") from exc
    state = {_strip_prefix(name): tensor for name, tensor in state.items()}
    drafter = DFlashDrafter(config)
    expected = set(drafter.state_dict())
    missing = sorted(expected - state.keys())
    unexpected = sorted(k for k in state.keys() - expected if not k.startswith(("embed_tokens", "lm_head")))
    if missing or unexpected:
        raise DrafterError(
            f"drafter weights do not match its config: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}"
        )
    drafter.load_state_dict({k: state[k] for k in expected})
    return drafter


def read_drafter_config(folder: str | Path) -> DrafterConfig:
    """A DFlash checkpoint folder's ``config.json``, or a clear error saying what is wrong with it."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise DrafterError(f"drafter folder {str(folder)!r} does not exist; "
                           "pass a DFlash checkpoint folder or 'random'")
    if not config_path.is_file():
        raise DrafterError(f"drafter folder {str(folder)!r} has no config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"drafter config.json is not valid JSON: {exc}") from exc
    return DrafterConfig.from_json(raw)


def drafter_shape(folder: str | Path) -> DFlashDrafter:
    """A drafter's structure without weights (on the meta device): what a process that only
    checks settings against it needs, at any size."""
    config = read_drafter_config(folder)
    with torch.device("meta"):
        return DFlashDrafter(config)


def weights_digest(folder: str | Path) -> str:
    """A short fingerprint of a checkpoint's weight files (a scripted drafter's script too): which
    drafter a result was measured with."""
    digest = hashlib.sha256()
    for path in sorted(Path(folder).glob("*.safetensors")) + sorted(Path(folder).glob(SCRIPT)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def _strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def save_drafter(drafter: DFlashDrafter, folder: str | Path, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = drafter.config.to_json() | (extra or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))


def parameter_count(module: nn.Module) -> int:
    return sum(math.prod(p.shape) for p in module.parameters())
