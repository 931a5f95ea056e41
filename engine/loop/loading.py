"""Pick and load the target + drafter pair the app and the bench run on."""

from __future__ import annotations

import copy
import re
import time
from dataclasses import replace
from pathlib import Path

import torch

from engine.errors import EngineError
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.draft_pass import draft_log_probs
from engine.models.drafter import SCRIPT, DFlashDrafter, DraftContext, fresh_config, load_drafter, weights_digest
from engine.models.target import BUNDLED_MODEL, load_target, resolve_dtype
from engine.trace import SCRIPTED, TIMING_ONLY

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
DRAFTERS = ASSETS / "drafters"
SHIPPED_DRAFTER = DRAFTERS / "smollm2-135m-dflash-b16"
RANDOM = "random"
# <empty_output>: a SmolLM2 special token that chat text never produces
BUNDLED_MASK_TOKEN = 16
RANDOM_DRAFTER_LAYERS = 3
AUTO = "auto"
TIMED_CONTEXT, TIMED_PASSES = 32, 4  # the drafter's pass timed in each dtype: after this many context rows, the best
BF16_MARGIN = 0.8  # of a few; bf16 drafts where they take under this share of float32's time
DRAFT_DTYPE_HELP = ("torch engine: the drafter's dtype (auto: bfloat16 beside a float32 target on a CPU with "
                    "native bf16, else the target's); the target verifies in its own")


def shipped_drafter() -> Path | None:
    return SHIPPED_DRAFTER if (SHIPPED_DRAFTER / "config.json").is_file() else None


def random_drafter(target, seed: int = 0, block_size: int = 16) -> DFlashDrafter:
    mask = BUNDLED_MASK_TOKEN if target.name == BUNDLED_MODEL else target.config.vocab_size - 1
    config = fresh_config(target.config, num_layers=RANDOM_DRAFTER_LAYERS, mask_token_id=mask, block_size=block_size)
    return DFlashDrafter(config).initialize(seed)


def load_decoder(model: str | None = None, drafter: str | None = None, device: str = "cpu",
                 dtype: str = "float32", seed: int = 0, fixed_step: bool = False, cuda_graphs: bool = False,
                 compile_step: bool = False, random_weights: bool = False, draft_dtype: str = AUTO) -> Decoder:
    """``drafter``: a checkpoint folder, ``random`` (seeded, untrained), or ``None`` for
    the shipped drafter when running the bundled model (random otherwise). ``fixed_step``,
    ``cuda_graphs`` and ``compile_step``: see ``Decoder``. ``random_weights``: ``model`` and
    ``drafter`` are config-only folders (``assets/shapes/``), loaded with random weights: timing only.
    ``draft_dtype``: the drafter's own dtype (``auto``: see ``draft_dtype_for``)."""
    if random_weights:
        if drafter in (None, RANDOM):
            raise EngineError("--random-weights takes a drafter config folder too (e.g. assets/shapes/...)")
        checkpoint = load_drafter(drafter, random_weights=True)
        target = load_target(model, device=device, dtype=dtype, random_weights=True)
        return Decoder(target, checkpoint.to(device=target.device, dtype=target.dtype).eval(),
                       drafter_info(drafter, timing_only=True),
                       fixed_step=fixed_step, cuda_graphs=cuda_graphs, compile_step=compile_step, timing_only=True)
    checkpoint = load_drafter(drafter) if drafter not in (None, RANDOM) else None  # fail fast: the target loads slowly
    if draft_dtype != AUTO:
        resolve_dtype(draft_dtype)  # likewise
    target = load_target(model, device=device, dtype=dtype)
    if checkpoint is None and drafter is None and target.name == BUNDLED_MODEL and shipped_drafter() is not None:
        drafter, checkpoint = str(shipped_drafter()), load_drafter(shipped_drafter())
    if checkpoint is None:
        draft_model, info = random_drafter(target, seed), DrafterInfo(f"random (untrained, seed {seed})", trained=False)
    else:
        draft_model, info = checkpoint, drafter_info(drafter)
    draft_model = draft_model.to(device=target.device).eval()
    draft_model = draft_model.to(dtype=draft_dtype_for(target, draft_model, draft_dtype))
    return Decoder(target, draft_model, info, fixed_step=fixed_step, cuda_graphs=cuda_graphs, compile_step=compile_step)


