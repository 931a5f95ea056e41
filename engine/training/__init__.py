"""Training a DFlash drafter for the target on the target's own outputs.

``prompts``: prompt sources written here (no dataset download). ``generation``: vLLM and
transformers backends. ``data``: prompts -> greedy target replies -> token shards.
``train``: the DFlash objective and a time-bounded, resumable loop. ``export``: bf16,
sharded checkpoints. ``convert``: GGUF target -> HF folder. ``run``: the whole procedure
as one command; ``device.sh``: that command on the GPU machine. See README.md here.
"""
