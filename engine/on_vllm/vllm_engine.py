"""The vLLM engine: AR, DFlash and DDTree on an embedded ``vllm.LLM``, emitting the torch engine's Trace.

The driver (this module) owns the tokenizer and checks settings; vLLM's workers run the
decode loop on vLLM's model and paged KV cache (``engine.on_vllm.vllm_worker``, loaded as a worker
extension), and rank 0's trace comes back. vLLM's own AR and DFlash are kept as baselines
(``native_generate``): the yardstick a speed claim is measured against.

Needs a CUDA GPU and ``pip install -r requirements-gpu.txt``; nothing else in the Studio
imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engine.errors import EngineError
from engine.gpu.profiling import KernelProfile
from engine.loop.budgeting import Budgeting
from engine.loop.decode import Decoder, DrafterInfo, check_drafter_fits
from engine.loop.loading import RANDOM, drafter_info, shipped_drafter
from engine.loop.remote_batch import RemoteBatch
from engine.loop.settings import DecodeSettings
from engine.measure.calibration import cache_dir
from engine.models.convert import convert, tensor_parallel_copy
from engine.models.drafter import DFlashDrafter, drafter_shape
from engine.models.hybrid import is_hybrid
from engine.models.target import (
    BUNDLED_MODEL,
    Target,
    bundled_gguf,
    has_tokenizer,
    resolve_dtype,
    shape_config,
    shape_tokenizer,
    stop_token_ids,
)
from engine.trace import NATIVE_AR, NATIVE_AR_GRAPHLESS, NATIVE_DFLASH, NATIVE_MTP, Step, Trace

VLLM_VERSION = "0.23.0"  # requirements-gpu.txt pins it; the worker extension reads its internals
REPO = Path(__file__).resolve().parent.parent.parent
# vLLM's own runs (the baseline) serve one request at a time with room for 8: its AR on the bundled model runs
# faster at 8 than at its shipped default, each output first leaving the Studio's AR at the same token at both
# (`gpu_session.sh baseline`: benchmarks/baseline/gpu-vllm-baseline-8.json against gpu-vllm-baseline-default.json);
# and at that default a hybrid's state blocks (one per sequence) do not fit beside the Studio's engine at 27B
# (the figures: docs/HISTORY.md, "Lab notes moved out of the code").
NATIVE_MAX_SEQS = 8


@dataclass(frozen=True)
class VllmOptions:
    tensor_parallel_size: int = 1
    cuda_graphs: bool = True  # the Studio's own graphs: vLLM itself runs eager (see module doc)
    fixed_step: bool = True  # greedy runs as fixed-shape device programs (engine.loop.fixed_step)
    compile_step: bool = False  # their own stages (draft, tree, walk) through torch.compile
    # vLLM compiles the target itself (its inductor graph, native ops fused, one graph for every pass size) in
    # place of running it eagerly; the Studio's CUDA graphs replay it as before. None: for hybrid targets only
    # (``compiles_target``)
    vllm_compile: bool | None = None
    random_weights: bool = False  # config-only model and drafter folders, random weights: timing only
    # vLLM's batch-invariant mode: GEMMs without split-K, so a row's numbers do not depend on the pass's row count
    batch_invariant: bool = False
    gpu_memory_utilization: float = 0.3
    max_model_len: int = 4096
    native_max_seqs: int = NATIVE_MAX_SEQS  # vLLM's own runs' max_num_seqs (0: vLLM's shipped default)


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise EngineError("the vLLM engine needs a CUDA GPU; on this machine use --engine torch")


def require_vllm():
    """vLLM itself, or a clear error saying how to get it."""
    require_cuda()
    try:
        import vllm
    except ImportError as exc:
        raise EngineError(f"the vLLM engine needs vLLM {VLLM_VERSION}: pip install -r requirements-gpu.txt") from exc
    if vllm.__version__ != VLLM_VERSION:
        raise EngineError(f"the vLLM engine is built against vLLM {VLLM_VERSION}, found {vllm.__version__}: "
                          "pip install -r requirements-gpu.txt")
    # vLLM forks its engine process; a driver that already touched CUDA (converting a GGUF,
    # the torch engine beside it) must spawn it instead
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    return vllm


ENGINE_CORE_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"  # vLLM's switch: its engine core in a process of its own


@contextmanager
def engine_core_here() -> Iterator[None]:
    """vLLM's engine core in this process while a ``vllm.LLM`` is made, unless the environment names a place for
    it. The Studio calls its workers once a round (``RemoteBatch``); a core in a process of its own adds to every
    round the way there and back, its report serialized both ways, which grows with the trees (the server's log of
    its rounds names that "hop"). vLLM's own runs (``native_llm``) keep vLLM's default."""
    chosen = ENGINE_CORE_PROCESS in os.environ
    if not chosen:
        os.environ[ENGINE_CORE_PROCESS] = "0"
    try:
        yield
    finally:
        if not chosen:
            del os.environ[ENGINE_CORE_PROCESS]


def model_folder(name: str | None, tensor_parallel_size: int = 1) -> str:
    """An HF folder or id vLLM can load. The bundled GGUF (or any .gguf) is converted once, in
    float32, into the Studio's cache (``cache_dir``), and given attention heads that split over
    ``tensor_parallel_size`` GPUs if its own do not (``split_heads_folder``)."""
    name = name or BUNDLED_MODEL
    if name != BUNDLED_MODEL and not name.endswith(".gguf"):
        return name
    gguf = bundled_gguf() if name == BUNDLED_MODEL else Path(name)
    if not gguf.is_file():
        raise EngineError(f"GGUF file {name!r} does not exist")
    folder = cache_dir() / f"{gguf.stem}-float32"
    _write_once(folder, lambda out: convert(gguf, out, torch.float32))
    return split_heads_folder(folder, tensor_parallel_size)


def split_heads_folder(folder: str | Path, tensor_parallel_size: int) -> str:
    """``folder`` itself, or (once converted, in the cache) its equivalent copy whose attention
    heads split over ``tensor_parallel_size`` GPUs: ``engine.models.convert.tensor_parallel_copy``.
    Used for the bundled target and for the drafter vLLM's own DFlash loads (ours is replicated)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if not (config["num_attention_heads"] % tensor_parallel_size
            or config["num_key_value_heads"] % tensor_parallel_size):
        return str(folder)
    weights = sorted(folder.glob("*.safetensors"))
    source = f"{folder.resolve()}|" + "|".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    split = cache_dir() / f"{folder.name}-{hashlib.sha256(source.encode()).hexdigest()[:8]}-tp{tensor_parallel_size}"
    _write_once(split, lambda out: tensor_parallel_copy(folder, out, tensor_parallel_size))
    return str(split)


