"""Exact tree verification through hybrid targets: Gated DeltaNet layers mixed with full attention.

Qwen3.5 / Qwen3.6 / Qwen3-Next interleave full-attention layers with Gated DeltaNet
("linear attention") layers. An attention layer scores a whole tree in one pass with
the ancestors-only mask, as for any target. A linear layer instead carries a state
from token to token: a short causal-convolution window over its last inputs and a
recurrent matrix updated by the gated delta rule. In a tree, siblings share their
parent's state and then diverge, so one sequential pass over the nodes would mix
branches. Here every node gets its own state, forked from its parent's:

* projections, normalisation, MLP and attention run once over all nodes, as usual;
* each node's convolution window is gathered from its own ancestors' inputs (the
  committed window above the root), so the convolution of all nodes is one batched call;
* the recurrence runs depth by depth: the nodes of one depth form a batch whose initial
  states are their parents' states (the root's parent is the committed state), updated
  by the model's own single-token kernel.

Until acceptance the committed states stay untouched; ``commit_cache`` then makes the
accepted leaf's window and state the committed ones (the state by replaying the accepted
path's kept kernel inputs, rather than keeping every node's large state) and compacts
the attention layers' KV rows as for any target. Every node is computed by the model's
own single-token kernels, so greedy outputs equal its token-by-token decoding; a DFlash
chain is just a width-1 tree through the same code.

The prompt's prefill is a plain causal sequence and runs through the model's own forward
(chunked delta rule); ``tree_forward`` takes over once the cache holds a state.

    python -m engine.models.hybrid --cost    # verify time vs tree budget, hybrid vs pure attention (CPU)
"""

from __future__ import annotations

import argparse
import functools
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

import ddtree
from ddtree import forks
from engine.errors import EngineError

LINEAR = "linear_attention"
# transformers families whose linear layers are Gated DeltaNets with the single-token
# kernels this module reuses (Qwen3.6 checkpoints load as ``qwen3_5``)
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")


def is_hybrid(config) -> bool:
    """Whether the target has linear-attention layers (and so needs forked states in trees)."""
    return LINEAR in (getattr(config, "layer_types", None) or [])


# ---------------------------------------------------------------------------------------------
# The tree's shape, shared by every linear layer of one verify pass
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TreePlan:
    """Which state every node forks from, and which inputs fill its convolution window.

    State slots: slot 0 is the committed state (before the root), slot ``i + 1`` the state
    after node ``i``. Convolution inputs are numbered as columns of ``[committed window |
    node 0 input | node 1 input | ...]``, so column ``width + i`` is node ``i``'s input.
    """

    parent_slots: torch.Tensor  # [q] long: the slot node i starts from
    depth_groups: list[torch.Tensor]  # node indices per depth, root's depth first
    windows: torch.Tensor  # [q + 1, width] long: per slot, the columns of its last `width` inputs

    @staticmethod
    def from_tree(parents: torch.Tensor, visible: torch.Tensor, width: int,
                  device: torch.device | str = "cpu") -> TreePlan:
        """``parents[i]`` is node i's parent (``-1``: it hangs below the committed state), parents
        before children; ``visible`` the ancestors-and-self mask. A node's window is the last
        ``width`` inputs of its path (``ddtree.forks``)."""
        depth = forks.depths(visible)
        table = forks.path_table(visible, int(depth.max()) + 1)
        windows = torch.cat([torch.arange(width)[None], forks.window_columns(table, depth, width)])
        groups = [torch.nonzero(depth == d).flatten() for d in range(int(depth.max()) + 1)]
        return TreePlan((parents + 1).to(device), [g.to(device) for g in groups], windows.to(device))


