"""Hybrid targets (Gated DeltaNet + full attention, Qwen3.5 / Qwen3-Next): exact tree verification.

The reference is the model's own forward, one token at a time (its single-token
recurrent path). Every tree node must score as if its path had been decoded alone,
commits must leave the cache as that decoding would, and greedy DFlash / DDTree
outputs must equal AR token for token.
"""

import json

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

import ddtree
from engine.errors import EngineError
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models import hybrid
from engine.models.drafter import ScriptedDrafter, fresh_config
from engine.models.target import load_target
from engine.tools import bench
from tests.hybrid_models import (
    FAMILIES,
    FULL,
    LINEAR,
    hybrid_decoder,
    hybrid_model,
    hybrid_target,
    reference_greedy,
    save_tiny_hybrid,
    scripted_drafter_for,
)
from tests.test_sampling import CHI2_CRITICAL_DF5, chi_square, three_token_marginals
from tests.tiny import tiny_drafter


def prompt(seed, length, vocab):
    g = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(2, vocab - 1, (length,), generator=g).tolist()


def prefilled(model, prompt_ids):
    cache = hybrid.TreeCache(model.config)
    logits = model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True).logits[0, -1]
    return cache, int(logits.argmax())


def decode_path(model, prompt_ids, path_tokens):
    """The model's own token-by-token decoding of ``path_tokens`` after the prompt: logits per step, cache."""
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt_ids]), cache=cache, use_cache=True)
    logits = []
    for offset, token in enumerate(path_tokens):
        position = torch.tensor([[len(prompt_ids) + offset]])
        logits.append(model(input_ids=torch.tensor([[token]]), position_ids=position, cache=cache,
                            use_cache=True).logits[0, -1])
    return torch.stack(logits), cache


def wide_deep_tree(vocab, seed, budget=40, depth=5):
    """A tree with many siblings at depth 1 and branches several levels deep."""
    g = torch.Generator().manual_seed(seed)
    log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 5, dim=-1)
    log_probs[0] = torch.log_softmax(torch.randn(vocab, generator=g) * 0.5, dim=-1)  # flat first depth: many siblings
    return ddtree.build_tree(log_probs, budget)


def assert_same_cache(ours, theirs):
    for mine, reference in zip(ours.layers, theirs.layers):
        if isinstance(mine, LinearAttentionCacheLayerMixin):
            assert torch.allclose(mine.conv_states[0], reference.conv_states[0], rtol=0, atol=1e-12)
            # the delta rule runs in float32 whatever the model dtype: allow a last-bit difference
            assert torch.allclose(mine.recurrent_states[0], reference.recurrent_states[0], rtol=1e-6, atol=1e-7)
        else:
            assert torch.allclose(mine.keys, reference.keys, rtol=0, atol=1e-12)
            assert torch.allclose(mine.values, reference.values, rtol=0, atol=1e-12)


# --- the verify pass itself -----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_every_tree_node_scores_like_its_path_decoded_alone_and_commit_keeps_the_leaf_state(family):
    model = hybrid_model(family, seed=3, vocab=24)
    ids = prompt(3, 9, 24)
    cache, root = prefilled(model, ids)
    tree = wide_deep_tree(24, seed=3)
    assert int((tree.depths == 1).sum()) >= 10 and int(tree.depths.max()) >= 3
    inputs = ddtree.compile_tree(tree, root, len(ids))
    bias = ddtree.attention_bias(inputs.visible, len(ids), model.dtype)
    logits, hidden = hybrid.tree_forward(model, inputs.input_ids, inputs.position_ids, cache, bias, hidden_states=True)
    assert logits.shape == (tree.size + 1, 24) and len(hidden) == model.config.num_hidden_layers + 1

    leaves = sorted(set(range(tree.size + 1)) - set(tree.parents.tolist()))
    for leaf in leaves:  # every node lies on some root-to-leaf path
        path = inputs.visible[leaf].nonzero().flatten()
        reference, _ = decode_path(model, ids, inputs.input_ids[0, path].tolist())
        assert torch.allclose(logits[path], reference, rtol=0, atol=1e-12), leaf

    deepest = int(tree.depths.argmax()) + 1
    path = inputs.visible[deepest].nonzero().flatten().tolist()
    hybrid.commit_cache(cache, len(ids), path)
    assert cache.pending is None
    _, reference_cache = decode_path(model, ids, inputs.input_ids[0, path].tolist())
    assert_same_cache(cache, reference_cache)


