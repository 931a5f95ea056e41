"""User turns from a prompt set that a package on the Python package index ships as data files.

``chatterbot-corpus``: the dialog corpus of the ChatterBot chatbot, contributed by its users and
collected by Gunther Cox; BSD-3-Clause (``license.md`` of its source distribution: use and
redistribution, modified or not, are permitted if the copyright notice, the conditions and the
disclaimer go along). A corpus made with it holds these turns (``prompts.jsonl``, the shards' token
ids), so one passed on carries the notice "Copyright (c) 2017, Gunther Cox. All rights reserved." and
the licence. Its English YAML files hold short conversations by topic: trivia questions, coding
requests ("can you write a binary search in Go?"), computer trouble, small talk, questions about the
bot itself. The first line of each conversation is what a person said; the lines after it are the
bot's alternative answers, not user turns, so only the first is read. It is no evaluation set; the
overlap filter still removes anything near the evaluation prompts.

The project's requirements leave it out: install it where the data stage runs (``pip install
chatterbot-corpus``). The GPU machine reaches no index: stage its wheel (``pip download --no-deps
chatterbot-corpus``) and unpack it into ``$SITE`` (``python3 -m zipfile -e
/tmp/stage/chatterbot_corpus-*.whl /tmp/site``) before the data stage. Reading it needs PyYAML, which
transformers depends on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "chatterbot_corpus"
MIN_WORDS = 3  # shorter first turns are greetings and bare topic words ("Hi", "stock market"), not requests


def chatterbot_folder() -> Path:
    """The installed package's English conversations; a SystemExit says how to install it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise SystemExit(f"--chatterbot-fraction needs the {PACKAGE} package: pip install chatterbot-corpus "
                         "(on the GPU machine, unpack its staged wheel into $SITE)")
    return Path(spec.origin).parent / "data" / "english"


def chatterbot_requests(folder: Path | None = None) -> list[str]:
    """The first turn of every conversation in ``folder``'s YAML files (default: the installed package's
    English ones), in file order, each text once. Turns in capitals go: they are questions cut short
    ("EACH YEAR IN PRO BASEBALL THE")."""
    import yaml  # only this reader needs it

    folder = folder or chatterbot_folder()
    texts, seen = [], set()
    for path in sorted(folder.glob("*.yml")):
        for conversation in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []:
            text = conversation[0].strip() if conversation and isinstance(conversation[0], str) else ""
            if len(text.split()) >= MIN_WORDS and not text.isupper() and text not in seen:
                seen.add(text)
                texts.append(text)
    if not texts:
        raise SystemExit(f"no conversations in {folder}")
    return texts