def tree_from_bias(attention_bias: torch.Tensor | None, q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each verified node's parent and the ancestors-and-self mask, read off the additive tree
    mask (``None``: a causal chain).

    Row i sees its ancestors and itself; parents precede children, so the parent is the
    last visible column before i. The mask must be exactly ancestor-closed (each row is
    its parent's row plus the diagonal), otherwise there is no tree to fork states along.
    """
    if attention_bias is None:
        return torch.arange(q) - 1, torch.ones(q, q, dtype=torch.bool).tril()
    block = attention_bias[0, 0, :, -q:]
    visible = (block > torch.finfo(block.dtype).min / 2).cpu()
    columns = torch.arange(q)
    earlier = visible & (columns[None, :] < columns[:, None])
    parents = torch.where(earlier, columns[None, :], -1).max(dim=1).values
    expected = torch.eye(q, dtype=torch.bool) | (visible[parents.clamp(min=0)] & (parents >= 0)[:, None])
    if not torch.equal(visible, expected):
        raise EngineError("the attention mask is not a tree mask (each node must see exactly its ancestors and "
                          "itself): a hybrid target's linear-attention layers can only verify trees")
    return parents, visible


# ---------------------------------------------------------------------------------------------
# Cache: the committed states live in transformers' cache; the tree's forked states wait beside it
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recurrence:
    """What the gated delta rule reads per node, after projections and convolution.

    The nodes are a batch of one-token sequences (``[q, 1, heads, ...]``): a depth's nodes
    go through the kernel together, and any root-to-node path can be replayed as one
    sequence to rebuild that node's state from the committed one.
    """

    query: torch.Tensor  # [q, 1, k_heads, k_dim]
    key: torch.Tensor  # [q, 1, k_heads, k_dim]
    value: torch.Tensor  # [q, 1, v_heads, v_dim]
    g: torch.Tensor  # [q, 1, v_heads]: log decay
    beta: torch.Tensor  # [q, 1, v_heads]: write strength

    def select(self, nodes: torch.Tensor) -> Recurrence:
        return Recurrence(*(t[nodes] for t in self.fields()))

    def as_sequence(self, path: torch.Tensor) -> Recurrence:
        """The nodes along ``path`` as one sequence ``[1, len(path), ...]``."""
        return Recurrence(*(t[path].transpose(0, 1).contiguous() for t in self.fields()))

    def fields(self) -> tuple[torch.Tensor, ...]:
        return self.query, self.key, self.value, self.g, self.beta

    def run(self, kernel, initial_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``kernel`` is the model file's single-token gated delta rule: (outputs, final states)."""
        return kernel(self.query, self.key, self.value, g=self.g, beta=self.beta, initial_state=initial_state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)


@dataclass
class ForkedLayer:
    """One linear layer's view of the tree, kept until acceptance: enough to rebuild any node's state.

    Only the small per-node inputs are kept, not per-node recurrent states: a state is
    v_heads x k_dim x v_dim float32 (2 MB at 32 heads of 128 x 128), so keeping every
    node's across 48 linear layers would cost ~100 MB per tree node; replaying the
    accepted path (at most a block of single-token steps) costs next to nothing.
    """

    conv_inputs: torch.Tensor  # [1, channels, width + q]: committed window, then each node's conv input
    recurrence: Recurrence
    kernel: Callable  # the model file's torch_recurrent_gated_delta_rule (FLA's where installed)


@dataclass
class PendingTree:
    plan: TreePlan
    layers: dict[int, ForkedLayer] = field(default_factory=dict)


class TreeCache(DynamicCache):
    """transformers' hybrid cache plus the forked states of the tree being verified.

    Prefill fills it through the model's own forward like any ``DynamicCache``; after a
    ``tree_forward`` its linear layers still hold the committed states and ``pending``
    holds what every node's state derives from, until ``commit_cache`` commits the
    accepted leaf's.
    """

    def __init__(self, config):
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise EngineError(f"tree verification through linear-attention layers supports Qwen3.5 / Qwen3.6 / "
                              f"Qwen3-Next targets ({', '.join(SUPPORTED_MODEL_TYPES)}); this target is {model_type!r}")
        super().__init__(config=config)
        self.pending: PendingTree | None = None

    @property
    def prefilled(self) -> bool:
        return any(isinstance(layer, LinearAttentionCacheLayerMixin) and layer.has_previous_state[0]
                   for layer in self.layers)


def verifies_tree(cache) -> bool:
    """Whether ``cache`` belongs to a hybrid target past its prefill, so verifies go through ``tree_forward``."""
    return isinstance(cache, TreeCache) and cache.prefilled


def commit_cache(cache, past_length: int, accepted: list[int]) -> None:
    """Keep the accepted path: attention layers keep its KV rows, linear layers take its leaf's state.

    Works for any target's ``DynamicCache``; on a pure-attention one it only compacts KV rows.
    """
    pending = getattr(cache, "pending", None)
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            layer.keys = ddtree.compact_rows(layer.keys, past_length, accepted)
            layer.values = ddtree.compact_rows(layer.values, past_length, accepted)
        if pending is not None and index in pending.layers:
            _commit_leaf(layer, pending.layers[index], pending.plan, accepted)
    if pending is not None:
        cache.pending = None  # a tree is committed once


def _commit_leaf(layer, forked: ForkedLayer, plan: TreePlan, accepted: list[int]) -> None:
    """Make the leaf's window and state the committed ones (in place: transformers marks these
    buffers as static addresses for CUDA graphs)."""
    layer.conv_states[0].copy_(forked.conv_inputs[:, :, plan.windows[accepted[-1] + 1]])
    path = torch.tensor(accepted, device=forked.conv_inputs.device)
    _, state = forked.recurrence.as_sequence(path).run(forked.kernel, layer.recurrent_states[0])
    layer.recurrent_states[0].copy_(state)


# ---------------------------------------------------------------------------------------------
# The forward pass
# ---------------------------------------------------------------------------------------------


@functools.cache
def cache_argument(model_class: type) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x) and warns on the old name."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _rotary_positions(config, position_ids):
    """Position ids as the rotary embedding takes them: multimodal rotary (Qwen3.5/3.6) wants one row
    per grid axis, ``[3, 1, q]``; text tokens sit at the same position on all three. Some transformers
    releases expand ``[1, q]`` inside the embedding, others only in the model's forward."""
    rope = getattr(config, "rope_parameters", None) or {}
    return position_ids.expand(3, *position_ids.shape) if "mrope_section" in rope else position_ids


def tree_forward(model, input_ids, position_ids, cache: TreeCache, attention_bias=None, hidden_states=False):
    """``Target.forward`` for a hybrid target after prefill: logits ``[q, vocab]`` and hidden states.

    ``input_ids``/``position_ids`` are ``[1, q]`` (root first); ``attention_bias`` is the
    additive ancestors-only mask ``[1, 1, q, past + q]`` (``None``: the nodes form a chain).
    Attention layers append the q rows to their KV cache; linear layers leave the committed
    states untouched and keep what each node's state derives from in ``cache.pending``.
    """
    decoder = model.get_decoder()
    q = input_ids.shape[1]
    parents, visible = tree_from_bias(attention_bias, q)
    if attention_bias is None and q > 1:
        # the attention layers need the chain's causal mask explicitly: the past is not in the query block
        attention_bias = ddtree.attention_bias(ddtree.ancestor_mask(parents[1:].clamp(min=0)).to(input_ids.device),
                                               cache.get_seq_length(), model.dtype)
    plan = TreePlan.from_tree(parents, visible, _conv_width(cache), input_ids.device)
    cache.pending = PendingTree(plan)

    hidden = decoder.embed_tokens(input_ids)
    position_embeddings = decoder.rotary_emb(hidden, _rotary_positions(decoder.config, position_ids))
    collected = [hidden]
    for index, layer in enumerate(decoder.layers[: decoder.config.num_hidden_layers]):
        if decoder.config.layer_types[index] == LINEAR:
            hidden = _linear_decoder_layer(layer, hidden, plan, cache, index)
        else:
            hidden = layer(hidden, position_embeddings=position_embeddings, attention_mask=attention_bias,
                           position_ids=position_ids, **{cache_argument(type(layer)): cache})
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        collected.append(hidden)
    hidden = decoder.norm(hidden)
    collected[-1] = hidden  # like transformers: the last hidden state is the normalised one
    logits = model.get_output_embeddings()(hidden)
    return logits[0], (tuple(collected) if hidden_states else None)


def _conv_width(cache: TreeCache) -> int:
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin) and layer.has_previous_state[0]:
            return layer.conv_states[0].shape[-1]
    raise EngineError("tree_forward needs a prefilled cache: run the prompt through the model first")


