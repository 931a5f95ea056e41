"""Training a DFlash drafter for the target on the target's own outputs.

``prompts``: prompt sources written here (no dataset download). ``data``: prompts ->
greedy target responses -> token files (vLLM or transformers). ``train``: the DFlash
objective. ``export``: bf16, sharded checkpoints. ``run``: the whole procedure as one
command. See README.md beside this file.
"""
