"""What DDTree would give at a real model size: speed-up(budget) = τ(budget) ÷ step cost(budget).

(``python -m engine.tools.projection`` prints it.)

The step cost comes from a bench run at the model's real shape with random weights
(``engine.tools.bench --random-weights``): the kernels, shapes and so the milliseconds are the real
model's, the tokens are not. τ cannot come from random weights, so it is taken from elsewhere:
(a) a drafter's measured acceptance curve (``acceptance`` in its ``config.json``; ours is
SmolLM2's, measured on the fresh prompts), and (b) the DDTree paper's acceptance for Qwen3-8B
(Ringel & Romano 2026, MATH-500, greedy, per budget from its Figure 3). This is a projection,
not a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError
from engine.methods import BASELINE, DFLASH, TREE, budget_sweep
from engine.trace import NATIVE_AR, NATIVE_MTP

# DDTree paper (arXiv 2604.12989), Qwen3-8B, MATH-500, T=0, 8×H200: τ and measured speed-up vs AR per
# node budget (Figure 3, read from the figure's points, ±0.01), and plain DFlash on the same task.
PAPER_QWEN3_8B = {
    "source": "Ringel & Romano 2026 (DDTree), Qwen3-8B, MATH-500, greedy, Figure 3",
    "tau": {16: 8.61, 32: 9.27, 64: 9.75, 128: 10.20, 256: 10.43, 512: 10.73, 1024: 10.98},
    "speedup": {16: 6.09, 32: 6.60, 64: 6.97, 128: 7.33, 256: 7.43, 512: 7.52, 1024: 6.82},
    DFLASH.name: {"tau": 7.79, "speedup": 5.56},
    # liranringel/ddtree's benchmark.py times AR as dflash_generate(block_size=1): transformers, sdpa, bf16, eager
    "baseline": "the reference code's own AR (transformers, eager, sdpa: benchmark.py's block-size-1 run), a slower "
                "baseline than vLLM's CUDA-graph AR, so there a tree costs fewer AR steps than here",
}

# The anchors the people deploying Qwen3.5 / 3.6 quote for the model's own multi-token prediction
PUBLISHED_MTP = {"tau": 5.3, "source": "Qwen3.5-27B MTP acceptance length on MT-Bench, as z-lab's DFlash model card "
                 "quotes it (its draft length is not stated)"}

ASSUMPTIONS = (
    "Projection, not measurement: step costs were timed at the model's shape with random weights "
    "(same kernels and shapes as the real model, so the same milliseconds), τ comes from elsewhere. It assumes "
    "τ carries over to this target and drafter; the cost of a step does not depend on how much of its tree is "
    "accepted; the context stays near the timed length (attention over a much longer context costs more); "
    "the baseline is AR at the settings timed in the same run. It stops being valid for budgets the run "
    "did not time, for τ curves measured on other prompts than the ones you care about, and for batch > 1."
)


@dataclass(frozen=True)
class Projection:
    label: str  # DFlash's run label, or DDTree's at a budget
    budget: int | None
    step_ms: float
    cost: float  # step cost in baseline AR steps
    tau_ours: float | None
    tau_paper: float | None
    paper_speedup: float | None

    @property
    def speedup_ours(self) -> float | None:
        return self.tau_ours / self.cost if self.tau_ours else None

    @property
    def speedup_paper(self) -> float | None:
        return self.tau_paper / self.cost if self.tau_paper else None


def baseline_ms(results: dict) -> tuple[str, float]:
    """ms per token of the AR baseline: vLLM's own AR where the run timed it, else the Studio's AR step."""
    native = [run for run in results["runs"] if run["label"] == NATIVE_AR]
    if native:
        return "vLLM's own AR", 1000 * sum(run["wall_s"] for run in native) / sum(run["new_tokens"] for run in native)
    studio_ar = results["summary"].get(BASELINE.label(), {})
    if studio_ar.get("step_ms"):
        return "the Studio's AR", studio_ar["step_ms"]
    raise EngineError("the results hold no AR baseline: bench with --methods ar (and --native ar on the vLLM engine)")


def project(results: dict, curve: dict) -> tuple[str, float, list[Projection]]:
    """Per DFlash and DDTree budget in ``results``: its step cost in baseline AR steps and the projected
    speed-ups with τ from ``curve`` (a drafter's ``acceptance``: DFlash's τ, and DDTree's per budget) and from
    the paper."""
    name, ar_ms = baseline_ms(results)
    ours = {int(budget): tau for budget, tau in curve.get(TREE.name, {}).items()}
    budgets = {label: budget for budget, label in budget_sweep(results["summary"]).items()}
    paper_chain = PAPER_QWEN3_8B[DFLASH.name]
    rows = []
    for label, entry in results["summary"].items():
        if not entry.get("step_ms") or not (label == DFLASH.label() or label in budgets):
            continue
        budget = budgets.get(label)
        if budget is None:
            tau_ours, tau_paper, reported = curve.get(DFLASH.name), paper_chain["tau"], paper_chain["speedup"]
        else:
            tau_ours, tau_paper = ours.get(budget), PAPER_QWEN3_8B["tau"].get(budget)
            reported = PAPER_QWEN3_8B["speedup"].get(budget)
        rows.append(Projection(label, budget, entry["step_ms"], entry["step_ms"] / ar_ms, tau_ours, tau_paper,
                               reported))
    rows.sort(key=lambda row: row.budget or 0)
    return name, ar_ms, rows


@dataclass(frozen=True)
class MtpProjection:
    """vLLM's own MTP timed in the run: its step (a verify of ``drafted`` + 1 tokens and the MTP layers'
    drafts) in baseline AR steps, and the speed-up the published acceptance would give (at most
    ``drafted`` + 1 tokens a step)."""

    drafted: int
    step_ms: float
    cost: float

    @property
    def tau(self) -> float:
        return min(PUBLISHED_MTP["tau"], self.drafted + 1)

    @property
    def speedup(self) -> float:
        return self.tau / self.cost


def project_mtp(results: dict, ar_ms: float) -> MtpProjection | None:
    runs = [run for run in results["runs"] if run["label"] == NATIVE_MTP]
    if not runs:
        return None
    steps = sum(run["new_tokens"] - run.get("accepted", 0) for run in runs)  # each step: its accepted drafts + 1
    step_ms = 1000 * sum(run["wall_s"] for run in runs) / steps
    return MtpProjection(results["config"].get("vllm_mtp_tokens") or 0, step_ms, step_ms / ar_ms)


def format_projection(results: dict, name: str, ar_ms: float, rows: list[Projection], curve_source: str) -> str:
    def times(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}×"

    def number(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}"

    config = results["config"]
    lines = [f"{Path(str(config.get('model'))).name} · drafter {Path(str(config.get('drafter'))).name} · "
             f"{config.get('dtype')} · {config.get('host', {}).get('gpu') or config.get('device')} · "
             f"baseline {name}: {ar_ms:.2f} ms per token",
             "", "| method | step ms | cost (AR steps) | τ ours | speed-up ours | τ paper | speed-up paper τ "
                 "| paper reported |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.label} | {row.step_ms:.2f} | {row.cost:.2f} | {number(row.tau_ours)} | "
                     f"{times(row.speedup_ours)} | {number(row.tau_paper)} | {times(row.speedup_paper)} | "
                     f"{times(row.paper_speedup)} |")
    mtp = project_mtp(results, ar_ms)
    if mtp is not None:
        lines.append(f"| vllm-mtp ({mtp.drafted} drafted) | {mtp.step_ms:.2f} | {mtp.cost:.2f} | – | – | "
                     f"{mtp.tau:.2f} (published) | {times(mtp.speedup)} | – |")
    lines += ["", f"τ ours: {curve_source}. τ paper: {PAPER_QWEN3_8B['source']}. Paper reported: speed-ups over "
                  f"{PAPER_QWEN3_8B['baseline']}."]
    if mtp is not None:
        lines.append(f"vllm-mtp: vLLM's own MTP, its step timed here; τ: {PUBLISHED_MTP['source']}, at most its "
                     "drafted tokens + 1.")
    lines += ["", ASSUMPTIONS]
    if not config.get("timing_only"):
        lines.append("Note: these results are not from a random-weights run of a model shape.")
    return "\n".join(lines)


@dataclass(frozen=True)
class MemoryPlan:
    """An estimate from the shapes alone (bf16): what the weights take, what a token of context
    costs in KV cache (target and drafter), and so the longest context that fits beside a verify
    of ``budget`` nodes. The vLLM engine gives its KV cache what is left after the weights and
    its activation reserve, so the context runs out long before the tree does. A hybrid's linear
    layers and a drafter's sliding-window layers hold a fixed state per request, whatever the
    context (``state_bytes``)."""

    weights_gib: float
    kv_bytes_per_token: int
    context_tokens: dict[int, int]  # budget -> longest context that fits in memory
    model_context: int  # the model's own limit (max_position_embeddings)
    state_bytes: int = 0

    def sentence(self) -> str:
        fits = min(self.context_tokens.values())
        first = ("the model's own context limit binds first: memory holds more" if fits >= self.model_context
                 else "the KV cache (the context) runs out first; the tree's activations are small beside it")
        state = (f", plus {self.state_bytes / 2**20:.0f} MiB of fixed state per request (linear layers' recurrent "
                 "states, sliding windows)" if self.state_bytes else "")
        return (f"weights {self.weights_gib:.1f} GiB, KV cache {self.kv_bytes_per_token / 1024:.0f} KiB per token of "
                f"context (target + drafter){state}; longest context beside a verify of B nodes: "
                + ", ".join(f"B={budget}: {tokens:,}" for budget, tokens in self.context_tokens.items())
                + f" tokens (the model's limit: {self.model_context:,}); {first}.")


def text_config(config: dict) -> dict:
    """A multimodal checkpoint's language model (Qwen3.5 / 3.6 nest it in ``text_config``); the
    vision tower, a few hundred million weights beside tens of billions, is left out."""
    return config.get("text_config") or config


def _layer_types(config: dict) -> list[str]:
    return config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]


def parameter_count(config: dict) -> int:
    """Weights of a Llama/Qwen-style decoder from its config (embeddings, attention, MLP, norms),
    hybrids included: a Gated DeltaNet layer's projections, convolution and gates instead of attention."""
    config = text_config(config)
    hidden = config["hidden_size"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    gated = 2 if config.get("attn_output_gate") else 1  # a gated output doubles the query projection
    attention = hidden * head_dim * ((1 + gated) * heads + 2 * kv_heads)
    query_key_norms = 2 * head_dim if config.get("model_type") in ("qwen3", "qwen3_5_text", "qwen3_next") else 0
    mlp = 3 * hidden * config["intermediate_size"]
    embeddings = config["vocab_size"] * hidden * (1 if config.get("tie_word_embeddings") else 2)
    total = embeddings + hidden
    for layer_type in _layer_types(config):
        mixer = _linear_parameters(config) if layer_type == "linear_attention" else attention + query_key_norms
        total += mixer + mlp + 2 * hidden
    return total


def _linear_parameters(config: dict) -> int:
    hidden = config["hidden_size"]
    key, value, value_heads = _linear_dims(config)
    projections = hidden * (2 * key + 2 * value + 2 * value_heads)  # q, k, v, gate z; b and a per head
    convolution = (2 * key + value) * config.get("linear_conv_kernel_dim", 4)
    return projections + convolution + value * hidden + 2 * value_heads + config["linear_value_head_dim"]


def _linear_dims(config: dict) -> tuple[int, int, int]:
    """Key and value channels of a Gated DeltaNet layer, and its value heads."""
    return (config["linear_num_key_heads"] * config["linear_key_head_dim"],
            config["linear_num_value_heads"] * config["linear_value_head_dim"], config["linear_num_value_heads"])


def kv_bytes_per_token(config: dict, dtype_bytes: int = 2) -> int:
    """KV cache per token of context: the layers whose cache grows with it (full attention)."""
    config = text_config(config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    growing = sum(1 for layer_type in _layer_types(config) if layer_type == "full_attention")
    return 2 * growing * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes


def state_bytes(config: dict, dtype_bytes: int = 2) -> int:
    """What a request holds whatever its context: a linear layer's convolution window and float32
    recurrent state, a sliding-window layer's window of KV."""
    config = text_config(config)
    total = 0
    for layer_type in _layer_types(config):
        if layer_type == "linear_attention":
            key, value, value_heads = _linear_dims(config)
            conv = (2 * key + value) * (config.get("linear_conv_kernel_dim", 4) - 1) * dtype_bytes
            total += conv + value_heads * config["linear_key_head_dim"] * config["linear_value_head_dim"] * 4
        elif layer_type == "sliding_attention":
            heads = config["num_attention_heads"]
            head_dim = config.get("head_dim") or config["hidden_size"] // heads
            total += 2 * config["sliding_window"] * config.get("num_key_value_heads", heads) * head_dim * dtype_bytes
    return total


def memory_plan(target: dict, drafter: dict, gpu_gib: float, utilization: float,
                budgets: tuple[int, ...] = (16, 64, 256, 512, 1024), dtype_bytes: int = 2) -> MemoryPlan:
    """The drafter shares the target's embeddings and head (z-lab): its own weights are its layers and
    the projection of the tapped features; its context cache holds a row per committed token too."""
    target = text_config(target)
    drafter_layers = parameter_count({**drafter, "vocab_size": 0})
    taps = len((drafter.get("dflash_config") or {}).get("target_layer_ids") or drafter.get("target_layer_ids") or [])
    drafter_weights = drafter_layers + taps * drafter["hidden_size"] * drafter["hidden_size"]
    weights = (parameter_count(target) + drafter_weights) * dtype_bytes
    per_token = kv_bytes_per_token(target, dtype_bytes) + kv_bytes_per_token(drafter, dtype_bytes)
    fixed = state_bytes(target, dtype_bytes) + state_bytes(drafter, dtype_bytes)
    room = gpu_gib * 2**30 * utilization - weights - fixed
    context = {}
    for budget in budgets:
        # a verify's largest activations: float32 logits for every node, and the MLP's intermediate
        activations = (budget + 1) * (4 * target["vocab_size"] + 2 * dtype_bytes * target["intermediate_size"])
        context[budget] = max(0, int((room - activations) // per_token))
    return MemoryPlan(weights / 2**30, per_token, context, target.get("max_position_embeddings", 0), fixed)


def shape_folder(name: str) -> Path:
    """The folder a result's model or drafter name points at: a drafter's name ends in its tags,
    in brackets ("... (random weights: timing only)", ``engine.loop.loading.drafter_info``)."""
    return Path(name.split(" (", 1)[0])


def read_curve(folder: str | None) -> tuple[dict, str]:
    """A drafter's measured acceptance curve (its ``config.json``), default: the shipped drafter's."""
    from engine.loop.loading import shipped_drafter

    path = Path(folder) if folder else shipped_drafter()
    if path is None or not (path / "config.json").is_file():
        return {}, "none given"
    acceptance = json.loads((path / "config.json").read_text()).get("acceptance") or {}
    source = (f"{path.name}'s measured curve ({acceptance.get('prompts', '?')}, "
              f"{acceptance.get('max_new_tokens', '?')} tokens, {acceptance.get('dtype', '?')})")
    return acceptance, source


def projection_report(results: dict, curve_folder: str | None = None, gpu_gib: float = 141.0,
                      utilization: float = 0.9) -> str:
    """The projection table of a bench result and, where its shape folders are at hand, the memory estimate."""
    curve, source = read_curve(curve_folder)
    name, ar_ms, rows = project(results, curve)
    text = format_projection(results, name, ar_ms, rows, source)
    folders = [shape_folder(str(results["config"].get(key))) / "config.json" for key in ("model", "drafter")]
    if all(folder.is_file() for folder in folders):
        target, drafter = (json.loads(folder.read_text()) for folder in folders)
        plan = memory_plan(target, drafter, gpu_gib, utilization)
        text += (f"\n\nMemory, estimated from the shapes (bf16, {gpu_gib:g} GiB × {utilization:g}, one request): "
                 + plan.sentence())
    return text


def memory_table(pairs: list[tuple[str, str]], gpu_gib: float, utilization: float) -> str:
    """``memory_plan`` for (target, drafter) config folders, a row each."""
    rows = ["| target | weights (GiB, with drafter) | KV per token (KiB) | fixed state per request (MiB) | "
            "longest context at B=64 / B=512 | model's limit | binds first |", "|---|---|---|---|---|---|---|"]
    for target, drafter in pairs:
        configs = [json.loads((Path(folder) / "config.json").read_text()) for folder in (target, drafter)]
        plan = memory_plan(*configs, gpu_gib, utilization, budgets=(64, 512))
        binds = "the model's limit" if min(plan.context_tokens.values()) >= plan.model_context else "memory"
        rows.append(f"| {Path(target).name} | {plan.weights_gib:.1f} | {plan.kv_bytes_per_token / 1024:.0f} | "
                    f"{plan.state_bytes / 2**20:.0f} | {plan.context_tokens[64]:,} / {plan.context_tokens[512]:,} | "
                    f"{plan.model_context:,} | {binds} |")
    return (f"Memory, estimated from the shapes (bf16, {gpu_gib:g} GiB × {utilization:g}, one request)\n"
            + "\n".join(rows))
