"""The Studio's decode loop inside vLLM's workers: vLLM's model, kernels and paged KV cache.

vLLM loads ``StudioWorker`` as a worker extension (``worker_extension_cls``), so this module
is imported in every worker process, also under tensor parallelism. Each rank runs the same
loop (``engine.loop.decode``) in lockstep: the target's logits are all-gathered, so every rank
builds the same tree and takes the same path, and their collectives line up. The loop talks
to vLLM through ``PagedTarget``, which gives a vLLM model the torch engine's ``Target``
interface.

vLLM is touched at one named point: the Triton attention backend's ``unified_attention``
is wrapped so that a verify pass (a tree, or DFlash's chain) runs ``engine.on_vllm.path_attention`` in
its place, which reads each node's keys where AR's one-token step of the same token reads them and
runs that step's launch (vLLM's 3D, split-context one), so that the node's row is AR's bit for bit.
``DDTREE_ATTENTION=bias`` in the environment runs the readable reference instead: vLLM's own kernel
with a query-query bias (``qq_bias``, a parameter the kernel still has from vLLM's removed
tree-attention backend), whose online softmax meets a node's ancestors among masked siblings, so
bf16 rounds its rows otherwise (``engine.tools.row_invariance --engine vllm`` compares
every row of either with AR's steps).
And both of vLLM's model runners' ``load_model`` are wrapped so that, where vLLM compiles the target
(``VllmOptions.vllm_compile``), the drafter's tapped layers are set before it traces the model.
Hybrid targets (Gated DeltaNet layers) add two more, in ``engine.on_vllm.vllm_gdn``, imported only
for them. Nothing else is patched.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import vllm
import vllm.v1.attention.backends.triton_attn as triton_attn
from vllm.config import CompilationMode
from vllm.distributed import tensor_model_parallel_all_gather
from vllm.distributed.parallel_state import graph_capture
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID
from vllm.v1.kv_cache_interface import KVQuantMode
from vllm.v1.worker.gpu.model_runner import GPUModelRunner as GPUModelRunnerV2
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import ddtree
from ddtree.allocate import Calibration, StepCost
from ddtree.batch import BatchLayout, pack_trees
from ddtree.fixed import compaction_rows
from ddtree.forks import depths, path_table
from ddtree.paged import PaddedVerify
from engine.errors import EngineError
from engine.gpu.graphs import GraphedCall, record
from engine.gpu.kv_moves import RowMover
from engine.gpu.profiling import profile_kernels
from engine.loop.batch import Batch
from engine.loop.budgeting import Budgeting
from engine.loop.decode import Decoder, DrafterInfo
from engine.loop.fixed_step import padded_prompt, prefill_bucket
from engine.loop.remote_batch import BatchHost
from engine.loop.settings import DecodeSettings
from engine.measure.row_check import check as row_check
from engine.measure.step_cost import time_step_costs
from engine.models.drafter import load_drafter
from engine.models.paged import PagedBatchKV, PagedRows
from engine.models.target import BATCH_STEP_VARIABLE, Target, stop_token_ids
from engine.on_vllm.path_attention import path_attention
from engine.on_vllm.vllm_engine import MAX_PATH

MAX_GRAPHS = 8  # verify shapes kept as CUDA graphs; others run eagerly
# longest prompt pass replayed as a graph: beyond it the pass is compute, not launches, and a graph
# would keep its activations (all-row logits too, where a caller asks for every row) in the pool for good
MAX_PREFILL_GRAPH = 1024
BIAS_PAD_ROWS = 16  # the Triton kernel's largest query tile
# a batch's verify replays at its tokens rounded up to a bucket (``batch_bucket``), with this many request slots (the
# requests, then the padding's): a batch of more tokens or requests runs eagerly. The largest bucket holds sixteen
# requests' auto trees at their most (``AUTO_NODES`` and the root each)
BATCH_BUCKETS = ((128, 16), (256, 32), (512, 64), (1152, 128))  # (up to this many tokens, in steps of)
BATCH_REQUEST_SLOTS = 256  # a prompt's chunk (``PREFILL_TOKENS``) is as many requests as tokens
BIAS_REFERENCE = os.environ.get("DDTREE_ATTENTION") == "bias"
# "1": a hybrid target's requests share steps (``HybridBatchKV``); off, it serves one request at a time, since its
# batch has not yet given every request its solo AR output on a GPU (``gpu_session.sh hybrid-batch`` sets it)
HYBRID_BATCH_VARIABLE = "DDTREE_HYBRID_BATCH"


@dataclass(frozen=True)
class TreeQueries:
    """What the attention layers of one tree verify share: the query bias, and every node's path."""

    bias: torch.Tensor | None  # [q, q]: 0 among a node's ancestors and itself, -inf elsewhere (None: many trees)
    visible: torch.Tensor | None  # [q, q] bool: where the bias is 0
    table: torch.Tensor  # [q, q] int32: node i's ancestor at each depth (``ddtree.forks.path_table``)
    depth: torch.Tensor  # [q] int32

    @staticmethod
    def of(bias: torch.Tensor) -> TreeQueries:
        visible = bias == 0
        return TreeQueries(bias, visible, path_table(visible, bias.shape[0]).to(torch.int32),
                           depths(visible).to(torch.int32))

    @staticmethod
    def packed(layout, device: torch.device) -> TreeQueries:
        """Many requests' trees in one pass (``ddtree.batch.BatchLayout``, on the host, where its per-request walk
        reads nothing back from the device): path attention reads them; no one query bias can say them, so the
        bias reference does not run them."""
        table, depth = ddtree.verify_paths(layout)
        return TreeQueries(None, None, table.to(device), depth.to(device))