def _write_once(folder: Path, write: Callable[[Path], None]) -> None:
    """Make a cached folder unless it exists; written aside and renamed, so an interrupted
    conversion never leaves a half folder that looks done."""
    if (folder / "config.json").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)  # left half-written by an older version
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    write(partial)
    try:
        partial.rename(folder)
    except OSError:  # another process finished first
        shutil.rmtree(partial, ignore_errors=True)


class ClientTarget(Target):
    """The driver's view of the target that vLLM serves: tokenizer and shape, no weights."""

    def __init__(self, name: str, folder: str, dtype: torch.dtype, context_length: int, timing_only: bool = False,
                 runs_batched: bool = False):
        from transformers import AutoConfig

        tokenizer = shape_tokenizer(folder)
        config = AutoConfig.from_pretrained(folder)
        self._config = getattr(config, "text_config", config)  # a multimodal checkpoint's language model
        stop_ids = [] if timing_only else stop_token_ids(tokenizer, self._config)  # timing runs decode full length
        super().__init__(model=None, tokenizer=tokenizer, name=name, stop_ids=stop_ids)
        self._dtype, self._context_length, self._runs_batched = dtype, context_length, runs_batched

    device = property(lambda self: torch.device("cuda"))
    runs_fixed_step = True  # the workers' ``PagedTarget`` forks a hybrid's states in the fixed step too
    runs_batched = property(lambda self: self._runs_batched)  # the workers' ``PagedTarget``'s (not a hybrid's)
    dtype = property(lambda self: self._dtype)
    config = property(lambda self: self._config)
    context_length = property(lambda self: self._context_length)


# the longest accepted path a step commits: one compaction graph's moves, and a hybrid's deepest
# path replay (``engine.on_vllm.vllm_gdn``), so its drafter's blocks may be no longer
MAX_PATH = 32

# hybrid architectures whose Gated DeltaNet layers the vLLM engine forks (``engine.on_vllm.vllm_gdn``);
# vLLM 0.23 serves Qwen3.5 / Qwen3.6 as their multimodal classes (text-only mode here), never as
# text-only checkpoints
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration",
                        "Qwen3_5MoeForConditionalGeneration")


