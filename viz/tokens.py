"""Token text for display, kept apart from any tokenizer.

Figure builders take a ``TokenText`` (token id -> raw text) so they stay pure: the
app passes ``traces_token_text``, which reads the texts a trace carries
(``Trace.token_texts``), then the loaded model's tokenizer where the traces are its
own, then the pieces the runs committed (an older trace, uploaded to a page
without its model), and shows ``#<id>`` for what none of them knows.
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


def traces_token_text(traces: Iterable[Trace], tokenizer: TokenText | None = None) -> TokenText:
    """The texts the traces carry, else ``tokenizer``'s, else the committed pieces (``pieces_token_text``)."""
    traces = list(traces)
    carried = {token: text for trace in traces for token, text in trace.token_texts.items()}
    fallback = tokenizer or pieces_token_text(traces)
    return lambda token: carried[token] if token in carried else fallback(token)


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