class _Tree:
    """The tree the next attention calls verify; ``None`` outside a tree verify."""

    current: TreeQueries | None = None


def _reads_paths(settings: dict) -> bool:
    """Whether the call is one ``path_attention`` computes as vLLM's kernel would: none of the options it leaves out."""
    return (settings["window_size"][0] < 0 and not settings["softcap"] and settings.get("alibi_slopes") is None
            and settings.get("sinks") is None and settings.get("output_scale") is None
            and settings.get("mm_prefix_range") is None and not settings.get("use_td")
            and settings.get("kv_quant_mode", KVQuantMode.NONE) == KVQuantMode.NONE
            and settings["k"].dtype == settings["q"].dtype)


def _unified_attention_with_tree(**settings):
    tree = _Tree.current
    if tree is not None and not BIAS_REFERENCE and _reads_paths(settings):
        return path_attention(settings["q"], settings["k"], settings["v"], settings["out"], settings["block_table"],
                              settings["seqused_k"], settings["cu_seqlens_q"], tree.table, tree.depth,
                              settings["softmax_scale"])
    if tree is not None:
        if tree.bias is None:
            raise EngineError("a batch of trees verifies through path attention only: not with "
                              "DDTREE_ATTENTION=bias, nor with attention settings it leaves out")
        settings["qq_bias"] = tree.bias
    return _unified_attention(**settings)


_unified_attention = triton_attn.unified_attention
triton_attn.unified_attention = _unified_attention_with_tree


def _with_taps(load_model):
    def load_model_with_taps(self, *args, **kwargs):
        load_model(self, *args, **kwargs)
        taps = (self.vllm_config.additional_config or {}).get("ddtree_taps")
        if taps is not None:  # the Studio's engine with vLLM compiling: the drafter's taps, in the graph it will trace
            getattr(self.model, "language_model", self.model).model.aux_hidden_state_layers = tuple(sorted(set(taps)))
            self.use_aux_hidden_state_outputs = bool(taps)  # its own passes (profiling, warm-up) then unpack them
    return load_model_with_taps


# vLLM 0.23 runs dense Llama, Mistral and Qwen3 targets on its second model runner, the rest on the first
for _runner in (GPUModelRunner, GPUModelRunnerV2):
    _runner.load_model = _with_taps(_runner.load_model)


@dataclass
class PagedCache:
    """One request's rows in vLLM's paged KV cache; the block table is the identity."""

    length: int = 0  # rows written so far