@torch.inference_mode()
def test_a_node_forked_from_its_siblings_state_is_caught(monkeypatch):
    """The check above can fail: fork one node from its parent's sibling instead of its parent."""
    model = hybrid_model("qwen3_5", seed=3, vocab=24)
    ids = prompt(3, 9, 24)
    cache, root = prefilled(model, ids)
    tree = wide_deep_tree(24, seed=3)
    inputs = ddtree.compile_tree(tree, root, len(ids))
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depths])
    parent = torch.cat([torch.tensor([-1]), tree.parents])
    victim = int(torch.nonzero(depth == 2)[0])  # a depth-2 node; its parent has siblings at depth 1
    sibling = int(next(n for n in torch.nonzero(depth == 1).flatten().tolist() if n != int(parent[victim])))
    correct_plan = hybrid.TreePlan.from_tree

    def forked_from_sibling(*args, **kwargs):
        plan = correct_plan(*args, **kwargs)
        plan.parent_slots[victim] = sibling + 1
        plan.windows[victim + 1] = torch.cat([plan.windows[sibling + 1, 1:], plan.windows[victim + 1, -1:]])
        return plan

    monkeypatch.setattr(hybrid.TreePlan, "from_tree", forked_from_sibling)
    bias = ddtree.attention_bias(inputs.visible, len(ids), model.dtype)
    logits, _ = hybrid.tree_forward(model, inputs.input_ids, inputs.position_ids, cache, bias)
    path = inputs.visible[victim].nonzero().flatten()
    reference, _ = decode_path(model, ids, inputs.input_ids[0, path].tolist())
    assert torch.allclose(logits[path[:-1]], reference[:-1], rtol=0, atol=1e-12)  # its ancestors still right
    assert not torch.allclose(logits[victim], reference[-1], atol=1e-6)


@torch.inference_mode()
def test_the_tree_pass_keeps_to_what_older_transformers_releases_expect(monkeypatch):
    """The GPU machine runs transformers 5.17, whose Qwen3.5 kernels and layers differ from ours
    (5.24): its recurrent kernel wants one key head per value head, its multimodal rotary wants
    position ids with one row per grid axis, and its layers take the cache as ``past_key_values``.
    Here 5.24's code is held to those contracts, and the tree stays exact."""
    model = hybrid_model("qwen3_5", seed=3, vocab=24, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0],
        "mrope_interleaved": True})
    kernels = __import__(type(model.model.layers[0].linear_attn).__module__, fromlist=["_"])
    recurrent = kernels.torch_recurrent_gated_delta_rule

    def one_key_head_per_value_head(query, key, value, **kwargs):
        assert query.shape[2] == key.shape[2] == value.shape[2]
        return recurrent(query, key, value, **kwargs)

    rotary = type(model.model.rotary_emb).forward

    def three_rows(self, x, position_ids):
        assert position_ids.ndim == 3 and position_ids.shape[0] == 3
        return rotary(self, x, position_ids)

    monkeypatch.setattr(kernels, "torch_recurrent_gated_delta_rule", one_key_head_per_value_head)
    ids = prompt(3, 9, 24)
    cache, root = prefilled(model, ids)
    monkeypatch.setattr(type(model.model.rotary_emb), "forward", three_rows)
    tree = wide_deep_tree(24, seed=3, budget=12)
    inputs = ddtree.compile_tree(tree, root, len(ids))
    bias = ddtree.attention_bias(inputs.visible, len(ids), model.dtype)
    logits, _ = hybrid.tree_forward(model, inputs.input_ids, inputs.position_ids, cache, bias)
    monkeypatch.undo()
    leaf = int(tree.depths.argmax()) + 1
    path = inputs.visible[leaf].nonzero().flatten()
    reference, _ = decode_path(model, ids, inputs.input_ids[0, path].tolist())
    assert torch.allclose(logits[path], reference, rtol=0, atol=1e-12)

    class OlderLayer(torch.nn.Module):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
            return hidden_states

    assert hybrid.cache_argument(OlderLayer) == "past_key_values"
    assert hybrid.cache_argument(type(model.model.layers[1])) == "cache"