def second_decoder(decoder: Decoder, folder: str) -> Decoder:
    """``folder``'s drafter beside ``decoder``'s, to compare the two on the same prompts: a decoder on the same
    target object (its weights loaded once), the drafter in the first one's dtype, its runs labelled with its tag
    (``drafter_tag``)."""
    if not takes_second_drafter(decoder):
        raise EngineError("a second drafter runs beside a first on the torch engine: the vLLM engine's workers hold "
                          "one drafter")
    target = decoder.target
    dtype = decoder.drafter.dtype
    drafter = load_drafter(folder).to(device=target.device, dtype=dtype).eval()
    info = replace(drafter_info(folder), tag=drafter_tag(folder, decoder.drafter_info.name))
    return Decoder(target, drafter, info, engine=decoder.engine, cuda_graphs=decoder.cuda_graphs,
                   fixed_step=decoder.fixed_step, compile_step=decoder.compile_step)


def takes_second_drafter(decoder: Decoder) -> bool:
    """Whether a second drafter can run beside ``decoder``'s: a torch engine's, with a drafter of its own."""
    return decoder.engine == "torch" and decoder.drafter is not None


def drafter_tag(folder: str, beside: str) -> str:
    """What a second drafter's labels add: its folder's name, in characters a label can carry, set apart from the
    first drafter's name (the same folder twice measures how much one run's speed varies)."""
    tag = re.sub(r"[^\w.-]+", "-", Path(folder).resolve().name).strip("-") or "second"
    return f"{tag}-2" if tag == Path(beside).name else tag


def drafter_folders(*given: str | None) -> list[str]:
    """The drafter folders a page offers to compare: the ones given (``--drafter``, ``--second-drafter``) and every
    checkpoint folder in ``assets/drafters/``, each once."""
    shipped = [str(path.parent) for path in sorted(DRAFTERS.glob("*/config.json"))]
    offered: dict[Path, str] = {}
    for folder in [*given, *shipped]:
        if folder not in (None, RANDOM):
            offered.setdefault(Path(folder).resolve(), folder)
    return list(offered.values())


def draft_dtype_for(target, drafter: DFlashDrafter, choice: str = AUTO) -> torch.dtype:
    """The dtype the drafter runs in: ``auto`` is bfloat16 beside a float32 target on a CPU where the drafter's pass
    runs clearly faster in it (its block's rows read a vocabulary-sized lm_head every step: bf16 halves that where
    the CPU multiplies bf16 natively; BENCHMARKS.md has the CPU settings with bf16 drafts), else the target's own
    dtype. Only the proposals change: the target verifies every token in its own dtype."""
    if choice != AUTO:
        return resolve_dtype(choice)
    if target.device.type != "cpu" or target.dtype != torch.float32 or not cpu_has_bf16():
        return target.dtype
    return torch.bfloat16 if bf16_drafts_pay(target, drafter) else target.dtype


@torch.inference_mode()
def bf16_drafts_pay(target, drafter: DFlashDrafter) -> bool:
    """Whether the drafter's pass (a block after a few context rows) runs in under ``BF16_MARGIN`` of its float32
    time in bfloat16 here: timed, the best of a few passes each, since a CPU can report native bf16 (as oneDNN
    sees it) and still run parts of the pass slower."""
    best = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(drafter).to(dtype=dtype).eval()
        embedding, lm_head = target.embedding.to(dtype), target.lm_head.to(dtype)
        block = torch.full((1, model.block_size), model.mask_token_id)
        positions = torch.arange(TIMED_CONTEXT, TIMED_CONTEXT + model.block_size)[None]
        features = torch.randn(1, TIMED_CONTEXT, model.fc.in_features, dtype=dtype)
        context_positions = torch.arange(TIMED_CONTEXT)[None]
        times = []
        for _ in range(TIMED_PASSES):
            start = time.perf_counter()
            draft_log_probs(model, embedding, lm_head, block, positions, features, context_positions,
                            DraftContext.empty(len(model.layers)))
            times.append(time.perf_counter() - start)
        best[dtype] = min(times)
    return best[torch.bfloat16] < BF16_MARGIN * best[torch.float32]


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (AVX512-BF16 or AMX), as oneDNN sees it."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def drafter_info(folder: str, timing_only: bool = False) -> DrafterInfo:
    """How traces name a drafter folder: trained weights (and their digest), a scripted drafter
    (``engine.models.drafter.ScriptedDrafter``: it knows the answers), or a shape's random weights."""
    name, scripted = display_name(folder), (Path(folder) / SCRIPT).is_file()
    tags = ([SCRIPTED] if scripted else []) + ([TIMING_ONLY] if timing_only else [])
    if tags:
        return DrafterInfo(f"{name} ({'; '.join(tags)})", trained=False,
                           revision=weights_digest(folder) if scripted else None)
    return DrafterInfo(name, trained=True, revision=weights_digest(folder))


def display_name(path: str) -> str:
    resolved = Path(path).resolve()
    return resolved.name if resolved.parent == SHIPPED_DRAFTER.parent else str(path)

