"""The drafter doctor's static side: checks of the two configs and the tokenizer, and the wirings an engine
could feed the drafter with (``engine.measure.doctor`` probes them).

vLLM's convention, read from vLLM 0.23's source: its own DFlash taps the target's "aux hidden states" at
``eagle_aux_hidden_state_layer_ids`` when the draft config has them, else at ``dflash_config.target_layer_ids``
+ 1 (``v1/worker/gpu_model_runner.py``, ``_get_eagle3_aux_layers_from_config``). Aux layer ``k`` is the
residual stream entering decoder layer ``k`` (``_maybe_add_hidden_state`` after layer ``k - 1``; 0 is the
embeddings), which is HF's ``hidden_states[k]``, except for ``k`` = the layer count: vLLM's is before the
final norm, HF's after. Its DFlash attention (``model_executor/models/qwen3_dflash.py``) passes no
``per_layer_sliding_window``, so every drafter layer gets the cache config's window (the target's: none for
the Qwen3 / Qwen3.5 family): sliding-window layers run as full attention. The Studio's vLLM engine feeds its
own drafter the aux states at HF's indices (``engine.on_vllm.vllm_worker.StudioWorker.tap_layers``), windows kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError
from engine.models.drafter import DFlashDrafter, DrafterConfig

OK, NOTE, WARNING, FAULT = "ok", "note", "warning", "fault"
VLLM = "vLLM 0.23"
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")

LayerKind = tuple[bool, "int | None"]  # a drafter layer's attention: (causal, sliding window)


@dataclass
class Finding:
    severity: str  # OK, NOTE, WARNING or FAULT
    check: str
    line: str  # what was found, and what to change


@dataclass(frozen=True)
class Wiring:
    """How an engine feeds the drafter: the target's hidden states it reads (HF ``hidden_states`` indices),
    each drafter layer's attention, and whether the last layer's output is read before the final norm.
    ``meaning`` and ``fix`` say what it means when the drafter does far better (or worse) with it."""

    label: str
    hidden_indices: tuple[int, ...]
    layer_kinds: tuple[LayerKind, ...]
    last_before_norm: bool = False
    meaning: str = ""
    fix: str = ""


def text_config(target_config):
    """The language model's config (a multimodal target nests it)."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def check_for_this_target(target_config, config: DrafterConfig) -> None:
    """A drafter made for another target (another width or vocabulary) cannot be probed at all: bad input."""
    text = text_config(target_config)
    for name, ours, theirs in (("hidden size", config.hidden_size, text.hidden_size),
                               ("vocabulary", config.vocab_size, text.vocab_size)):
        if ours != theirs:
            raise EngineError(f"the drafter is for another target: its {name} is {ours}, the target's {theirs}; "
                              "pass the drafter trained for this target")


def static_checks(target_config, tokenizer, config: DrafterConfig, engine: str = "torch",
                  raw_config: dict | None = None) -> list[Finding]:
    """One finding per check; ``tokenizer`` None skips the mask token's text (a config-only shape has
    no tokenizer of its own). Raises ``EngineError`` for a drafter of another target."""
    check_for_this_target(target_config, config)
    text = text_config(target_config)
    findings = [Finding(OK, "shape", f"hidden size {config.hidden_size} and vocabulary {config.vocab_size} "
                                     "match the target's")]
    findings += layer_id_checks(config, text.num_hidden_layers)
    findings.append(mask_token_check(config, tokenizer))
    findings.append(Finding(OK, "block size", f"{config.block_size}: {config.block_size - 1} draft slots a pass")
                    if config.block_size >= 2 else
                    Finding(FAULT, "block size", f"{config.block_size}: a block needs the root and at least one "
                                                 "slot; set dflash_config.block_size to the size it was trained with"))
    findings += layer_type_checks(config)
    findings.append(rope_check(config, text))
    if engine == "vllm":
        findings += vllm_checks(config, text.num_hidden_layers, raw_config)
    return findings


def layer_id_checks(config: DrafterConfig, num_layers: int) -> list[Finding]:
    ids = config.target_layer_ids
    outside = [i for i in ids if not 0 <= i < num_layers]
    if outside:
        return [Finding(FAULT, "layer ids", f"target_layer_ids {ids} reach outside the target's {num_layers} layers "
                                            f"(0–{num_layers - 1}): {outside}; this drafter was made for a "
                                            f"{config.num_target_layers}-layer target, or the ids are shifted")]
    found = [Finding(OK, "layer ids", f"taps the outputs of target layers {ids} of {num_layers} "
                                      f"(HF hidden_states {[i + 1 for i in ids]})")]
    if config.num_target_layers != num_layers:
        found.append(Finding(WARNING, "layer ids", "the drafter's config says its target has "
                                                   f"{config.num_target_layers} layers, this one has {num_layers}: "
                                                   "is it the target it was trained on?"))
    if len(set(ids)) != len(ids) or list(ids) != sorted(ids):
        found.append(Finding(WARNING, "layer ids", f"target_layer_ids {ids} repeat or are out of order: the fused "
                                                   "features keep that order, so it must be the training order"))
    return found


