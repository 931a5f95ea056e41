"""The models: the target (``target``, hybrids in ``hybrid``), the DFlash drafter (``drafter``),
GGUF conversion (``convert``), and what the loop asks of a target and a KV cache (``protocols``)."""
