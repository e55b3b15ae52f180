"""A verifiable task made on the machine: which of two different digits is the larger, each pair asked in five
phrasings. The answer is one of the two numbers in the prompt, so a policy that has learnt the answer's form is
right about half the time by copying one; reinforcement learning has to teach it which.
Written as two ``.jsonl`` files, in the order the recipes read them:

- ``comparison_prompts.jsonl``: ``{"prompt": [user turn], "answer": "max(a, b)"}`` per line, a pair's phrasings
  together, so ``data.held_out_every: 5`` holds the first phrasing of every pair out: the held-out reward asks the
  pairs the policy trains on in a phrasing it never sees;
- ``comparison_warm_start.jsonl``: ``{"messages": [user, assistant]}``, the training phrasings answered, for a short
  fine-tuning that gives the policy the answer's form and some right answers before reinforcement learning.

``python -m lightning_mixedfsdp.recipes.data.comparison <folder>`` writes both."""

import json
import sys
from pathlib import Path
from typing import Dict, Iterator, List

PHRASINGS = (
    "Which is larger, {a} or {b}?",
    "Pick the bigger number: {a}, {b}.",
    "Of {a} and {b}, which is greater?",
    "What is max({a}, {b})?",
    "Name the larger of {a} and {b}.",
)
DIGITS = 9
HELD_OUT_EVERY = len(PHRASINGS)
"""The recipe's ``data.held_out_every``: the first phrasing of each pair is held out."""


def comparison_prompts() -> Iterator[Dict[str, object]]:
    for a in range(1, DIGITS + 1):
        for b in range(1, DIGITS + 1):
            if a != b:
                for phrasing in PHRASINGS:
                    yield {"prompt": [{"role": "user", "content": phrasing.format(a=a, b=b)}], "answer": str(max(a, b))}


def warm_start_conversations() -> Iterator[Dict[str, List[Dict[str, str]]]]:
    """The training phrasings (not the held-out one), answered."""
    for index, record in enumerate(comparison_prompts()):
        if index % HELD_OUT_EVERY:
            prompt = record["prompt"]
            assert isinstance(prompt, list)
            yield {"messages": [*prompt, {"role": "assistant", "content": str(record["answer"])}]}


def write_task(folder: Path) -> List[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, records in (
        ("comparison_prompts.jsonl", comparison_prompts()),
        ("comparison_warm_start.jsonl", warm_start_conversations()),
    ):
        path = folder / name
        path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write_task(Path(sys.argv[1] if len(sys.argv) > 1 else "conf/data")):
        print(path)
