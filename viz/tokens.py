"""Token text for display, kept apart from any tokenizer.

Figure builders take a ``TokenText`` (token id -> raw text) so they stay pure: the
app passes the tokenizer's decode when a model is loaded, and ``pieces_token_text``
when it only has traces (an upload), which knows just the tokens a run committed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.trace import Step, Trace

TokenText = Callable[[int], str]

# Whitespace would vanish in hover boxes and node labels; these stand in for it.
_VISIBLE = str.maketrans({" ": "·", "\n": "⏎", "\t": "⇥", "\r": "␍"})


def visible(text: str) -> str:
    """Text with spaces and line breaks drawn as glyphs, other invisible characters
    escaped (``\\x80``); an empty piece shows as ∅."""
    if not text:
        return "∅"
    text = text.translate(_VISIBLE)
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)


def shown(token_text: TokenText, token: int) -> str:
    return visible(token_text(token))


def pieces_token_text(traces: Iterable[Trace]) -> TokenText:
    """Token text from what the traces committed; ``#<id>`` for ids never committed.

    A committed piece can hold more than its token (the decoder keeps multi-byte
    characters whole), which is the best a trace alone can say.
    """
    known: dict[int, str] = {}
    for trace in traces:
        known.setdefault(trace.prefill.first_token, trace.prefill.first_text)
        for step in trace.steps:
            for token, piece in zip(step.committed_ids, step.committed_text):
                known.setdefault(token, piece)
    return lambda token: known.get(token, f"#{token}")


def committed_origins(step: Step) -> list[str]:
    """For each committed token of a step: ``"draft"`` (an accepted draft token) or
    ``"target"`` (the bonus, the target's own token). The commit may be cut short by a
    stop token or the length limit, in which case the bonus never made it in."""
    drafted = len(step.accepted) - 1
    return ["draft" if i < drafted else "target" for i in range(len(step.committed_ids))]