def _linear_decoder_layer(layer, hidden, plan: TreePlan, cache: TreeCache, index: int) -> torch.Tensor:
    """The decoder layer's own residual structure, with the token mixer forked per node."""
    residual = hidden
    hidden = residual + _forked_delta_net(layer.linear_attn, layer.input_layernorm(hidden), plan, cache, index)
    residual = hidden
    mlp_out = layer.mlp(layer.post_attention_layernorm(hidden))
    mlp_out = mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out  # MoE blocks may return router logits too
    return residual + mlp_out


def _forked_delta_net(net, x: torch.Tensor, plan: TreePlan, cache: TreeCache, index: int) -> torch.Tensor:
    """A Gated DeltaNet over the tree's nodes ``x [1, q, hidden]``; each node sees only its ancestors.

    Mirrors the module's single-token decode path (same kernels, same dtypes), with the
    tree's nodes as the batch: that is what makes the result equal token-by-token decoding.
    """
    kernels = sys.modules[type(net).__module__]  # the model file's kernels (hub/FLA ones where installed)
    layer_cache = cache.layers[index]
    committed_window, committed_state = layer_cache.conv_states[0], layer_cache.recurrent_states[0]
    q = x.shape[1]

    mixed_qkv, z, b, a = _project(net, x)  # mixed_qkv [1, channels, q]
    conv_inputs = torch.cat([committed_window, mixed_qkv], dim=-1)
    windows = conv_inputs[0][:, plan.windows[plan.parent_slots]].permute(1, 0, 2).contiguous()  # [q, channels, width]
    mixed_qkv = kernels.causal_conv1d_update(mixed_qkv[0].T[:, :, None].contiguous(), windows,
                                             net.conv1d.weight.squeeze(1), net.conv1d.bias, net.activation)
    query, key, value = torch.split(mixed_qkv.transpose(1, 2), [net.key_dim, net.key_dim, net.value_dim], dim=-1)
    g = -net.A_log.float().exp() * torch.nn.functional.softplus(a.float() + net.dt_bias)
    # value heads share key heads in groups; repeated here because older transformers kernels expect
    # one key head per value head (newer ones accept either)
    group = net.num_v_heads // net.num_k_heads
    query, key = (t.reshape(q, 1, -1, net.head_k_dim).repeat_interleave(group, dim=2) for t in (query, key))
    recurrence = Recurrence(query=query, key=key, value=value.reshape(q, 1, -1, net.head_v_dim), g=g.transpose(0, 1),
                            beta=b.sigmoid().transpose(0, 1))

    # per-node states live only while this layer runs; slot 0 is the committed state
    states = committed_state.new_empty((q + 1, *committed_state.shape[1:]))
    states[0] = committed_state[0]
    core = recurrence.value.new_empty(recurrence.value.shape)
    for nodes in plan.depth_groups:  # a depth's states depend only on the previous depth's
        out, new_states = recurrence.select(nodes).run(kernels.torch_recurrent_gated_delta_rule,
                                                       states[plan.parent_slots[nodes]])
        states[nodes + 1] = new_states.to(states.dtype)
        core[nodes] = out.to(core.dtype)
    cache.pending.layers[index] = ForkedLayer(conv_inputs, recurrence, kernels.torch_recurrent_gated_delta_rule)

    core = net.norm(core.reshape(-1, net.head_v_dim), z.reshape(-1, net.head_v_dim))
    return net.out_proj(core.reshape(1, q, -1))


