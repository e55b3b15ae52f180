"""A small chat dataset made from what every machine with Python has: questions about standard-library functions,
answered by the first line of their docstrings (``What does `math.fabs` do?`` -> ``Return the absolute value of the
float x.``). Some conversations carry a system turn, some a second question about another function of the same
module. The same Python gives the same conversations, in the same order."""

import importlib
import inspect
import random
from typing import Dict, Iterator, List, Tuple

MODULES = (
    "base64", "binascii", "bisect", "calendar", "codecs", "collections", "colorsys", "copy", "csv", "datetime",
    "decimal", "difflib", "fnmatch", "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "io", "ipaddress", "itertools", "json", "keyword", "math", "operator", "os.path", "pathlib", "platform", "pprint",
    "random", "re", "secrets", "shlex", "shutil", "statistics", "string", "struct", "tempfile", "textwrap", "time",
    "unicodedata", "urllib.parse", "uuid", "warnings", "zlib",
)  # fmt: skip

QUESTIONS = (
    "What does `{name}` do?",
    "In one sentence, what is `{name}` for?",
    "Explain `{name}` briefly.",
    "What is `{name}`?",
)
FOLLOW_UPS = ("And `{name}`?", "What about `{name}`?")
SYSTEM = "Answer in one sentence."

Message = Dict[str, str]


def documented_functions() -> List[Tuple[str, str]]:
    """``(module.function, first docstring line)`` for the public functions of :data:`MODULES` whose first line is a
    sentence of 15 to 90 characters."""
    found = []
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for attribute in sorted(dir(module)):
            function = getattr(module, attribute)
            if attribute.startswith("_") or not (inspect.isfunction(function) or inspect.isbuiltin(function)):
                continue
            doc = inspect.getdoc(function)
            first = doc.strip().splitlines()[0].strip() if doc else ""
            if 15 <= len(first) <= 90 and not first.startswith(attribute + "("):  # not a signature line
                found.append((f"{module_name}.{attribute}", first if first.endswith(".") else first + "."))
    return found


def stdlib_conversations(seed: int = 0) -> Iterator[List[Message]]:
    """One conversation per documented function, in a seeded order: every 4th with a system turn, every 3rd with a
    second question about the next function of the same module."""
    functions = documented_functions()
    generator = random.Random(seed)
    generator.shuffle(functions)
    by_module: Dict[str, List[Tuple[str, str]]] = {}
    for name, answer in functions:
        by_module.setdefault(name.rsplit(".", 1)[0], []).append((name, answer))
    for index, (name, answer) in enumerate(functions):
        messages: List[Message] = [{"role": "system", "content": SYSTEM}] if index % 4 == 0 else []
        messages += [
            {"role": "user", "content": QUESTIONS[index % len(QUESTIONS)].format(name=name)},
            {"role": "assistant", "content": answer},
        ]
        siblings = by_module[name.rsplit(".", 1)[0]]
        if index % 3 == 0 and len(siblings) > 1:
            other, other_answer = siblings[(siblings.index((name, answer)) + 1) % len(siblings)]
            messages += [
                {"role": "user", "content": FOLLOW_UPS[index % len(FOLLOW_UPS)].format(name=other)},
                {"role": "assistant", "content": other_answer},
            ]
        yield messages


def stdlib_preference_pairs(seed: int = 0) -> Iterator[Dict[str, List[Message]]]:
    """One conversational preference pair per documented function with an answer of two words or more, in a seeded
    order: the question, the chosen answer its docstring's first line, the rejected one the same words in reverse
    order (the same bytes, out of order: what the pair teaches is well-formed answers, which carries to functions
    never seen; a rejected answer taken from another function would be some other pair's chosen one)."""
    functions = documented_functions()
    random.Random(seed).shuffle(functions)
    for index, (name, answer) in enumerate(functions):
        other = " ".join(reversed(answer.split()))
        if other == answer:
            continue
        yield {
            "prompt": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)].format(name=name)}],
            "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": other}],
        }