@torch.inference_mode()
def test_unmasked_chain_is_causal_and_hidden_states_match_the_model():
    model = hybrid_model("qwen3_5", seed=4)
    ids, chain = prompt(4, 7, 40), prompt(5, 6, 40)
    cache, _ = prefilled(model, ids)
    positions = torch.arange(len(ids), len(ids) + len(chain))[None]
    logits, hidden = hybrid.tree_forward(model, torch.tensor([chain]), positions, cache, None, hidden_states=True)
    reference, _ = decode_path(model, ids, chain)
    assert torch.allclose(logits, reference, rtol=0, atol=1e-12)
    # hidden states are laid out as transformers lays them out (embeddings ... normalised last)
    plain = model(input_ids=torch.tensor([ids + chain]), output_hidden_states=True).hidden_states
    for ours, theirs in zip(hidden, plain):
        assert torch.allclose(ours[0], theirs[0, len(ids):], atol=1e-4)  # prefill's chunked kernel is fp32


def test_a_mask_that_is_not_a_tree_is_refused():
    visible = ddtree.ancestor_mask(torch.tensor([0, 0, 1]))
    visible[3, 2] = True  # node 3 sees node 2, which is not its ancestor
    with pytest.raises(EngineError, match="not a tree mask"):
        hybrid.tree_from_bias(ddtree.attention_bias(visible, 5, torch.float64), 4)
    parents, chain = hybrid.tree_from_bias(None, 3)
    assert parents.tolist() == [-1, 0, 1] and torch.equal(chain, torch.ones(3, 3, dtype=torch.bool).tril())


def test_unsupported_linear_attention_family_says_so():
    config = hybrid_model("qwen3_5").config
    config.model_type = "some_other_hybrid"
    with pytest.raises(EngineError, match="some_other_hybrid"):
        hybrid.TreeCache(config)


# --- the decode loop: greedy outputs equal AR -------------------------------------------------


@pytest.mark.parametrize("family, seed, length, block_size", [
    ("qwen3_5", 0, 5, 16), ("qwen3_5", 1, 12, 8), ("qwen3_5", 2, 23, 4), ("qwen3_5", 3, 1, 16),
    ("qwen3_next", 0, 7, 16), ("qwen3_next", 1, 16, 8), ("qwen3_next", 2, 2, 4),
])  # prompts of 1 and 2 tokens: shorter than the convolution window, which prefill pads
def test_greedy_dflash_and_ddtree_equal_the_models_own_ar(family, seed, length, block_size):
    decoder = hybrid_decoder(family, seed, block_size=block_size)
    decoder.target.stop_ids = []  # always the full 32 tokens
    assert isinstance(decoder.target.new_cache(), hybrid.TreeCache)
    ids = prompt(seed, length, 40)
    expected = reference_greedy(decoder.target.model, ids, 32, [])
    runs = {"ar": DecodeSettings("ar", max_new_tokens=32), "dflash": DecodeSettings("dflash", max_new_tokens=32)}
    runs |= {budget: DecodeSettings("ddtree", max_new_tokens=32, tree_budget=budget) for budget in (1, 4, 16, 64)}
    for key, settings in runs.items():
        assert decoder.run(prompt_ids=ids, settings=settings).output_ids == expected, key


