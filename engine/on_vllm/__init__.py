"""The vLLM engine: the driver (``vllm_engine``), the worker extension that runs the loop inside
vLLM's workers (``vllm_worker``, hybrids: ``hybrid_worker``), the attention verify whose every row is AR's
step (``path_attention``), and Gated DeltaNet tree verification on vLLM's state caches (``vllm_gdn`` running
``gdn_fused``, with ``gdn_tree`` the reference). Named so it never shadows ``vllm`` itself."""