def mask_token_check(config: DrafterConfig, tokenizer) -> Finding:
    mask = config.mask_token_id
    if not 0 <= mask < config.vocab_size:
        return Finding(FAULT, "mask token", f"mask_token_id {mask} is outside the vocabulary "
                                            f"(0–{config.vocab_size - 1}); set dflash_config.mask_token_id to the "
                                            "token the drafter was trained with")
    if tokenizer is None:
        return Finding(NOTE, "mask token", f"{mask} (no tokenizer to name it)")
    name = tokenizer.decode([mask], skip_special_tokens=False)
    special = (mask in getattr(tokenizer, "all_special_ids", [])
               or mask in getattr(tokenizer, "added_tokens_decoder", {}))
    if special:
        return Finding(OK, "mask token", f"{mask} = {name!r}, a special token no text produces")
    return Finding(WARNING, "mask token", f"{mask} = {name!r} is an ordinary text token: a block's mask slots then "
                                          "look like real text; drafters use a reserved special token")


def layer_type_checks(config: DrafterConfig) -> list[Finding]:
    types, window = config.layer_types, config.sliding_window
    unknown = sorted({t for t in types if t not in KNOWN_LAYER_TYPES})
    if len(types) != config.num_hidden_layers:
        return [Finding(FAULT, "layer types", f"{len(types)} layer_types for {config.num_hidden_layers} layers: "
                                              "give one per layer")]
    if unknown:
        return [Finding(FAULT, "layer types", f"unknown layer types {unknown}: each must be one of "
                                              f"{', '.join(KNOWN_LAYER_TYPES)}")]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and (window is None or window < 1):
        return [Finding(FAULT, "layer types", f"layers {sliding} are sliding_attention but sliding_window is "
                                              f"{window}: set the window they were trained with")]
    causal = "causal" if config.is_causal is None else ("causal" if config.is_causal else "not causal")
    if not sliding:
        return [Finding(OK, "layer types", f"{len(types)} full-attention layers (non-causal over the block)"
                                           + (f"; sliding_window {window} is set but no layer uses it"
                                              if window else ""))]
    return [Finding(OK, "layer types", f"{len(sliding)} sliding-window layers {sliding} (window {window}, {causal}) "
                                       f"and {len(types) - len(sliding)} full-attention")]


def rope_check(config: DrafterConfig, text) -> Finding:
    rope = getattr(text, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(text, "rope_theta", None))
    if theta is None or float(theta) == float(config.rope_theta):
        return Finding(OK, "rope", f"theta {config.rope_theta:g}" + ("" if theta is None else ", as the target's"))
    return Finding(WARNING, "rope", f"the drafter's rope theta {config.rope_theta:g} is not the target's "
                                    f"{float(theta):g}: drafters are trained with the target's; if this one was, set "
                                    f"rope_parameters.rope_theta to {float(theta):g}")


# ---------------------------------------------------------------- vLLM's convention

def vllm_aux_layers(config: DrafterConfig, raw_config: dict | None) -> tuple[list[int], str]:
    """The aux hidden-state layers vLLM's own DFlash taps, and which key gave them."""
    eagle = (raw_config or {}).get("eagle_aux_hidden_state_layer_ids")
    if eagle:
        return list(eagle), "eagle_aux_hidden_state_layer_ids, as they are"
    return [i + 1 for i in config.target_layer_ids], "dflash_config.target_layer_ids + 1"


def vllm_checks(config: DrafterConfig, num_layers: int, raw_config: dict | None) -> list[Finding]:
    aux, source = vllm_aux_layers(config, raw_config)
    studio = [i + 1 for i in config.target_layer_ids]
    found = []
    if aux == studio:
        found.append(Finding(OK, "vLLM taps", f"{VLLM}'s DFlash taps aux hidden states {aux} ({source}): the residual "
                                              "stream entering those layers, the outputs of layers "
                                              f"{config.target_layer_ids}; the Studio's engines read the same layers"))
    else:
        found.append(Finding(FAULT, "vLLM taps", f"{VLLM}'s DFlash taps aux hidden states {aux} ({source}): "
                                                 f"the outputs of layers {[k - 1 for k in aux]}, where the Studio "
                                                 f"reads {config.target_layer_ids}; set "
                                                 f"eagle_aux_hidden_state_layer_ids to {studio} or remove it"))
    if max(aux) > num_layers:
        found.append(Finding(FAULT, "vLLM taps", f"aux layer {max(aux)} is past the target's {num_layers} layers: "
                                                 "vLLM never records it"))
    if num_layers - 1 in config.target_layer_ids:
        found.append(Finding(WARNING, "final norm", f"the drafter taps the last layer ({num_layers - 1}): "
                                                    "vLLM reads it before the final norm, the torch engine after it "
                                                    "(the probe measures both)"))
    sliding = [i for i, t in enumerate(config.layer_types) if t == "sliding_attention"]
    if sliding:
        dflash_causal = bool(((raw_config or {}).get("dflash_config") or {}).get("causal", False))
        trained_causal = config.is_causal is None or bool(config.is_causal)
        causality = f", {'causal' if dflash_causal else 'non-causal'}" if dflash_causal != trained_causal else ""
        found.append(Finding(WARNING, "vLLM windows", f"{VLLM}'s DFlash gives its drafter layers no sliding window "
                                                      f"(qwen3_dflash.py passes none): layers {sliding} (window "
                                                      f"{config.sliding_window}) run as full{causality} attention; the "
                                                      "Studio's vLLM engine keeps them (the probe measures the cost)"))
    return found