class _Forward:
    """One verify shape: static inputs, attention metadata and (once captured) a CUDA graph."""

    def __init__(self, target: PagedTarget, size: int, tree: bool, prefill: bool = False, last_row: bool = False):
        device = target.device
        self.target, self.size, self.prefill = target, size, prefill
        # int32 as vLLM's runners feed it: a model vLLM compiled (--vllm-compile) runs without dynamo's guards,
        # and its embedding then reads int64 ids as pairs of int32 words (every pass past one token wrong)
        self.ids = torch.zeros(size, dtype=torch.int32, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.zeros(size, dtype=torch.long, device=device)
        self.offsets = torch.arange(size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(1, dtype=torch.int32, device=device)
        # the kernel loads the bias a whole query tile at a time (up to 16 rows), rows past the
        # last query included: back the [size, size] view with memory for them
        self.bias = torch.zeros(size + BIAS_PAD_ROWS, size, dtype=torch.float32, device=device)[:size] if tree else None
        # ``last_row``: the logits of one row, this index (a prompt's last token; padding may follow it)
        self.last = torch.zeros(1, dtype=torch.long, device=device) if last_row else None
        self.metadata = target.layer_metadata(size, self.slots, self.seq_lens, prefill)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.gdn_pass = None  # a hybrid target's tree pass as the graph recorded it

    def load(self, input_ids: torch.Tensor, position_ids: torch.Tensor, past: int | torch.Tensor,
             bias: torch.Tensor | None) -> None:
        """The pass's inputs; ``past`` (rows before it) may be a device tensor: nothing is read back."""
        self.ids.copy_(input_ids)
        self.positions.copy_(position_ids)
        self.slots.copy_(self.offsets + past)
        self.seq_lens.fill_(past + self.size)
        if self.bias is not None:
            self.bias.copy_(bias, non_blocking=True)

    def run(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if self.graph is not None:
            self.graph.replay()
            if self.gdn_pass is not None:
                self.target.gdn.pending = self.gdn_pass  # the commit reads what this graph's layers kept
            return self.outputs
        return self.target.run_model(self.ids, self.positions, self.metadata, self.slots, self.bias, self.prefill,
                                     last=self.last)

    @torch.inference_mode()
    def capture(self) -> None:
        """Record the pass as a CUDA graph (after one eager run on the loaded inputs)."""
        self.run()
        self.graph, self.outputs = self.target.recorded(
            lambda: self.target.run_model(self.ids, self.positions, self.metadata, self.slots, self.bias,
                                          last=self.last))
        if self.target.gdn is not None:
            self.gdn_pass = self.target.gdn.pending


def batch_bucket(tokens: int) -> int | None:
    """The rows a batch's verify of ``tokens`` tokens replays at (``BATCH_BUCKETS``); None: past the largest, eager."""
    for limit, step in BATCH_BUCKETS:
        if tokens <= limit:
            return -(-tokens // step) * step
    return None


class _BatchForward:
    """A batch's verify at one padded size (``ddtree.padded_verify``): its inputs and attention metadata at fixed
    addresses, run eagerly the first time, then replayed from the CUDA graph recorded after that run. The padding
    request reads and writes the scratch block alone: its row of the block table names nothing else."""

    def __init__(self, target: PagedTarget, tokens: int, blocks: int):
        device, requests = target.device, BATCH_REQUEST_SLOTS
        int32, long = dict(dtype=torch.int32, device=device), dict(dtype=torch.long, device=device)
        self.target, self.tokens, self.requests = target, tokens, requests
        self.ids = torch.zeros(tokens, **int32)  # int32 as vLLM's runners feed it (``_Forward``)
        self.positions = torch.zeros(tokens, **long)
        self.slots = torch.zeros(tokens, **long)
        self.seq_lens = torch.zeros(requests, **int32)
        self.block_table = torch.zeros(requests, blocks, **int32)
        self.trees = TreeQueries(None, None, torch.zeros(tokens, MAX_PATH, **int32), torch.zeros(tokens, **int32))
        # a hybrid's: each token's request's Gated DeltaNet state blocks, a block a group (``HybridBatchKV.states``)
        self.states = torch.zeros(tokens, len(target.gdn.groups), **int32) if target.gdn is not None else None
        # the metadata's host copy of query_start_loc says only the pass's size: the kernels read the device's
        bounds = torch.full((requests + 1,), tokens, dtype=torch.int32)
        bounds[0] = 0
        self.query_start = bounds.to(device)
        metadata = target.paged_metadata(bounds, self.seq_lens, self.block_table, self.slots, self.query_start)
        self.metadata = {name: metadata for name in target.attention_names}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.gdn_pass = None  # a hybrid target's pass as the graph recorded it

    def load(self, layout, table: torch.Tensor, scratch: int, states: torch.Tensor | None = None) -> None:
        """The batch's trees (``layout`` on the host) and their requests' rows of the block table (``table [R, b]``);
        on a hybrid their state blocks (``states [R, groups]``)."""
        self.load_padded(ddtree.padded_verify(layout, self.tokens, self.requests, MAX_PATH), table, scratch, states)

    def load_padded(self, padded: PaddedVerify, table: torch.Tensor, scratch: int,
                    states: torch.Tensor | None = None) -> None:
        """The pass padded to this size (``ddtree.padded_verify``, or ``slots_verify`` on the device) and its requests'
        rows of the block table (``table [R, b]``); on a hybrid their state blocks (``states [R, groups]``: the
        padding tokens' name the single request's, which a verify only reads)."""
        self.ids.copy_(padded.input_ids)
        self.positions.copy_(padded.position_ids)
        self.query_start.copy_(padded.query_start)
        self.seq_lens.copy_(padded.seq_lens)
        self.trees.table.copy_(padded.paths)
        self.trees.depth.copy_(padded.depth)
        self.block_table.fill_(scratch)
        self.block_table[:table.shape[0], :table.shape[1]] = table
        block_size = self.target.block_size
        self.slots.copy_(ddtree.table_slots(self.block_table, padded.requests.to(self.target.device),
                                            padded.columns.to(self.target.device), block_size))
        if self.states is not None:
            by_request = torch.cat([states, self.target.gdn.single[None]])  # [R + 1, groups]: padding's last
            self.states.copy_(by_request[padded.requests.to(self.target.device).clamp(max=states.shape[0])])

    def run(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits ``[tokens, vocab]`` and the tapped layers (each ``[tokens, hidden]``) of the loaded pass."""
        gdn = self.target.gdn
        if self.graph is None:
            outputs = self.program()
            ran = gdn.pending if gdn is not None else None
            self.graph, self.outputs = self.target.recorded(self.program)
            if gdn is not None:  # the commit reads what the eager run kept; later ones, what the graph keeps
                self.gdn_pass, gdn.pending = gdn.pending, ran
            return outputs
        self.graph.replay()
        if gdn is not None:
            gdn.pending = self.gdn_pass
        return self.outputs

    def program(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.target.run_model(self.ids, self.positions, self.metadata, self.slots, None, trees=self.trees,
                                     states=self.states)


class PagedTarget(Target):
    """``Target`` over a vLLM worker's model: forward, tree bias and commit on the paged cache."""

    batched_modules = False

    def __init__(self, runner, tokenizer, name: str, use_cuda_graphs: bool = True):
        model = runner.get_model()
        super().__init__(model=model, tokenizer=tokenizer, name=name,
                         stop_ids=stop_token_ids(tokenizer, runner.model_config.hf_text_config))
        self.runner, self.vllm_config = runner, runner.vllm_config
        groups = [group for groups in runner.attn_groups for group in groups]
        attention = [group for group in groups if group.backend.get_name() == "TRITON_ATTN"]
        linear = [group for group in groups if group.backend.get_name() == "GDN_ATTN"]
        if not attention or len(attention) + len(linear) != len(groups):
            names = sorted({group.backend.get_name() for group in groups})
            raise EngineError(f"the vLLM engine verifies trees with the Triton attention backend (plus Gated DeltaNet "
                              f"layers on hybrids); this target's layers need {', '.join(names)}")
        self.builder = attention[0].metadata_builders[0]
        self.attention_names = [name for group in attention for name in group.layer_names]
        forward_layers = self.vllm_config.compilation_config.static_forward_context
        self.kv_caches = [forward_layers[name].kv_cache for name in self.attention_names]
        if self.kv_caches[0].shape[1] != 2:
            raise EngineError(f"unexpected KV cache layout {tuple(self.kv_caches[0].shape)} "
                              f"for vLLM {vllm.__version__}")
        self.block_size = self.kv_caches[0].shape[2]
        blocks = self.kv_caches[0].shape[0]
        self.gdn = None
        if linear:
            from engine.on_vllm.vllm_gdn import GDNLayers

            # a hybrid's layers share each block's memory across KV-cache groups: the request's
            # states take one block per Gated DeltaNet group at the pool's end, the attention
            # rows the blocks before them
            self.gdn = GDNLayers(linear, forward_layers, device=self.device)
            blocks = min(blocks, self.gdn.slot)
        self.capacity = blocks * self.block_size
        self.block_table = torch.arange(blocks, dtype=torch.int32, device=self.device)[None]
        # a multimodal checkpoint (Qwen3.5 / 3.6) runs its language model alone: the Studio sends text
        self.text_model = getattr(model, "language_model", model)
        self.compiled_model = None  # torch.compile of it, for the fixed step's verify (--compile-step)
        # vLLM compiled the model itself (--vllm-compile): torch.compile it no further
        self.vllm_compiled = self.vllm_config.compilation_config.mode != CompilationMode.NONE
        self.mrope = runner.model_config.uses_mrope
        self._embedding = _full_vocab(self.text_model.model.embed_tokens.weight, self.config.vocab_size)
        head = self.text_model.model.embed_tokens if self.config.tie_word_embeddings else self.text_model.lm_head
        self._lm_head = _full_vocab(head.weight, self.config.vocab_size)
        self.use_cuda_graphs = use_cuda_graphs
        self.forwards: dict[tuple[int, bool], _Forward] = {}
        # prompt passes by padded length (``prefill_bucket``) and whether they keep the last row's logits alone
        self.prefills: dict[tuple[int, bool], _Forward] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if use_cuda_graphs else None
        self.batch_forwards: dict[int, _BatchForward] = {}  # a batch's verify passes by padded size
        self.slot_forwards: dict[tuple[int, int], _BatchForward] = {}  # the fixed batched step's past those, eager
        # a recorded batch verify's block table width: a request's context and its tree at most
        self.graph_blocks = -(-(self.context_length + BATCH_BUCKETS[-1][0]) // self.block_size)
        # move_rows(sources, targets): cache rows of every layer, in one launch where Triton runs
        self.move_rows = RowMover(self.kv_caches, self.block_size)
        self.compaction = _Compaction(self, moves=MAX_PATH)

    runs_fixed_step = True  # a hybrid's linear layers fork and commit their states inside the step's programs too
    # the batch's fixed-shape step (``verify_slots``), not yet run on a GPU: the batch steps readably unless asked;
    # a hybrid's batch steps readably (its states commit after the host's walk)
    verifies_slots = property(lambda self: os.environ.get(BATCH_STEP_VARIABLE) == "fixed" and self.gdn is None)

    @property
    def config(self):
        return self.runner.model_config.hf_text_config

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.model_config.dtype

    @property
    def context_length(self) -> int:
        return min(self.runner.model_config.max_model_len, self.capacity - 1)  # the last row is scratch

    @property
    def embedding(self) -> torch.Tensor:
        return self._embedding

    @property
    def lm_head(self) -> torch.Tensor:
        return self._lm_head

    def tap_layers(self, hidden_state_indices: list[int]) -> None:
        """Return these HF ``hidden_states`` indices from every pass, keyed the same way.

        vLLM records the residual stream *entering* layer ``k`` as aux index ``k`` (0: the
        embeddings), which is exactly HF's ``hidden_states[k]``: no offset to add here.
        """
        self.taps = sorted(set(hidden_state_indices))
        self.text_model.model.aux_hidden_state_layers = tuple(self.taps)

    def new_cache(self) -> PagedCache:
        return PagedCache()

    def tree_bias(self, visible: torch.Tensor, past_length: int) -> torch.Tensor:
        return ddtree.query_bias(visible)

    def layer_metadata(self, size: int, slots: torch.Tensor, seq_lens: torch.Tensor, prefill: bool) -> dict:
        """Each layer's attention metadata for a pass of ``size`` tokens; a hybrid's linear layers
        get vLLM's for a prefill, and verify trees on their own otherwise (``engine.on_vllm.vllm_gdn``)."""
        metadata = self.attention_metadata(size, slots, seq_lens)
        layers = {name: metadata for name in self.attention_names}
        if self.gdn is not None and prefill:
            layers |= self.gdn.prefill_metadata(size, slots)
        return layers

    def attention_metadata(self, size: int, slots: torch.Tensor, seq_lens: torch.Tensor):
        return self.paged_metadata(torch.tensor([0, size], dtype=torch.int32), seq_lens, self.block_table, slots)

    def paged_metadata(self, query_start: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
                       slots: torch.Tensor, query_start_device: torch.Tensor | None = None):
        """The attention layers' metadata for a pass of requests ``query_start`` ([R + 1] int32, on the CPU)
        delimits, each ``seq_lens`` ([R] int32) long through its row of ``block_table`` ([R, max blocks] int32),
        the pass's tokens written at ``slots`` ([T]); ``query_start_device``: the device's copy the kernels read (a
        recorded pass's, at a fixed address), by default made here."""
        common = CommonAttentionMetadata(
            query_start_loc=query_start.to(self.device) if query_start_device is None else query_start_device,
            query_start_loc_cpu=query_start,
            seq_lens=seq_lens, num_reqs=seq_lens.numel(), num_actual_tokens=int(query_start[-1]),
            max_query_len=int(query_start.diff().max()), max_seq_len=self.context_length,
            block_table_tensor=block_table, slot_mapping=slots,
        )
        return self.builder.build(0, common)

    def run_model(self, ids, positions, metadata: dict, slots, bias, prefill: bool = False, compiled: bool = False,
                  last: torch.Tensor | None = None, trees: TreeQueries | None = None, states: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass of vLLM's model; ``compiled``: through torch.compile at this fixed size, unless vLLM compiled
        the model itself. (Dynamo breaks vLLM's graph at each decoder layer and stops at its recompile limit, so
        past the first layers they run eagerly: on a hybrid most of the target stays eager.) ``last``: the logits
        of that row alone, as vLLM's own prompt pass computes them (one row through the LM head). ``trees``: a
        batch's (``TreeQueries.packed``), in place of one tree's ``bias``; on a hybrid, ``states [T, groups]``: each
        token's request's state blocks (``HybridBatchKV``)."""
        model = self.text_model
        if compiled and not self.vllm_compiled:
            if self.compiled_model is None:
                self.compiled_model = torch.compile(self.text_model, dynamic=False)
            model = self.compiled_model
        tree = _Tree.current = TreeQueries.of(bias) if bias is not None else trees
        if self.gdn is not None and states is not None:
            self.gdn.begin_batch(tree.table, tree.depth, states)
        elif self.gdn is not None and not prefill:
            size = ids.numel()
            visible = tree.visible if tree is not None else torch.ones(size, size, dtype=torch.bool, device=ids.device)
            self.gdn.begin(visible, min(size, MAX_PATH))
        try:
            with set_forward_context(metadata, self.vllm_config, num_tokens=ids.numel(),
                                     slot_mapping={name: slots for name in self.attention_names}):
                out = model(input_ids=ids, positions=positions.expand(3, -1) if self.mrope else positions,
                            intermediate_tensors=None)
                hidden, taps = out if isinstance(out, tuple) else (out, [])
                return self.text_model.compute_logits(hidden if last is None else hidden.index_select(0, last)), taps
        finally:
            _Tree.current = None
            if self.gdn is not None:
                self.gdn.end()

    @property
    def runs_batched(self) -> bool:
        """A hybrid's linear layers verify a batch's trees in the fused programs alone, and only where
        ``DDTREE_HYBRID_BATCH=1`` asks (``HYBRID_BATCH_VARIABLE``)."""
        return self.gdn is None or (self.gdn.fused and os.environ.get(HYBRID_BATCH_VARIABLE) == "1")

    def batch_kv(self, rows: int, columns: int, paged: bool = True) -> PagedBatchKV:
        """A batch's cache: vLLM's own pool, each request through its own blocks (the pool's last block is the
        batch's scratch); it holds what vLLM allocated. A hybrid's requests hold state blocks there too."""
        if self.gdn is not None:
            from engine.on_vllm.vllm_gdn import HybridBatchKV

            return HybridBatchKV(self.kv_caches, self.block_size, self.gdn)
        # a table as wide as a recorded pass's from the start: a wider one would move it under the fixed step's graphs;
        # vLLM's null block held by no request, as in a hybrid's (``HybridBatchKV``)
        return PagedBatchKV(self.kv_caches, self.block_size, grow=False, width=self.graph_blocks,
                            reserved=NULL_BLOCK_ID + 1)

    def verify_batch(self, verify_pass, kv: PagedBatchKV, layout, hidden_states: bool):
        """A batch's trees (``ddtree.batch.BatchLayout``, on the host) in one pass of vLLM's model, each request's
        nodes written after its past through its own blocks and attending through path attention: replayed from
        the CUDA graph of its padded size (``_BatchForward``), or eagerly (``verify_batch_eager``, the reference).
        Logits ``[T, vocab]`` and, if asked, the tapped layers (each ``[1, T, hidden]``)."""
        kv.hold_layout(layout)
        table = kv.tables.table[layout.rows.to(self.device)]  # [R, blocks]
        bucket = batch_bucket(layout.tokens)
        if (not self.use_cuda_graphs or bucket is None or layout.requests >= BATCH_REQUEST_SLOTS
                or table.shape[1] > self.graph_blocks):
            return self.verify_batch_eager(kv, layout, table, hidden_states)
        if not self.batch_forwards:
            self.record_batch_graphs(kv.tables.scratch)
        forward = self.batch_forwards[bucket]
        forward.load(layout, table, kv.tables.scratch, self.request_states(kv, layout))
        logits, taps = forward.run()
        tokens = layout.tokens
        return logits[:tokens], self.tapped([tap[:tokens] for tap in taps]) if hidden_states else None

    def record_batch_graphs(self, scratch: int) -> None:
        """Every padded size's verify recorded at once, each from a pass of padding alone in the ``scratch`` block, so
        that a serving batch never stops to record one when its trees first reach a size."""
        none = torch.zeros(0, self.graph_blocks, dtype=torch.int32, device=self.device)
        no_states = None
        if self.gdn is not None:  # every size's recorded pass keeps its nodes in one buffer, made before them
            self.gdn.reserve_batch(BATCH_BUCKETS[-1][0], self.dtype)
            no_states = torch.zeros(0, len(self.gdn.groups), dtype=torch.int32, device=self.device)
        for bucket in sorted({batch_bucket(tokens) for tokens in range(1, BATCH_BUCKETS[-1][0] + 1)}):
            forward = self.batch_forwards[bucket] = _BatchForward(self, bucket, self.graph_blocks)
            forward.load(BatchLayout.empty(), none, scratch, no_states)
            forward.run()  # the eager pass, then the recording

    def verify_slots(self, kv: PagedBatchKV, rows, read, ids, positions, past, visible, hidden_states: bool):
        """The batch's fixed-shape step's pass (``engine.loop.fixed_batch``): slot s's ``ids [b, n]`` at ``positions``
        after its ``past [b]`` through its row ``rows[s]`` of the block table, ``visible [b, n, n]`` its tree, as a
        batch's verify loaded on the device (``ddtree.slots_verify``): replayed from the CUDA graph of its padded size
        (``_BatchForward``), or past the recorded sizes run eagerly at its own. Logits ``[b, n, vocab]`` and, if asked,
        the tapped layers (each ``[b, n, hidden]``)."""
        count, size = ids.shape
        tokens = count * size
        if count >= BATCH_REQUEST_SLOTS:
            raise EngineError(f"a batch of {count} requests is past the {BATCH_REQUEST_SLOTS - 1} a verify holds")
        table = kv.tables.table[rows]  # [b, blocks]
        bucket = batch_bucket(tokens)
        recorded = self.use_cuda_graphs and bucket is not None and table.shape[1] <= self.graph_blocks
        if recorded and not self.batch_forwards:
            self.record_batch_graphs(kv.tables.scratch)
        key = (tokens, table.shape[1])
        if not recorded and key not in self.slot_forwards:
            self.slot_forwards[key] = _BatchForward(self, tokens, table.shape[1])
        forward = self.batch_forwards[bucket] if recorded else self.slot_forwards[key]
        forward.load_padded(ddtree.slots_verify(ids, positions, past, visible, forward.tokens, BATCH_REQUEST_SLOTS,
                                                MAX_PATH), table, kv.tables.scratch)
        # inside the recording of the fixed step's program, the pass is recorded into it rather than replayed
        replays = recorded and not torch.cuda.is_current_stream_capturing()
        logits, taps = forward.run() if replays else forward.program()
        hidden = ({index: tap[0].view(count, size, -1) for index, tap in
                   self.tapped([tap[:tokens] for tap in taps]).items()} if hidden_states else None)
        return logits[:tokens].view(count, size, -1), hidden

    def verify_batch_eager(self, kv: PagedBatchKV, layout, table: torch.Tensor, hidden_states: bool):
        """``verify_batch`` as one eager pass of exactly the batch's tokens."""
        trees = TreeQueries.packed(layout, self.device)
        query_start = layout.query_start_loc.to(torch.int32)
        layout = layout.to(self.device)
        states = self.request_states(kv, layout)
        if states is not None:  # each token's request's
            states = states[torch.repeat_interleave(torch.arange(layout.requests), layout.query_start_loc.diff())]
        slots, seq_lens = ddtree.verify_slots(layout, table, self.block_size)
        metadata = self.paged_metadata(query_start, seq_lens.to(torch.int32), table, slots)
        layers = {name: metadata for name in self.attention_names}
        logits, taps = self.run_model(layout.input_ids.to(torch.int32), layout.position_ids, layers, slots, None,
                                      trees=trees, states=states)
        return logits, self.tapped(taps) if hidden_states else None

    def request_states(self, kv: PagedBatchKV, layout) -> torch.Tensor | None:
        """A hybrid batch's requests' state blocks, ``[R, groups]`` in the layout's order (None: no hybrid)."""
        return kv.states[layout.rows.to(self.device)] if self.gdn is not None else None

    def prompt_chunk(self, input_ids, position_ids, chunk: PagedRows, hidden_states: bool, last_logits: bool):
        """A batch's prompt chunk (``PagedBatchKV.prompt``: one request's tokens, through its blocks) as a batch's
        verify: each token a request of its root alone after the tokens before it, all in the request's row, so every
        token's row is AR's step of it and the chunk replays from the graph of its size (``verify_batch``). A hybrid's
        chunk is a prefill, whose linear layers carry the request's states on (``hybrid_prompt_chunk``)."""
        if self.gdn is not None:
            return self.hybrid_prompt_chunk(input_ids, position_ids, chunk, hidden_states, last_logits)
        size = input_ids.shape[1]
        start, row = chunk.width - size, int(chunk.rows[0])
        layout = pack_trees([ddtree.DraftTree.empty()] * size, input_ids[0].tolist(), list(range(start, chunk.width)),
                            [row] * size)
        logits, hidden = self.verify_batch(None, chunk.kv, layout, hidden_states)
        return logits[-1:] if last_logits else logits, hidden

    def hybrid_prompt_chunk(self, input_ids, position_ids, chunk: PagedRows, hidden_states: bool, last_logits: bool):
        """A hybrid batch's prompt chunk: one eager causal prefill of the request's tokens after the ``past`` before
        them, the attention layers through its blocks, the linear layers from its state blocks (an empty state for
        its first chunk: vLLM's prefill reads none where nothing was computed before) and into them."""
        size, kv = input_ids.shape[1], chunk.kv
        past, row = chunk.width - size, int(chunk.rows[0])
        seq_lens = torch.tensor([past + size], dtype=torch.int32, device=self.device)
        metadata = self.paged_metadata(torch.tensor([0, size], dtype=torch.int32), seq_lens,
                                       kv.tables.table[row:row + 1], chunk.slots)
        layers = {name: metadata for name in self.attention_names}
        layers |= self.gdn.prefill_metadata(size, chunk.slots, kv.state_blocks[row], past)
        last = torch.tensor([size - 1], device=self.device) if last_logits else None
        logits, taps = self.run_model(input_ids[0].to(torch.int32), position_ids[0], layers, chunk.slots, None,
                                      prefill=True, last=last)
        return logits, self.tapped(taps) if hidden_states else None

    def forward(self, input_ids, position_ids, cache: PagedCache | PagedRows, attention_bias=None,
                hidden_states=False, last_logits=False):
        if isinstance(cache, PagedRows):
            return self.prompt_chunk(input_ids, position_ids, cache, hidden_states, last_logits)
        size = input_ids.shape[1]
        if cache.length + size > self.capacity:
            raise EngineError(f"the vLLM KV cache holds {self.capacity} tokens; this pass needs {cache.length + size}")
        prefill = cache.length == 0
        if prefill and self.gdn is not None and attention_bias is not None:
            raise EngineError("a hybrid target's prompt runs as a plain causal prefill, not as a tree")
        bucket = self._prefill_bucket(size) if prefill and attention_bias is None else None
        if bucket is not None:
            key = (bucket, last_logits)
            if key not in self.prefills:
                self.prefills[key] = _Forward(self, bucket, tree=False, prefill=True, last_row=last_logits)
            forward = self.prefills[key]
            forward.load(*padded_prompt(input_ids[0], position_ids[0], bucket), 0, None)
        else:
            forward = self._forward_for(size, attention_bias is not None, prefill, last_logits)
            forward.load(input_ids[0], position_ids[0], cache.length, attention_bias)
        if forward.last is not None:
            forward.last.fill_(size - 1)
        logits, taps = forward.run()
        cache.length += size  # like a DynamicCache: every pass appends; ``commit`` then trims to the path
        return logits[:size], self.tapped([tap[:size] for tap in taps]) if hidden_states else None

    def _prefill_bucket(self, size: int) -> int | None:
        """The padded length a prompt's pass replays at as a CUDA graph (None: an eager pass of its own
        length). Causal attention keeps the padding out of the prompt's rows; the padding's KV rows lie
        past the prompt, where the next pass writes before anything reads them. Not for hybrids: padding
        would run through their recurrent states."""
        if not self.use_cuda_graphs or self.gdn is not None:
            return None
        bucket = prefill_bucket(size)
        return bucket if bucket <= min(MAX_PREFILL_GRAPH, self.context_length) else None

    def tapped(self, taps: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """A pass's tapped layers keyed as HF's ``hidden_states``, each ``[1, q, hidden]``."""
        if len(taps) != len(self.taps):  # seen with --vllm-compile while only one of vLLM's runners got the taps
            raise EngineError(f"the target's pass returned {len(taps)} of the drafter's {len(self.taps)} tapped layers "
                              f"{self.taps}" + (": vLLM compiled the model without them; run without --vllm-compile"
                                                if self.vllm_compiled else ""))
        return {layer: tap[None] for layer, tap in zip(self.taps, taps)}

    def fixed_kv(self, capacity: int, compiled: bool = False) -> PagedKV:
        return PagedKV(self, compiled)  # the paged cache is vLLM's, of its own capacity

    def _forward_for(self, size: int, tree: bool, prefill: bool, last_row: bool = False) -> _Forward:
        key = (size, tree)
        if prefill or last_row or key not in self.forwards and len(self.forwards) >= MAX_GRAPHS:
            return _Forward(self, size, tree, prefill, last_row)
        if key not in self.forwards:
            self.forwards[key] = _Forward(self, size, tree)
        return self.forwards[key]

    def capture_pending(self) -> None:
        """Turn the verify shapes and prompt buckets seen so far (inputs already loaded) into CUDA graphs."""
        if self.use_cuda_graphs:
            for forward in [*self.forwards.values(), *self.prefills.values()]:
                if forward.graph is None:
                    forward.capture()

    @contextmanager
    def capturing(self):
        """vLLM's capture context (its custom all-reduce records into the graph under tensor parallelism)."""
        with graph_capture(device=self.device) as context:
            yield context.stream

    def recorded(self, program) -> tuple[torch.cuda.CUDAGraph, object]:
        """``program()`` (run once eagerly already, its inputs loaded) recorded as a CUDA graph in this target's
        pool, within vLLM's capture context, and the outputs its replays write."""
        torch.cuda.synchronize()
        with graph_capture(device=self.device) as context:
            return record(program, pool=self.graph_pool, stream=context.stream)

    def commit(self, cache: PagedCache, past_length: int, accepted: list[int]) -> None:
        sources, targets = ddtree.compaction_moves(past_length, accepted)
        if sources.numel():
            self.compaction(sources, targets)
        if self.gdn is not None:
            self.gdn.commit(accepted)
        cache.length = past_length + len(accepted)


class _Compaction:
    """KV compaction for every layer (one kernel, or ~60 where Triton cannot take the caches) as one
    CUDA graph over a fixed number of moves; unused moves copy the cache's last row, which no request
    reaches, onto itself."""

    def __init__(self, target: PagedTarget, moves: int):
        self.target, self.moves, self.scratch = target, moves, target.capacity - 1
        self.sources = torch.full((moves,), self.scratch, dtype=torch.long, device=target.device)
        self.targets = torch.full((moves,), self.scratch, dtype=torch.long, device=target.device)
        self.graphed = GraphedCall(lambda: self.target.move_rows(self.sources, self.targets))

    def __call__(self, sources: torch.Tensor, targets: torch.Tensor) -> None:
        count = sources.numel()
        if not self.target.use_cuda_graphs or count > self.moves:
            self.target.move_rows(sources.to(self.target.device), targets.to(self.target.device))
            return
        self.sources.fill_(self.scratch)
        self.targets.fill_(self.scratch)
        self.sources[:count].copy_(sources)
        self.targets[:count].copy_(targets)
        self.graphed()


class PagedKV:
    """The fixed-shape step's view of the paged cache (``engine.loop.fixed_step``): a verify pass whose
    slots, sequence length and tree bias are computed on the device from the write cursor
    ``past``, so the caller records it into its own CUDA graph; the compaction moves the rows
    ``ddtree.fixed.compaction_rows`` names, the cache's last row taking the padding moves."""

    def __init__(self, target: PagedTarget, compiled: bool = False):
        self.target, self.compiled = target, compiled
        self.forks_states = target.gdn is not None  # a hybrid's: every step's path enters the linear layers' states
        self.forwards: dict[int, _Forward] = {}  # static inputs and attention metadata per verify size

    def prefill_cache(self) -> PagedCache:
        return PagedCache()

    def capturing(self):
        return self.target.capturing()

    def verify(self, ids: torch.Tensor, positions: torch.Tensor, past: torch.Tensor, visible: torch.Tensor):
        size = ids.numel()
        if size not in self.forwards:
            self.forwards[size] = _Forward(self.target, size, tree=size > 1)
        forward = self.forwards[size]
        forward.load(ids, positions, past, ddtree.query_bias(visible) if size > 1 else None)
        logits, taps = self.target.run_model(forward.ids, forward.positions, forward.metadata, forward.slots,
                                             forward.bias, compiled=self.compiled)
        return logits, self.target.tapped(taps)

    def compact(self, past: torch.Tensor, path: torch.Tensor, length: torch.Tensor) -> None:
        self.target.move_rows(*compaction_rows(past, path, length, self.target.capacity - 1))
        if self.forks_states:
            self.target.gdn.commit_path(path, length)


def _full_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A vocab-parallel weight gathered across tensor-parallel ranks, padding rows dropped."""
    return tensor_model_parallel_all_gather(weight.contiguous(), dim=0)[:vocab_size]


class StudioWorker:
    """Methods vLLM adds to its worker class; the driver calls them through ``collective_rpc``."""

    def studio_load(self, name: str, drafter_path: str | None, drafter_name: str, use_cuda_graphs: bool,
                    fixed_step: bool, compile_step: bool, random_weights: bool) -> dict:
        from transformers import AutoTokenizer

        runner = self.model_runner
        tokenizer = AutoTokenizer.from_pretrained(runner.model_config.tokenizer)
        target = PagedTarget(runner, tokenizer, name, use_cuda_graphs)
        drafter = None
        if drafter_path is not None:
            drafter = load_drafter(drafter_path, random_weights).to(device=target.device, dtype=target.dtype).eval()
            target.tap_layers(drafter.hidden_state_indices)
        else:
            target.tap_layers([])
        if random_weights:
            target.stop_ids = []  # timing runs decode their full length
        info = DrafterInfo(drafter_name, trained=drafter is not None and not random_weights)
        self.studio = Decoder(target, drafter, info, engine="vllm", cuda_graphs=use_cuda_graphs, fixed_step=fixed_step,
                              compile_step=compile_step, timing_only=random_weights)
        self.batch_host: BatchHost | None = None
        return {"context_length": target.context_length, "runs_batched": target.runs_batched}

    def studio_batch_open(self, budgeting: dict) -> None:
        """A fresh batch (the driver's ``RemoteBatch``), its trees sized by the driver's step costs and calibration."""
        if self.batch_host is not None and not self.batch_host.batch.idle:
            raise EngineError("a batch is in flight on this worker: one batch at a time")
        sizing = Budgeting(StepCost(**budgeting["cost"]), Calibration.from_dict(budgeting["calibration"]),
                           budgeting["source"])
        self.batch_host = BatchHost(Batch(self.studio, sizing))

    def studio_batch(self, method: str, *args):
        """``BatchHost.admit`` or ``BatchHost.advance`` on this worker's batch."""
        if method not in ("admit", "advance"):
            raise EngineError(f"a batch answers admit and advance, not {method!r}")
        with torch.inference_mode():
            return getattr(self.batch_host, method)(*args)

    def studio_step_costs(self, prompts: list[list[int]], requests: list[int], nodes: list[int]) -> dict:
        """``engine.measure.step_cost.time_step_costs`` on this worker's models, as plain data."""
        self._refuse_while_batching()
        with torch.inference_mode():
            return time_step_costs(self.studio, prompts, tuple(requests), tuple(nodes)).to_dict()

    def _refuse_while_batching(self) -> None:
        """A run of its own writes the cache rows the batch's requests hold: not while they are in flight."""
        if self.batch_host is not None and not self.batch_host.batch.idle:
            raise EngineError("the server's batch holds this worker's KV cache: a run of its own waits until the "
                              "batch is idle")

    def studio_run(self, prompt: str, prompt_ids: list[int], settings: dict, notes: list[str]) -> str:
        """One generation on the settings the driver prepared (``Decoder.prepare``), run as they are; returns the
        trace as JSON (rank 0's is the one the driver reads)."""
        self._refuse_while_batching()
        decoder: Decoder = self.studio
        trace = decoder.run_prepared(prompt, prompt_ids, DecodeSettings(**settings), notes)
        decoder.target.capture_pending()  # shapes this run met for the first time replay from the next run on
        return trace.to_json()

    def studio_rows(self, prompts: list[tuple[str, list[int]]], rows: list[int]) -> list[dict]:
        """``engine.measure.row_check`` on this worker's target, for each (prompt id, context ids)."""
        target: PagedTarget = self.studio.target
        if target.gdn is not None:
            raise EngineError("the row check runs AR steps without commits: an all-attention target only, not a "
                              "hybrid, whose recurrent states advance at each commit")
        with torch.inference_mode():
            return [asdict(found) for prompt_id, ids in prompts for found in row_check(target, prompt_id, ids, rows)]

    def studio_kernels(self, prompt_ids: list[int], settings: dict, notes: list[str]) -> dict:
        """Kernels per step by stage for one generation on the settings the driver prepared, and the slowest
        (``engine.gpu.profiling.KernelProfile``'s fields: the reply crosses vLLM's process boundary as plain data,
        like every other one here)."""
        prepared = DecodeSettings(**settings)
        return asdict(profile_kernels(lambda: self.studio.run_prepared("", prompt_ids, prepared, notes)))