@pytest.mark.parametrize("family", FAMILIES)
def test_flat_drafter_wide_trees_accept_siblings_and_stay_exact(family):
    """A near-uniform drafter puts every token at depth 1, so acceptance runs through siblings."""
    target = hybrid_target(family, seed=5, vocab=12)
    drafter = tiny_drafter(target, 5)
    drafter.config.output_multiplier = 1e-3
    decoder = Decoder(target, drafter, DrafterInfo("flat", trained=False))
    ids = prompt(5, 9, 12)
    expected = reference_greedy(target.model, ids, 30, target.stop_ids)
    for budget in (16, 64, 300):
        trace = decoder.run(prompt_ids=ids, settings=DecodeSettings("ddtree", max_new_tokens=30, tree_budget=budget))
        assert trace.output_ids == expected
        # depth 1 holds every token, so every step accepts a draft (the last one may be clipped)
        assert min(trace.summary.acceptance_lengths[:-1]) >= 2
        assert any(step.accepted[1] > 1 for step in trace.steps)  # accepted a non-first sibling


@pytest.mark.parametrize("family", FAMILIES)
def test_deep_acceptance_commits_the_leaf_state(family):
    """An oracle drafter gets long paths accepted, so each step commits a leaf several levels deep."""
    target = hybrid_target(family, seed=6, vocab=48)
    target.stop_ids = []
    ids = prompt(6, 11, 48)
    expected = reference_greedy(target.model, ids, 48, [])
    config = fresh_config(target.config, num_layers=1, mask_token_id=47, num_taps=2)
    oracle = ScriptedDrafter(config, [ids + expected]).initialize(6).to(torch.float64).eval()
    decoder = Decoder(target, oracle, DrafterInfo("oracle", trained=False))
    chain = decoder.run(prompt_ids=ids, settings=DecodeSettings("dflash", max_new_tokens=48))
    tree = decoder.run(prompt_ids=ids, settings=DecodeSettings("ddtree", max_new_tokens=48, tree_budget=48))
    assert chain.output_ids == expected and tree.output_ids == expected
    assert max(tree.summary.acceptance_lengths) >= 5 and tree.summary.tau > chain.summary.tau >= 2.0


# --- sampling follows the target's distribution -----------------------------------------------

VOCAB, RUNS, TEMPERATURE, SAMPLE_PROMPT = 6, 1200, 1.3, [2, 4, 3, 5]


@pytest.mark.slow
@torch.inference_mode()
def test_ddtree_sampling_on_a_hybrid_matches_the_targets_marginals():
    target = hybrid_target("qwen3_5", seed=7, vocab=VOCAB, layer_types=[LINEAR, FULL, LINEAR])
    target.stop_ids = []
    decoder = Decoder(target, tiny_drafter(target, 7, block_size=4), DrafterInfo("random", trained=False))
    exact = exact_marginals(target.model)
    counts = [torch.zeros(VOCAB, dtype=torch.float64) for _ in range(3)]
    from_tree = 0
    for seed in range(RUNS):
        trace = decoder.run(prompt_ids=SAMPLE_PROMPT, settings=DecodeSettings(
            "ddtree", max_new_tokens=3, temperature=TEMPERATURE, seed=seed, tree_budget=24))
        for position, token in enumerate(trace.output_ids[:3]):
            counts[position][token] += 1
        from_tree += sum(len(step.accepted) - 1 for step in trace.steps)
    for position in range(3):
        stat = chi_square(counts[position], exact[position])
        assert stat < CHI2_CRITICAL_DF5, (position, stat, counts[position], exact[position])
    assert from_tree > RUNS // 2  # many second/third tokens came out of tree walks through forked states
    # the test can fail: a sampler biased by 0.2 towards one token is far from these marginals
    skewed = exact[1].clone()
    skewed[skewed.argmax()] += 0.2
    skewed /= skewed.sum()
    assert chi_square(exact[1] * RUNS, skewed) > CHI2_CRITICAL_DF5