def preflight(folder: str, drafter: DFlashDrafter | None) -> None:
    """What can be checked before vLLM takes the GPU: the target's config, its family, and the
    drafter's fit; each failure is one clear line."""
    config = shape_config(folder)
    text = getattr(config, "text_config", config)
    if is_hybrid(text):
        architectures = getattr(config, "architectures", None) or [config.model_type]
        if not set(architectures) & set(HYBRID_ARCHITECTURES):
            raise EngineError(f"{', '.join(architectures)} is a hybrid (linear-attention) target the vLLM engine "
                              f"cannot run: it forks Gated DeltaNet states for {', '.join(HYBRID_ARCHITECTURES)}; "
                              "use --engine torch, which runs Qwen3.5 / Qwen3-Next hybrids exactly")
        if drafter is not None and drafter.block_size > MAX_PATH:
            raise EngineError(f"the vLLM engine verifies a hybrid target's trees at most {MAX_PATH} tokens deep; this "
                              f"drafter drafts blocks of {drafter.block_size}")
    if drafter is not None:
        check_drafter_fits(drafter.config, text)


def compiles_target(folder: str, asked: bool | None) -> bool:
    """Whether vLLM compiles the target: as asked, else for a hybrid alone. On a hybrid's shape the compiled target
    makes every method's fixed step cheaper than the eager one, every output still vLLM's AR's (README, "Results",
    the Qwen3.6-27B shape with and without ``--no-vllm-compile``). A dense target keeps the Studio's own compiled
    step (``compile_step``), the one its measured speed-ups ran: vLLM's compilation is not yet timed against it."""
    if asked is not None:
        return asked
    config = shape_config(folder)
    return is_hybrid(getattr(config, "text_config", config))


def llm_settings(folder: str, studio: bool) -> dict:
    """``vllm.LLM`` settings a target's folder needs: for a multimodal checkpoint (Qwen3.5 / 3.6,
    hybrid or not) its language model alone, the Studio sends text (else vLLM builds the vision
    tower and loads the image processor, which a text-only test folder lacks); for a hybrid,
    vLLM's own Triton kernels for the prompt's Gated DeltaNet prefill (its FlashInfer one is
    JIT-built, and absent from the GPU bundle), and ``engine.on_vllm.vllm_gdn`` in its workers before the
    model is built (its float32 prefill), through the worker extension: the Studio's (``studio``)
    or one with nothing in it (vLLM's own runs)."""
    config = shape_config(folder)
    hybrid = is_hybrid(getattr(config, "text_config", config))
    settings = {}
    if hybrid:
        settings["additional_config"] = {"gdn_prefill_backend": "triton"}
        settings["worker_extension_cls"] = ("engine.on_vllm.hybrid_worker.HybridStudioWorker" if studio
                                            else "engine.on_vllm.vllm_gdn.HybridPrefill")
    elif studio:
        settings["worker_extension_cls"] = "engine.on_vllm.vllm_worker.StudioWorker"
    if hasattr(config, "text_config"):
        settings["language_model_only"] = True
    return settings


MTP_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3.5 / 3.6; Qwen3-Next, DeepSeek


def check_mtp_layers(model: str | None) -> int:
    """How many multi-token-prediction layers the target ships (what ``--native mtp`` drafts with)."""
    if model is None or model.endswith(".gguf"):
        raise EngineError("--native mtp times the target's own multi-token-prediction layers: "
                          "the bundled GGUF has none")
    config = shape_config(model)
    config = getattr(config, "text_config", None) or config
    layers = max((getattr(config, key, None) or 0 for key in MTP_KEYS), default=0)
    if not layers:
        raise EngineError(f"--native mtp times the target's own multi-token-prediction layers: {model}'s config "
                          f"names none ({' or '.join(MTP_KEYS)})")
    return layers


def tokenizer_folder(folder: str) -> str:
    """Where vLLM reads the tokenizer: the model folder, or (a config-only shape) the bundled model's."""
    return folder if has_tokenizer(folder) else model_folder(None)


