"""Two ways to let the target complete many token-id prompts: vLLM (GPU, fast) and
transformers ``generate`` (CPU tests, fallback). Both return the same ``Completion``s.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.models.target import Target


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass
class Completion:
    token_ids: list[int]  # the generated tokens, ending with the stop token when the turn finished
    stopped: bool  # True: the model ended its turn; False: cut by max_new_tokens


def device_and_dtype(device: str, dtype: str | None) -> tuple[str, str]:
    """``auto`` picks CUDA when present; the dtype defaults to bfloat16 there, float32 on CPU."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, dtype or ("bfloat16" if device.startswith("cuda") else "float32")


class Generator(Protocol):
    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]: ...

    def close(self) -> None: ...


def as_completion(token_ids: list[int], stop_ids: list[int]) -> Completion:
    """Cut after the first stop token (kept: the drafter must learn to end turns too)."""
    for i, token in enumerate(token_ids):
        if token in stop_ids:
            return Completion(token_ids[: i + 1], stopped=True)
    return Completion(token_ids, stopped=False)


class TransformersGenerator:
    """Batched ``model.generate`` with left padding; shortest prompts batched together."""

    def __init__(self, target: Target, batch_size: int = 16, seed: int = 0):
        self.target, self.batch_size = target, batch_size
        self.pad_id = target.stop_ids[0]  # any id works under the attention mask
        torch.manual_seed(seed)

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            indices = order[start:start + self.batch_size]
            for index, completion in zip(indices, self._batch([prompts[i] for i in indices], sampling)):
                results[index] = completion
        return results

    @torch.inference_mode()
    def _batch(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        width = max(len(p) for p in prompts)
        device = self.target.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampled = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        output = self.target.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=sampling.max_new_tokens,
            eos_token_id=self.target.stop_ids, pad_token_id=self.pad_id,
            **(sampled if sampling.temperature > 0 else {"do_sample": False}),
        )
        return [as_completion(row.tolist(), self.target.stop_ids) for row in output[:, width:]]

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class VllmSettings:
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 1024  # a 135M model is overhead-bound: many sequences per step pay for it
    enforce_eager: bool = False  # CUDA graphs: a longer start, then several times faster per step
    # a fixed KV cache size skips vLLM's memory profiling, which fails when engines sharing the GPU
    # start together (each sees the others' memory come and go); None: profile, fill the utilization
    kv_cache_gib: float | None = None


class VllmGenerator:
    """vLLM on an HF folder; token-id prompts in, token ids out (our tokenizer decodes)."""

    def __init__(self, model_folder: str, stop_ids: list[int], seed: int = 0, settings: VllmSettings = VllmSettings()):
        from vllm import LLM  # only where vLLM is installed (the GPU machine)

        self.stop_ids = stop_ids
        self.llm = LLM(model=model_folder, dtype="bfloat16", seed=seed, skip_tokenizer_init=True,
                       max_model_len=settings.max_model_len, gpu_memory_utilization=settings.gpu_memory_utilization,
                       max_num_seqs=settings.max_num_seqs, enforce_eager=settings.enforce_eager,
                       enable_prefix_caching=True,
                       kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30) if settings.kv_cache_gib else None)

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_new_tokens, stop_token_ids=self.stop_ids, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        return [as_completion(list(out.outputs[0].token_ids), self.stop_ids) for out in outputs]

    def close(self) -> None:
        """Free the GPU for training (the data stage also runs in its own process, for certainty)."""
        del self.llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