def _project(net, x: torch.Tensor):
    """The module's input projections: conv input ``[1, channels, q]``, gate z, and b, a ``[1, q, v_heads]``."""
    if hasattr(net, "in_proj_qkvz"):  # Qwen3-Next packs q, k, v, z (and b, a) per key-head group
        query, key, value, z, b, a = net.fix_query_key_value_ordering(net.in_proj_qkvz(x), net.in_proj_ba(x))
        query, key, value = (t.reshape(t.shape[0], t.shape[1], -1) for t in (query, key, value))
        return torch.cat((query, key, value), dim=-1).transpose(1, 2), z, b, a
    z = net.in_proj_z(x).reshape(x.shape[0], x.shape[1], -1, net.head_v_dim)
    return net.in_proj_qkv(x).transpose(1, 2), z, net.in_proj_b(x), net.in_proj_a(x)


# ---------------------------------------------------------------------------------------------
# Cost: verify time vs tree budget, hybrid vs pure attention of the same shape
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostRow:
    budget: int
    nodes: int
    depth: int
    attention_ms: float
    hybrid_ms: float


def measure_verify_cost(budgets=(1, 4, 16, 64, 256), hidden_size: int = 512, layers: int = 8, vocab: int = 8192,
                        context: int = 256, block_size: int = 16, repeats: int = 5, dtype: torch.dtype = torch.float32,
                        seed: int = 0) -> tuple[list[CostRow], dict]:
    """Median wall time of one verify pass per tree budget, on two random Qwen3.5-shaped models
    that differ only in their token mixers: 3 of every 4 layers Gated DeltaNet, or all attention."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    def build(layer_types):
        torch.manual_seed(seed)
        config = Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=hidden_size, intermediate_size=3 * hidden_size, num_hidden_layers=layers,
            layer_types=layer_types, num_attention_heads=8, num_key_value_heads=2, head_dim=hidden_size // 8,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=hidden_size // 8,
            linear_value_head_dim=hidden_size // 8, max_position_embeddings=4 * context + 4096)
        return Qwen3_5ForCausalLM(config).to(dtype).eval()

    hybrid_model = build([LINEAR if (i + 1) % 4 else "full_attention" for i in range(layers)])
    attention_model = build(["full_attention"] * layers)
    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(seed))
    generator = torch.Generator().manual_seed(seed + 1)
    rows = []
    with torch.inference_mode():
        caches = {}
        for name, model in (("attention", attention_model), ("hybrid", hybrid_model)):
            caches[name] = TreeCache(model.config) if is_hybrid(model.config) else DynamicCache(config=model.config)
            model(input_ids=prompt, use_cache=True, **{cache_argument(type(model)): caches[name]})
        for budget in budgets:
            # a peaked draft, like a trained drafter's: the tree branches at several depths
            log_probs = torch.log_softmax(torch.randn(block_size - 1, vocab, generator=generator) * 4, dim=-1)
            tree = ddtree.build_tree(log_probs, budget)
            inputs = ddtree.compile_tree(tree, root_token=0, start=context)
            bias = ddtree.attention_bias(inputs.visible, context, dtype)
            times = {}
            for name, model in (("attention", attention_model), ("hybrid", hybrid_model)):
                samples = []
                for _ in range(repeats + 1):  # the first pass warms up
                    begin = time.perf_counter()
                    _verify(model, caches[name], inputs, bias)
                    samples.append(time.perf_counter() - begin)
                    _roll_back(caches[name], context)
                times[name] = 1000 * sorted(samples[1:])[len(samples[1:]) // 2]
            rows.append(CostRow(budget, tree.size + 1, int(tree.depths.max()) if tree.size else 0,
                                times["attention"], times["hybrid"]))
    setup = {
        "hidden_size": hidden_size, "layers": layers, "vocab": vocab, "context": context,
        "linear_layers": hybrid_model.config.layer_types.count(LINEAR),
        "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
        "params_hybrid_M": sum(p.numel() for p in hybrid_model.parameters()) / 1e6,
        "params_attention_M": sum(p.numel() for p in attention_model.parameters()) / 1e6,
    }
    return rows, setup


def _verify(model, cache, inputs: ddtree.TreeInputs, bias: torch.Tensor) -> None:
    if isinstance(cache, TreeCache):
        tree_forward(model, inputs.input_ids, inputs.position_ids, cache, bias)
    else:  # what Target.forward does for a pure-attention target
        model(input_ids=inputs.input_ids, position_ids=inputs.position_ids, attention_mask=bias, use_cache=True,
              **{cache_argument(type(model)): cache})


def _roll_back(cache, past_length: int) -> None:
    """Forget the tree just verified: drop its KV rows and its forked states."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None:
            layer.keys, layer.values = layer.keys[..., :past_length, :], layer.values[..., :past_length, :]
    if isinstance(cache, TreeCache):
        cache.pending = None