class VllmDecoder(Decoder):
    """``Decoder``'s interface over an embedded ``vllm.LLM``; the loop runs in vLLM's workers."""

    def __init__(self, model: str | None, drafter_path: str | None, drafter_info: DrafterInfo,
                 dtype: str = "bfloat16", seed: int = 0, options: VllmOptions = VllmOptions()):
        require_cuda()
        folder = model_folder(model, options.tensor_parallel_size)
        # the driver only checks settings against the drafter: its shape, not its weights (the workers load those)
        drafter = drafter_shape(drafter_path) if drafter_path is not None else None
        preflight(folder, drafter)
        vllm = require_vllm()
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        options = replace(options, vllm_compile=compiles_target(folder, options.vllm_compile))
        self.options, self.drafter_path = options, drafter_path
        settings = llm_settings(folder, studio=True)
        if options.batch_invariant:  # read where vLLM starts its workers, which inherit it
            os.environ["VLLM_BATCH_INVARIANT"] = "1"
        if options.vllm_compile:  # vLLM compiles after loading: the drafter's taps must be in the graph it traces
            taps = drafter.hidden_state_indices if drafter is not None else []
            settings["additional_config"] = settings.get("additional_config", {}) | {"ddtree_taps": taps}
            settings["compilation_config"] = {"cudagraph_mode": "NONE"}  # the Studio records its own graphs
        with engine_core_here():
            self.llm = vllm.LLM(
                model=folder, dtype=dtype, seed=seed, tensor_parallel_size=options.tensor_parallel_size,
                enforce_eager=not options.vllm_compile, attention_backend="TRITON_ATTN", enable_prefix_caching=False,
                gpu_memory_utilization=options.gpu_memory_utilization, max_model_len=options.max_model_len,
                tokenizer=tokenizer_folder(folder), load_format="dummy" if options.random_weights else "auto",
                **settings,
            )
        loaded = self.llm.collective_rpc("studio_load", args=(model or BUNDLED_MODEL, drafter_path,
                                                              drafter_info.name, options.cuda_graphs,
                                                              options.fixed_step, options.compile_step,
                                                              options.random_weights))[0]
        target = ClientTarget(model or BUNDLED_MODEL, folder, resolve_dtype(dtype), loaded["context_length"],
                              timing_only=options.random_weights, runs_batched=loaded["runs_batched"])
        super().__init__(target, drafter, drafter_info, engine="vllm", fixed_step=options.fixed_step,
                         compile_step=options.compile_step, timing_only=options.random_weights)

    def run_prepared(self, prompt: str, prompt_ids: list[int], settings: DecodeSettings, notes: list[str], *,
                     on_step: Callable[[Trace, Step], None] | None = None,
                     should_stop: Callable[[], bool] | None = None) -> Trace:
        """The whole generation runs in the workers, on the settings prepared here (``Decoder.run`` prepares them:
        bad settings fail before any worker is busy; the workers run them as they are): ``on_step`` sees the
        steps once it is over, and ``should_stop`` is read only before it starts."""
        if should_stop is not None and should_stop():
            raise EngineError("stopped before the run started")
        raw = self.llm.collective_rpc("studio_run", args=(prompt, list(prompt_ids), asdict(settings), list(notes)))[0]
        trace = Trace.from_json(raw)
        trace.config.notes.append(f"vLLM {VLLM_VERSION}, tensor parallel {self.options.tensor_parallel_size}, "
                                  f"CUDA graphs {'on' if self.options.cuda_graphs else 'off'}, "
                                  f"{trace.config.step} step"
                                  + (", target compiled by vLLM" if self.options.vllm_compile else "")
                                  + (", batch-invariant" if self.options.batch_invariant else ""))
        if on_step is not None:
            for step in trace.steps:
                on_step(trace, step)
        return trace

    def remote_batch(self, budgeting: Budgeting) -> RemoteBatch:
        """The batch lives in the workers (``StudioWorker.studio_batch``), its trees sized by ``budgeting`` (its
        step costs and calibration travel there); each round's steps come back as they happen."""
        self.llm.collective_rpc("studio_batch_open", args=({"cost": asdict(budgeting.cost),
                                                            "calibration": budgeting.calibration.to_dict(),
                                                            "source": budgeting.source},))
        return RemoteBatch(lambda method, *args: self.llm.collective_rpc("studio_batch", args=(method, *args))[0])

    def remote_step_costs(self, prompts: list[list[int]], requests: tuple[int, ...], nodes: tuple[int, ...]
                          ) -> dict:
        return self.llm.collective_rpc("studio_step_costs", args=(prompts, list(requests), list(nodes)))[0]

    def start(self, *args, **kwargs):
        raise EngineError("the vLLM engine runs each generation whole in its workers: it has no run to hand out "
                          "step by step; call run, or race (which runs the methods one after another)")

    def takes_turns(self, settings: list[DecodeSettings]) -> bool:
        return False  # the loop runs in the workers, a generation at a time

    def kernel_profile(self, prompt_ids: list[int], settings: DecodeSettings) -> KernelProfile:
        settings, notes = self.prepare(settings, len(prompt_ids))
        return KernelProfile(**self.llm.collective_rpc("studio_kernels",
                                                       args=(list(prompt_ids), asdict(settings), notes))[0])

    def close(self) -> None:
        """Stop the workers, whose engine holds its share of the GPU until then; nothing runs here after."""
        self.llm.llm_engine.engine_core.shutdown()


