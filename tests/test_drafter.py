"""The drafter reads z-lab DFlash checkpoints, sliding-window layers included, and its
cached inference path matches a from-scratch pass over the whole context."""

import json

import pytest
import torch
from safetensors.torch import save_file

from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.settings import DecodeSettings
from engine.models.drafter import DraftContext, StaticDraftContext, load_drafter
from tests.tiny import tiny_drafter, tiny_target


def zlab_checkpoint(folder, target, sliding_window=4):
    """A checkpoint laid out as z-lab publishes them (Qwen3 keys, dflash_config, layer_types)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0, "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 96, "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "num_target_layers": 4, "vocab_size": 40,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": sliding_window,
        "block_size": 8, "dflash_config": {"mask_token_id": 39, "target_layer_ids": [0, 2]},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (64, 128), "hidden_norm.weight": (64,), "norm.weight": (64,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                   p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                   p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                   p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                   p + "mlp.down_proj.weight": (64, 96), p + "input_layernorm.weight": (64,),
                   p + "post_attention_layernorm.weight": (64,)}
    state = {k: (torch.randn(s, generator=g) * (0.1 if len(s) == 2 else 1)).to(torch.bfloat16)
             for k, s in shapes.items()}
    save_file(state, str(folder / "model.safetensors"))


def test_zlab_checkpoint_loads_with_its_settings(tmp_path):
    zlab_checkpoint(tmp_path, tiny_target())
    drafter = load_drafter(tmp_path)
    assert drafter.block_size == 8 and drafter.mask_token_id == 39
    assert drafter.config.target_layer_ids == [0, 2]
    first, second = (layer.self_attn for layer in drafter.layers)
    assert (first.is_causal, first.sliding_window) == (True, 4)  # z-lab: sliding layers are causal
    assert (second.is_causal, second.sliding_window) == (False, None)


@pytest.mark.parametrize("step", ["readable", "fixed"])
def test_zlab_drafter_decodes_exactly(tmp_path, step):
    """Its sliding-window layer's window (4) is shorter than the context: the fixed step's static
    draft context must window it as the readable step's growing one does."""
    target = tiny_target(2, vocab=40)
    zlab_checkpoint(tmp_path, target)
    drafter = load_drafter(tmp_path).double().eval()
    decoder = Decoder(target, drafter, DrafterInfo("zlab", trained=True), fixed_step=step == "fixed")
    ids = [5, 9, 3, 22, 17, 8]
    ar = decoder.run(prompt_ids=ids, settings=DecodeSettings("ar", max_new_tokens=30))
    for settings in (DecodeSettings("dflash", max_new_tokens=30),
                     DecodeSettings("ddtree", max_new_tokens=30, tree_budget=24)):
        assert decoder.uses_fixed_step(settings) == (step == "fixed")
        assert decoder.run(prompt_ids=ids, settings=settings).output_ids == ar.output_ids