def format_cost(rows: list[CostRow], setup: dict) -> str:
    linear, layers = setup["linear_layers"], setup["layers"]
    head = (f"verify time per pass, CPU, {setup['dtype']}, {setup['threads']} thread(s); {layers} layers "
            f"(hybrid: {linear} Gated DeltaNet + {layers - linear} attention, {setup['params_hybrid_M']:.1f}M params; "
            f"pure attention: {setup['params_attention_M']:.1f}M), hidden {setup['hidden_size']}, "
            f"vocab {setup['vocab']}, {setup['context']} tokens of context; median ms")
    lines = [head, "| budget | nodes | depth | pure attention ms | hybrid ms | hybrid / attention |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.budget} | {row.nodes} | {row.depth} | {row.attention_ms:.1f} | {row.hybrid_ms:.1f} | "
                     f"{row.hybrid_ms / row.attention_ms:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.models.hybrid",
                                     description="Hybrid-target tree verification.")
    parser.add_argument("--cost", action="store_true", help="verify time vs tree budget, hybrid vs pure attention")
    parser.add_argument("--budgets", default="1,4,16,64,256")
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if not args.cost:
        parser.print_help()
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, setup = measure_verify_cost(tuple(int(b) for b in args.budgets.split(",")), hidden_size=args.hidden_size,
                                      layers=args.layers, context=args.context, repeats=args.repeats,
                                      dtype=getattr(torch, args.dtype))
    print(format_cost(rows, setup))
    return 0


if __name__ == "__main__":
    sys.exit(main())