# ---------------------------------------------------------------- the wirings

def configured_wiring(drafter: DFlashDrafter) -> Wiring:
    return Wiring("as configured", tuple(drafter.hidden_state_indices),
                  tuple(layer.self_attn.mask_kind for layer in drafter.layers))


def variant_wirings(drafter: DFlashDrafter, num_layers: int, has_final_norm: bool) -> list[Wiring]:
    """The miswirings worth probing for this drafter: each is what a known engine or config fault feeds it."""
    config, configured = drafter.config, configured_wiring(drafter)
    found = []
    for shift, reads in ((-1, "late"), (1, "early")):
        ids = [i + shift for i in config.target_layer_ids]
        if all(-1 <= i < num_layers for i in ids):  # -1: the embeddings
            found.append(Wiring(f"layer ids {shift:+d}", tuple(i + 1 for i in ids), configured.layer_kinds,
                                meaning=f"the engine reads hidden states one layer {reads} (or target_layer_ids "
                                        f"are off by {-shift:+d})",
                                fix=f"set dflash_config.target_layer_ids to {ids}, or drop the engine's layer offset"))
    full_causal = bool(config.is_causal)  # z-lab's full-attention layers: non-causal unless the config says so
    windowed = [i for i, (_, window) in enumerate(configured.layer_kinds) if window is not None]
    if windowed:
        found.append(Wiring("sliding-window layers as full attention", configured.hidden_indices,
                            tuple((full_causal, None) if window is not None else (causal, window)
                                  for causal, window in configured.layer_kinds),
                            meaning="the drafter was trained without the windows its config declares",
                            fix=f"set layer_types of layers {windowed} to full_attention"))
    full = [i for i, (_, window) in enumerate(configured.layer_kinds) if window is None]
    if full and config.sliding_window:
        sliding_causal = True if config.is_causal is None else bool(config.is_causal)
        found.append(Wiring(f"full-attention layers as sliding-window ({config.sliding_window})",
                            configured.hidden_indices,
                            tuple((sliding_causal, config.sliding_window) if window is None else (causal, window)
                                  for causal, window in configured.layer_kinds),
                            meaning="the drafter was trained with sliding windows its config does not declare",
                            fix=f"set layer_types of layers {full} to sliding_attention"))
    if has_final_norm and num_layers in configured.hidden_indices:
        found.append(Wiring("the last layer read before the final norm", configured.hidden_indices,
                            configured.layer_kinds, last_before_norm=True,
                            meaning=f"the drafter was trained on layer {num_layers - 1}'s output before the final "
                                    "norm (as vLLM records it), the engine reads it after",
                            fix="feed the last tapped layer's output before the final norm"))
    return found


def deployment_wirings(drafter: DFlashDrafter, num_layers: int, engine: str, raw_config: dict | None) -> list[Wiring]:
    """How the vLLM engines feed this drafter, where that differs from the configured wiring."""
    if engine != "vllm":
        return []
    config, configured = drafter.config, configured_wiring(drafter)
    found = []
    if num_layers in configured.hidden_indices:
        found.append(Wiring("as the Studio's vLLM engine feeds it", configured.hidden_indices, configured.layer_kinds,
                            last_before_norm=True,
                            meaning=f"vLLM records layer {num_layers - 1}'s output before the final norm; the "
                                    "drafter was trained on it after",
                            fix="tap an earlier layer, or train the drafter on the state before the norm"))
    aux, source = vllm_aux_layers(config, raw_config)
    dflash_causal = bool(((raw_config or {}).get("dflash_config") or {}).get("causal", False))
    native = Wiring(f"as {VLLM}'s own DFlash runs it", tuple(aux),
                    tuple((dflash_causal, None) for _ in configured.layer_kinds), last_before_norm=True)
    if max(aux) <= num_layers and (native.hidden_indices, native.layer_kinds) != (configured.hidden_indices,
                                                                                  configured.layer_kinds):
        wrong = []
        if list(aux) != list(configured.hidden_indices):
            wrong.append(f"it taps aux layers {aux} ({source}), the outputs of layers {[k - 1 for k in aux]}")
        if native.layer_kinds != configured.layer_kinds:
            wrong.append("it runs every drafter layer as full attention, the sliding-window ones too")
        found.append(Wiring(native.label, native.hidden_indices, native.layer_kinds, True,
                            meaning="; ".join(wrong),
                            fix="run the drafter on the Studio's vLLM engine, which keeps its wiring, or make "
                                "vLLM's (eagle_aux_hidden_state_layer_ids; per_layer_sliding_window in "
                                "qwen3_dflash.py) match"))
    return found