def load_vllm_decoder(model: str | None, drafter: str | None, dtype: str = "bfloat16", seed: int = 0,
                      options: VllmOptions = VllmOptions()) -> VllmDecoder:
    """The vLLM twin of ``engine.loop.loading.load_decoder`` (the shipped drafter for the bundled model)."""
    if drafter == RANDOM:
        raise EngineError("the vLLM engine runs trained drafters only: pass a drafter folder")
    if options.random_weights and drafter is None:
        raise EngineError("--random-weights takes a drafter config folder too (e.g. assets/shapes/...)")
    if drafter is None and (model or BUNDLED_MODEL) == BUNDLED_MODEL and shipped_drafter() is not None:
        drafter = str(shipped_drafter())
    info = drafter_info(drafter, timing_only=options.random_weights) if drafter else DrafterInfo("none", trained=False)
    return VllmDecoder(model, drafter, info, dtype=dtype, seed=seed, options=options)


@dataclass(frozen=True)
class NativeDecoder:
    """One of vLLM's own decoders, a baseline the bench times beside the Studio's (``--native``): vLLM's AR, or
    its speculative decoding with the Studio's drafter (vLLM's DFlash) or with the target's own
    multi-token-prediction layers (MTP). Its own table: these are vLLM's modes, none of them a Studio method."""

    option: str  # what ``--native`` calls it
    label: str  # its runs' label in a results file (``engine.trace``)
    our_drafter: bool = False  # drafts with the Studio's drafter (vLLM's DFlash)
    mtp: bool = False  # drafts with the target's own multi-token-prediction layers
    cuda_graphs: bool = True  # vLLM's own CUDA graphs (off: compiled without them, as ``--vllm-compile`` runs ours)

    @property
    def drafts(self) -> bool:
        return self.our_drafter or self.mtp


NATIVE_DECODERS = (NativeDecoder("ar", NATIVE_AR),
                   NativeDecoder("ar-graphless", NATIVE_AR_GRAPHLESS, cuda_graphs=False),
                   NativeDecoder("dflash", NATIVE_DFLASH, our_drafter=True),
                   NativeDecoder("mtp", NATIVE_MTP, mtp=True))


@dataclass
class NativeRun:
    """vLLM's own generation of one prompt: the baseline the Studio's loop is measured against."""

    output_ids: list[int]
    wall_s: float
    margins: list[float] | None = None  # top-1 minus top-2 logit per token, when asked for


