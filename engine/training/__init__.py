"""Training a DFlash drafter for the target on the target's own outputs.

``prompts``: prompt sources written here (no dataset download). ``generation``: vLLM and
transformers backends. ``data``: prompts -> greedy target replies -> token shards.
``train``: the DFlash objective and a time-bounded, resumable loop (``settings``: what both
read). ``export``: bf16, sharded checkpoints. ``run``: the whole procedure as one command;
``device.sh``: that command on the GPU machine (it converts the GGUF target with
``engine.models.convert``). See README.md here.
"""