def exact_marginals(model) -> list[torch.Tensor]:
    """P(token at new position i), i = 0, 1, 2, from the model's own token-by-token forward."""
    def next_probs(prefix):
        if prefix:
            logits = decode_path(model, SAMPLE_PROMPT, list(prefix))[0][-1]
        else:
            logits = model(input_ids=torch.tensor([SAMPLE_PROMPT])).logits[0, -1]
        return torch.softmax(logits / TEMPERATURE, dim=-1)

    return three_token_marginals(next_probs, VOCAB)


# --- a saved hybrid folder is just another target ---------------------------------------------


@pytest.mark.slow
def test_bench_runs_a_saved_hybrid_folder_with_the_readable_step_and_says_so(tmp_path):
    """The fixed-shape programs hold no forked linear states: asked for them, a hybrid runs the readable
    step, and the results file names the step that ran (its step costs are compared by it)."""
    folder = save_tiny_hybrid(tmp_path / "tiny-qwen3.5", seed=8)
    target = load_target(str(folder), dtype="float64")
    assert hybrid.is_hybrid(target.config) and isinstance(target.new_cache(), hybrid.TreeCache)

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "hi", "prompt": "Say hi."}) + "\n")
    out = tmp_path / "results.json"
    assert bench.main(["--prompts", str(prompts), "--model", str(folder), "--drafter", "random", "--dtype", "float64",
                       "--methods", "ar,dflash,ddtree", "--tree-budget", "8,32", "--max-new-tokens", "12",
                       "--step", "fixed", "--out", str(out), "--no-progress"]) == 0
    results = json.loads(out.read_text())
    assert results["config"]["step"] == "readable"
    summary = results["summary"]
    assert {label: entry["identical_to_ar"] for label, entry in summary.items() if label != "ar"} == {
        "dflash": "1/1", "ddtree@8": "1/1", "ddtree@32": "1/1"}


@pytest.mark.slow
def test_the_tiny_hybrid_of_the_vllm_check_decodes_exactly_and_deep(tmp_path):
    """The GPU check's model and drafter (``engine/tools/gpu_session.sh hybrid``), on the torch engine:
    a scripted drafter that knows the answers gets every method accepted levels deep, and the
    outputs stay AR's."""
    folder = save_tiny_hybrid(tmp_path / "tiny-qwen3.5", vllm_shape=True)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    target = load_target(str(folder), dtype="float32")  # its language model, as for a real Qwen3.6 checkpoint
    assert hybrid.is_hybrid(target.config) and target.config.linear_key_head_dim == 64
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": text}) + "\n" for i, text in
                               enumerate(["Say hi.", "Name three colours.", "What is 2 + 2?"])))
    drafter = scripted_drafter_for(tmp_path / "scripted", target, [target.chat_ids(text) for text in
                                   ("Say hi.", "Name three colours.", "What is 2 + 2?")], max_new_tokens=40)
    out = tmp_path / "results.json"
    assert bench.main(["--prompts", str(prompts), "--model", str(folder), "--drafter", str(drafter), "--dtype",
                       "float32", "--methods", "ar,dflash,ddtree", "--tree-budget", "16,64", "--max-new-tokens", "40",
                       "--out", str(out), "--no-progress"]) == 0
    summary = json.loads(out.read_text())["summary"]
    for label in ("dflash", "ddtree@16", "ddtree@64"):
        assert summary[label]["identical_to_ar"] == "3/3", label
        assert summary[label]["tau"] >= 3.0, (label, summary[label]["tau"])
    assert summary["ddtree@64"]["tau"] > summary["dflash"]["tau"]  # the tree goes on through demoted tokens
