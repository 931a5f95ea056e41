"""The Studio's worker extension for hybrid targets (Gated DeltaNet layers).

vLLM imports the module that ``worker_extension_cls`` names before it builds and profiles the
model, so naming ``HybridStudioWorker`` brings ``engine.on_vllm.vllm_gdn`` (its float32 prefill,
its tree pass) into the workers in time; ``StudioWorker`` then finds its ``GDNLayers`` there.
It sits apart from both so that each of them imports only downwards.
"""

from __future__ import annotations

from engine.on_vllm.vllm_gdn import HybridPrefill
from engine.on_vllm.vllm_worker import StudioWorker


class HybridStudioWorker(StudioWorker, HybridPrefill):
    """``StudioWorker`` with ``engine.on_vllm.vllm_gdn`` imported before the model is built."""
