"""Which module of vLLM's float32 forward leaves exact arithmetic: every decoder layer's norms, token
mixer (attention or Gated DeltaNet) and MLP, each replayed here in float64 on vLLM's own inputs.

    on the GPU:  python -m engine.tools.module_check capture --model FOLDER --prompts P.jsonl --limit N --out CAPTURE.pt
    here:        python -m engine.tools.module_check compare CAPTURE.pt --model FOLDER

``engine.tools.margin_check`` says how far vLLM's logits stray, prompt by prompt; this says where. The
capture runs vLLM's own AR (eager, one prompt pass per prompt, its engine in this process) with a
hook around every such module that keeps what went in and what came out, for the prompt's tokens.
The compare feeds each module's captured inputs to the transformers twin of that module in float64
and prints the largest difference from vLLM's output, module by module and prompt by prompt: errors
do not carry from one module into the next, so a float32 kernel that computes what the model says
stays within rounding here (1e-7 to 1e-5 of its output's scale), and one that does not stands out
at the prompt lengths where it strays.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import sys
from dataclasses import dataclass

import torch

from engine.errors import EngineError, run_command

# the modules of one decoder layer, by their common name in vLLM and in transformers
MODULE = re.compile(r"(?:^|\.)layers\.(\d+)\.(input_layernorm|linear_attn|self_attn|post_attention_layernorm|mlp)$")


@dataclass
class Captured:
    """One module call of one prompt pass: positional and keyword tensors in, tensors out (first
    ``tokens`` rows each)."""

    args: list
    kwargs: dict
    outputs: list


def _rows(value, tokens: int):
    """A captured tensor's first ``tokens`` rows, batch dimension dropped (vLLM's tokens come flat)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 3 and value.shape[0] == 1:
        value = value[0]
    return value[..., :tokens, :].detach().float().cpu().clone() if value.dim() >= 2 else value.detach().cpu().clone()


def install_hooks(worker, records: dict, expected: list[int]) -> int:
    """Runs in vLLM's (in-process) worker: a pre- and a post-hook on every decoder module, recording
    into ``records[name]`` the call whose token count is ``expected[0]`` (the prompt pass)."""
    model = worker.model_runner.model
    hooked = 0
    for name, module in model.named_modules():
        match = MODULE.search(name)
        if not match:
            continue
        key = f"layers.{match[1]}.{match[2]}"

        def before(module, args, kwargs, key=key):
            tokens = expected[0]
            first = args[0] if args else kwargs.get("hidden_states")
            if first is not None and first.shape[-2] >= tokens:  # a prompt pass (tokens flat in vLLM, batched here)
                # vLLM's fused add + norm works in place: keep the inputs before the call
                records[key] = Captured([_rows(a, tokens) for a in args],
                                       {k: _rows(v, tokens) for k, v in kwargs.items() if k != "output"}, [])

        def after(module, args, kwargs, result, key=key):
            tokens = expected[0]
            if key in records and not records[key].outputs:
                written = kwargs.get("output")  # the token mixers write into the layer's buffer
                results = result if isinstance(result, tuple) else (result,)
                records[key].outputs = [_rows(t, tokens) for t in ((written,) if written is not None else results)]

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        hooked += 1
    return hooked