def native_llm(model: str | None, dtype: str, drafter: str | None = None, num_speculative_tokens: int = 15,
               seed: int = 0, options: VllmOptions = VllmOptions(), enforce_eager: bool = False, mtp: bool = False,
               cuda_graphs: bool = True):
    """vLLM as it ships (CUDA graphs on unless ``enforce_eager``, or ``cuda_graphs`` off: compiled, as the
    Studio's ``--vllm-compile`` runs its model, without vLLM's graphs): AR, its DFlash with our drafter
    when ``drafter`` is given, or (``mtp``) the target's own multi-token-prediction layers drafting
    ``num_speculative_tokens``. AR runs with async scheduling, its fastest single-request setting that
    keeps the outputs (FULL graph mode is faster and changes them). With ``options.random_weights`` the
    drafter is random too: its τ means nothing, but whether its outputs leave vLLM's AR says whether
    the target compiled with the drafter's taps (vLLM's own aux hidden states) still computes AR's numbers."""
    vllm = require_vllm()
    speculative = None
    if drafter is not None:
        speculative = {"method": "dflash", "model": split_heads_folder(drafter, options.tensor_parallel_size),
                       "num_speculative_tokens": num_speculative_tokens}
    if mtp:
        speculative = {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
    folder = model_folder(model, options.tensor_parallel_size)
    return vllm.LLM(model=folder, tokenizer=tokenizer_folder(folder), dtype=dtype, seed=seed,
                    load_format="dummy" if options.random_weights else "auto",
                    tensor_parallel_size=options.tensor_parallel_size, enable_prefix_caching=False,
                    gpu_memory_utilization=options.gpu_memory_utilization, max_model_len=options.max_model_len,
                    speculative_config=speculative, disable_log_stats=False, enforce_eager=enforce_eager,
                    async_scheduling=speculative is None, **native_settings(folder, options),
                    **({} if cuda_graphs else {"compilation_config": {"cudagraph_mode": "NONE"}}))


def native_settings(folder: str, options: VllmOptions) -> dict:
    """``llm_settings`` for vLLM's own runs, with ``options.native_max_seqs`` (0 keeps vLLM's own)."""
    settings = llm_settings(folder, studio=False)
    if options.native_max_seqs:
        settings["max_num_seqs"] = options.native_max_seqs
    return settings


def native_generate(llm, prompt_ids: list[int], max_new_tokens: int, stop_ids: list[int],
                    margins: bool = False) -> NativeRun:
    """Greedy, one request at a time (as the Studio's loop runs), stopping where the loop stops.
    ``margins`` asks vLLM for the top-2 log-probs (their gap is the logit gap); time it apart."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_ids,
                            ignore_eos=not stop_ids, detokenize=False, logprobs=2 if margins else None)
    started = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], params, use_tqdm=False)[0].outputs[0]
    wall = time.perf_counter() - started
    gaps = [_top2_gap(top) for top in out.logprobs] if margins else None
    return NativeRun(output_ids=list(out.token_ids), wall_s=wall, margins=gaps)


@dataclass
class NativeAnswer:
    """One answer of vLLM's own engine under clients: its token ids and, on this process's monotonic clock, when
    it was sent, when its first token came and when it ended."""

    index: int  # the prompt's
    output_ids: list[int]
    sent: float
    first: float | None
    done: float


def native_clients(llm, prompts: list[list[int]], clients: int, max_new_tokens: int,
                   stop_ids: list[int]) -> list[NativeAnswer]:
    """vLLM's own continuous batching under ``clients`` clients: each client sends its next prompt the moment its
    last answer ends, so at most ``clients`` requests are in flight, as many OpenAI clients would keep them; greedy,
    stopping where the Studio's loop stops. vLLM's engine is stepped here (``LLMEngine.step``, what
    ``LLM.generate`` loops on), so a request joins at the next step after one ends."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=stop_ids,
                            ignore_eos=not stop_ids, detokenize=False)
    engine = llm.llm_engine
    waiting = list(enumerate(prompts))
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    answers: list[NativeAnswer] = []
    while waiting or len(sent) > len(answers):
        while waiting and len(sent) - len(answers) < clients:
            index, ids = waiting.pop(0)
            engine.add_request(f"{index}", TokensPrompt(prompt_token_ids=list(ids)), params)
            sent[index] = time.monotonic()
        for out in engine.step():
            now = time.monotonic()
            index = int(out.request_id.split("-")[0])  # vLLM may add a suffix of its own
            if out.outputs[0].token_ids:
                first.setdefault(index, now)
            if out.finished:
                answers.append(NativeAnswer(index, list(out.outputs[0].token_ids), sent[index], first.get(index),
                                            now))
    return sorted(answers, key=lambda answer: answer.index)


@dataclass
class ClientsRun:
    """``native_clients`` timed: its answers, its wall seconds and its τ."""

    answers: list[NativeAnswer]
    seconds: float
    tau: float  # vLLM's counters over the run: tokens a step (1 where nothing drafts)


def timed_clients(llm, prompts: list[list[int]], clients: int, max_new_tokens: int, stop_ids: list[int]) -> ClientsRun:
    """``native_clients``, timed, with τ from vLLM's speculative-decoding counters over the run alone."""
    before = native_acceptance(llm)
    began = time.monotonic()
    answers = native_clients(llm, prompts, clients, max_new_tokens, stop_ids)
    seconds = time.monotonic() - began
    drafts, accepted = (after - earlier for after, earlier in zip(native_acceptance(llm), before))
    return ClientsRun(answers, seconds, 1 + accepted / drafts if drafts else 1.0)


def _top2_gap(top: dict) -> float:
    values = sorted((entry.logprob for entry in top.values()), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def native_acceptance(llm) -> tuple[int, int]:
    """(drafts, accepted draft tokens) so far, from vLLM's speculative-decoding counters."""
    drafts = accepted = 0
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_drafts":
            drafts += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens":
            accepted += int(metric.value)
    return drafts, accepted

