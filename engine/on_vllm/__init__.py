"""The vLLM engine: the driver (``vllm_engine``), the worker extension that runs the loop inside
vLLM's workers (``vllm_worker``, hybrids: ``hybrid_worker``), and Gated DeltaNet tree verification
on vLLM's state caches (``vllm_gdn`` over ``gdn_tree``). Named so it never shadows ``vllm`` itself."""