@torch.inference_mode()
def test_cached_context_equals_one_pass_over_the_whole_context(tmp_path):
    target = tiny_target(3, vocab=40)
    zlab_checkpoint(tmp_path, target, sliding_window=64)
    drafter = load_drafter(tmp_path).double().eval()
    ids = torch.tensor([[4, 8, 15, 16, 23, 12, 7, 30, 2, 11]])
    hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    features = drafter.context_features(hidden)
    block = torch.tensor([[11] + [39] * 7])
    embeddings = drafter.embed(block, target.embedding)
    block_positions = torch.arange(10, 18)[None]

    whole = drafter(embeddings, features, block_positions, torch.arange(10)[None])
    context = DraftContext.empty(2)
    drafter(embeddings, features[:, :6], torch.arange(6, 14)[None], torch.arange(6)[None], cache=context)
    cached = drafter(embeddings, features[:, 6:], block_positions, torch.arange(6, 10)[None], cache=context)
    assert context.length == 10
    torch.testing.assert_close(cached, whole, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("layers", ["full", "z-lab sliding"])
@torch.inference_mode()
def test_static_context_with_padding_rows_equals_the_growing_context(tmp_path, layers):
    """The CUDA-graph draft path: fixed buffers, steps padded to a block, padding masked; z-lab's
    causal sliding-window layer (a window of 5, shorter than the context) sees what it sees eagerly."""
    target = tiny_target(4, vocab=40)
    if layers == "full":
        drafter = tiny_drafter(target, layers=2)
    else:
        zlab_checkpoint(tmp_path, target, sliding_window=5)
        drafter = load_drafter(tmp_path).double().eval()
        assert drafter.layers[0].self_attn.mask_kind == (True, 5)
    generator = torch.Generator().manual_seed(0)
    width, block = 2 * target.config.hidden_size, 4
    growing = DraftContext.empty(2)
    static = StaticDraftContext(drafter.config, capacity=64, device="cpu", dtype=torch.float64)
    start = 0
    for added in (7, 3, 1, 4, 2):  # the prompt, then steps of 1..block committed tokens
        features = torch.randn(1, added, width, generator=generator, dtype=torch.float64)
        positions = torch.arange(start, start + added)[None]
        embeddings = torch.randn(1, block, target.config.hidden_size, generator=generator, dtype=torch.float64)
        block_positions = torch.arange(start + added, start + added + block)[None]
        expected = drafter(embeddings, features, block_positions, positions, cache=growing)
        padded, padded_positions = features, positions
        if added <= block:  # as GraphedDraft loads them: garbage after the real rows
            padded = torch.cat([features,
                                torch.randn(1, block - added, width, generator=generator, dtype=torch.float64)], 1)
            padded_positions = torch.cat([positions, torch.full((1, block - added), 99)], 1)
        got = drafter(embeddings, padded, block_positions, padded_positions, cache=static,
                      context_count=torch.tensor(added))
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        start += added
    assert int(static.length) == growing.length == start


def test_a_scripted_drafter_loads_from_its_folder_and_never_runs_as_a_graph(tmp_path):
    """Its proposals come from the host, so a CUDA graph would freeze the first step's: the draft
    pass stays eager and the fixed-shape step (graphs on) is not taken, whatever the settings say."""
    from engine.loop.draft_pass import EagerDraft
    from engine.models.drafter import ScriptedDrafter, fresh_config, write_scripted_drafter

    target = tiny_target(3)
    config = fresh_config(target.config, num_layers=1, mask_token_id=target.config.vocab_size - 1, num_taps=2)
    folder = write_scripted_drafter(tmp_path / "scripted", config, [[5, 6, 7, 8, 9]], demote_every=5)
    scripted = load_drafter(folder).double().eval()
    assert isinstance(scripted, ScriptedDrafter) and scripted.sequences == [[5, 6, 7, 8, 9]]
    assert not scripted.graphable
    graphed = Decoder(target, scripted, DrafterInfo("scripted", trained=False), cuda_graphs=True, fixed_step=True)
    assert isinstance(graphed.draft_pass(16), EagerDraft)
    assert not graphed.uses_fixed_step(DecodeSettings("ddtree", tree_budget=8))
    trained = Decoder(target, tiny_drafter(target, 3), DrafterInfo("random", trained=False), cuda_graphs=True,
                      fixed_step=True)
    assert trained.drafter.graphable and trained.uses_fixed_step(DecodeSettings("ddtree", tree_budget=8))
    # what it proposes: the known continuation after a root that sits in a known sequence
    block = torch.full((1, 4), config.mask_token_id)
    block[0, 0] = 6
    hidden = scripted(scripted.embed(block, target.embedding), torch.zeros(1, 1, 2 * config.hidden_size,
                      dtype=torch.float64), block_positions=torch.arange(1, 5)[None],
                      context_positions=torch.zeros(1, 1, dtype=torch.long))
    proposals = scripted.logits(hidden[0, 1:], target.lm_head).argmax(-1).tolist()
    assert proposals == [7, 8, 9]


def test_the_drafter_runs_in_bf16_beside_a_float32_target_only_where_the_cpu_runs_it_faster(monkeypatch):
    import engine.loop.loading as models
    from engine.errors import EngineError

    target = tiny_target(0, dtype=torch.float32)
    drafter = tiny_drafter(target).float()
    for native, faster, expected in ((True, True, torch.bfloat16), (True, False, torch.float32),
                                     (False, True, torch.float32)):
        monkeypatch.setattr(models, "cpu_has_bf16", lambda native=native: native)
        monkeypatch.setattr(models, "bf16_drafts_pay", lambda *args, faster=faster: faster)
        assert models.draft_dtype_for(target, drafter) == expected
    monkeypatch.setattr(models, "cpu_has_bf16", lambda: True)
    assert models.draft_dtype_for(tiny_target(0, dtype=torch.float64), drafter) == torch.float64, "only beside float32"
    assert models.draft_dtype_for(target, drafter, "float32") == torch.float32
    with pytest.raises(EngineError, match="dtype 'half' is not supported"):
        models.draft_dtype_for(target, drafter, "half")


@pytest.mark.parametrize("bf16_share, pays", [(0.5, True), (0.9, False), (1.5, False)])
def test_whether_bf16_drafts_pay_is_timed_on_the_drafter_s_own_pass(monkeypatch, bf16_share, pays):
    """The drafter's pass runs in each dtype (its lm_head the target's, cast); a clock that a float32 pass moves by
    1 and a bf16 pass by ``bf16_share`` decides."""
    import engine.loop.loading as models

    clock, passes = [0.0], []
    pass_of = models.draft_log_probs

    def timed_pass(drafter, embedding, *args):
        passes.append((drafter.dtype, embedding.dtype))
        clock[0] += 1.0 if embedding.dtype == torch.float32 else bf16_share
        return pass_of(drafter, embedding, *args)

    monkeypatch.setattr(models, "draft_log_probs", timed_pass)
    monkeypatch.setattr(models.time, "perf_counter", lambda: clock[0])
    target = tiny_target(0, dtype=torch.float32)
    assert models.bf16_drafts_pay(target, tiny_drafter(target).float()) is pays
    assert set(passes) == {(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)}
