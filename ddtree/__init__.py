"""DDTree: draft trees from block-diffusion drafts, verified in one target pass.

Pure tensor code, no models: build a tree from per-position draft log-probabilities,
compile it into verification inputs, walk it with the target's own tokens, and say
which KV rows to keep. A DFlash chain is the width-1 tree.
"""

from ddtree.cache import compact_rows, kept_rows
from ddtree.paged import (
    compaction_moves,
    compaction_moves_of,
    compaction_slots,
    move_rows,
    padded_verify,
    paged_slots,
    query_bias,
    slots_verify,
    table_slots,
    verify_paths,
    verify_slots,
)
from ddtree.tree import DraftTree, build_tree, chain_tree
from ddtree.verify import (
    TreeInputs,
    ancestor_mask,
    attention_bias,
    compile_tree,
    follow_tree,
    sample_tokens,
)

__all__ = [
    "DraftTree",
    "TreeInputs",
    "ancestor_mask",
    "attention_bias",
    "build_tree",
    "chain_tree",
    "compact_rows",
    "compaction_moves",
    "compaction_moves_of",
    "compaction_slots",
    "padded_verify",
    "compile_tree",
    "follow_tree",
    "kept_rows",
    "move_rows",
    "paged_slots",
    "query_bias",
    "sample_tokens",
    "slots_verify",
    "table_slots",
    "verify_paths",
    "verify_slots",
]