def capture(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: hooks see plain Python objects
    from vllm import SamplingParams, TokensPrompt

    from engine.models.target import Target, shape_tokenizer
    from engine.on_vllm.vllm_engine import native_llm
    from engine.tools.bench import read_prompts

    # the chat template as the bench applies it, without the weights (vLLM holds the model)
    chat = Target(model=None, tokenizer=shape_tokenizer(args.model), name=args.model, stop_ids=[])
    prompts = read_prompts(args.prompts)[: args.limit]
    llm = native_llm(args.model, "float32", enforce_eager=True)
    records, expected = {}, [0]
    hooked = llm.collective_rpc(install_hooks, args=(records, expected))[0]
    if not hooked:
        raise EngineError(f"{args.model}: no decoder modules named like {MODULE.pattern} to hook")
    passes = []
    for prompt in prompts:
        ids = chat.chat_ids(prompt["prompt"])
        records.clear()
        expected[0] = len(ids)
        llm.generate(TokensPrompt(prompt_token_ids=ids), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        passes.append({"prompt_id": prompt["id"], "tokens": len(ids), "modules": dict(records)})
        print(f"capture: {prompt['id']} ({len(ids)} tokens): {len(records)} of {hooked} modules", flush=True)
    torch.save({"model": args.model, "passes": passes}, args.out)
    return 0


def replay(module: torch.nn.Module, kind: str, call: Captured, rotary) -> torch.Tensor:
    """The transformers module on vLLM's captured inputs, in float64: what vLLM's output should be."""
    if kind.endswith("layernorm"):
        x = call.args[0] if len(call.args) < 2 else call.args[0] + call.args[1]  # vLLM's norm adds the residual first
        return module(x.double())
    x = (call.args[0] if call.args else call.kwargs["hidden_states"]).double()[None]
    if kind == "mlp":
        return module(x[0])
    if kind == "linear_attn":
        return module(x)[0]
    tokens = x.shape[1]
    positions = torch.arange(tokens).view(1, 1, -1).expand(3, 1, -1)  # multimodal rotary: text, height, width
    causal = torch.full((tokens, tokens), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    return module(x, position_embeddings=rotary(x, positions), attention_mask=causal)[0][0]


def module_errors(model: torch.nn.Module, passes: list[dict]) -> dict[str, list[float | None]]:
    """For every captured module, by pass: max |captured output − the float64 module on its inputs|,
    relative to the largest |output| (a random model's activations run to the hundreds)."""
    modules = {f"layers.{m[1]}.{m[2]}": module for name, module in model.named_modules() if (m := MODULE.search(name))}
    rotary = next(module for name, module in model.named_modules() if name.endswith("rotary_emb"))
    names = sorted({name for p in passes for name in p["modules"]}, key=lambda n: (int(n.split(".")[1]), n))
    missing = [name for name in names if name not in modules]
    if missing:
        raise EngineError(f"the model here has no module {missing[0]!r}: compare with the capture's own model")
    errors = {}
    with torch.no_grad():
        for name in names:
            errors[name] = []
            for p in passes:
                call = p["modules"].get(name)
                exact = replay(modules[name], name.split(".")[2], call, rotary) if call and call.outputs else None
                errors[name].append(None if exact is None else
                                    float((call.outputs[0].double() - exact).abs().max() / exact.abs().max()))
    return errors


def compare(args: argparse.Namespace) -> int:
    from engine.models.target import load_target

    try:
        captured = torch.load(args.capture, weights_only=False)
    except (OSError, RuntimeError, pickle.UnpicklingError) as exc:
        captured = exc
    if not (isinstance(captured, dict) and "passes" in captured):
        raise EngineError(f"{args.capture}: not a capture of engine.tools.module_check")
    model = load_target(args.model or captured["model"], device="cpu", dtype="float64").model
    passes = sorted(captured["passes"], key=lambda p: p["tokens"])
    print("max |vLLM float32 − float64 replay of vLLM's inputs| / max |output|, by prompt (tokens); "
          "float32 rounding: 1e-7 to 1e-5\n")
    print("| module | " + " | ".join(f"{p['prompt_id']} ({p['tokens']})" for p in passes) + " |")
    print("|---|" + "---|" * len(passes))
    for name, row in module_errors(model, passes).items():
        print(f"| {name} | " + " | ".join("–" if e is None else f"{e:.1e}" for e in row) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.tools.module_check", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    on_gpu = commands.add_parser("capture",
                                 help="vLLM's float32 prompt passes, every decoder module's inputs and outputs")
    on_gpu.add_argument("--model", required=True)
    on_gpu.add_argument("--prompts", default="assets/prompts/fresh.jsonl")
    on_gpu.add_argument("--limit", type=int, default=12)
    on_gpu.add_argument("--out", required=True)
    here = commands.add_parser("compare", help="each captured call replayed through the transformers module in float64")
    here.add_argument("capture")
    here.add_argument("--model", default=None, help="the model folder here (default: the capture's)")
    args = parser.parse_args(argv)
    return run_command(capture if args.command == "capture" else compare, args)


if __name__ == "__main__":
    sys.exit(main())
