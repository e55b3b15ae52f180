"""Verifiable rewards: ``rl.reward`` names a function, or a list of ``{function, weight}`` whose weighted sum is the
reward. A function is ``exact_match`` (built in), ``path/to/file.py:function`` or ``package.module:function``, called
as ``function(prompts, completions, records) -> list[float]``: the rendered prompts, the decoded completions (their
end marker left out) and the prompts' ``.jsonl`` records (every field, ``answer`` included), one entry per
completion. Each is logged by its name."""

import importlib
import importlib.util
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from lightning_mixedfsdp.recipes.data.chat import cut_at_end_of_turn
from lightning_mixedfsdp.recipes.rl.rollouts import completions_text

if TYPE_CHECKING:
    from lightning_mixedfsdp.recipes.data.prompts import Prompt
    from lightning_mixedfsdp.recipes.data.sft import ExampleMaker
    from lightning_mixedfsdp.recipes.rl.rollouts import Rollout  # noqa: F401  # (imported above at run time too)

RewardFunction = Callable[[List[str], List[str], List[Dict[str, Any]]], Sequence[float]]
EXACT_MATCH = "exact_match"
_LAST_ANSWER = re.compile(r"[-+]?\d+(?:\.\d+)?|\w+")


def last_answer(completion: str) -> Optional[str]:
    """The completion's last number or word."""
    found = _LAST_ANSWER.findall(completion)
    return found[-1] if found else None


def exact_match(prompts: List[str], completions: List[str], records: List[Dict[str, Any]]) -> List[float]:
    """1.0 where the record's ``answer`` equals the completion's last word or number, case-folded; else 0.0."""
    scores = []
    for completion, record in zip(completions, records, strict=True):
        answer = last_answer(completion)
        scores.append(float(answer is not None and answer.casefold() == str(record["answer"]).strip().casefold()))
    return scores


@dataclass(frozen=True)
class Reward:
    name: str
    """As logged (``train_reward_<name>``): the function's name."""
    function: RewardFunction
    weight: float


def reward_specs(setting: Any) -> List[Tuple[str, float]]:
    """``rl.reward`` as ``(function, weight)`` pairs: a string is one of weight 1."""
    if isinstance(setting, str):
        return [(setting, 1.0)]
    specs = []
    for item in setting or []:
        if isinstance(item, Mapping):
            specs.append((str(item.get("function", "")), float(item.get("weight", 1.0))))
        else:
            specs.append((str(item), 1.0))
    return specs


def load_function(spec: str) -> RewardFunction:
    """The function ``spec`` names; :class:`ValueError` with the fix when it cannot be loaded or does not take
    three arguments."""
    if spec == EXACT_MATCH:
        return exact_match
    if ":" not in spec:
        raise ValueError(
            f"rl.reward {spec!r} is neither 'exact_match' nor 'path/to/file.py:function' nor 'package.module:function'"
        )
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"rl.reward {spec!r}: {where} does not exist; give the path of the file (from here)")
        module_spec = importlib.util.spec_from_file_location(f"rl_reward_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as error:
            raise ValueError(
                f"rl.reward {spec!r}: {where} fails to import ({type(error).__name__}: {error})"
            ) from error
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(
                f"rl.reward {spec!r}: cannot import {where!r} ({error}); install it or fix the name"
            ) from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"rl.reward {spec!r}: {where} has no function {name!r}")
    try:
        inspect.signature(function).bind([], [], [])
    except TypeError as error:
        raise ValueError(
            f"rl.reward {spec!r}: {name} must take three arguments (prompts, completions, records), and {error}"
        ) from error
    except ValueError:  # a builtin without a signature: called as it is
        pass
    return function


def function_name(spec: str) -> str:
    return spec.rsplit(":", 1)[-1]


def load_rewards(setting: Any) -> List[Reward]:
    """Every reward ``rl.reward`` names (checked before launch by :func:`reward_problems`)."""
    return [Reward(function_name(spec), load_function(spec), weight) for spec, weight in reward_specs(setting)]


def reward_problems(setting: Any) -> List[str]:
    """What is wrong with ``rl.reward``, all at once."""
    specs = reward_specs(setting)
    if not specs:
        return ["rl.reward is empty: set it to exact_match, a function ('path/to/file.py:function'), or a list"]
    problems = []
    for spec, weight in specs:
        try:
            load_function(spec)
        except ValueError as error:
            problems.append(str(error))
        if not math.isfinite(weight):
            problems.append(f"rl.reward {spec!r}: weight={weight} must be a finite number")
    names = [function_name(spec) for spec, _ in specs]
    if len(set(names)) != len(names):
        problems.append(f"rl.reward names a function twice ({names}): each is logged by its name; list it once")
    return problems


def scored(
    rewards: Sequence[Reward], prompts: List[str], completions: List[str], records: List[Dict[str, Any]]
) -> Tuple[List[float], Dict[str, List[float]]]:
    """The weighted sum per completion and each reward's own scores; :class:`ValueError` for a function that does
    not return one finite number per completion."""
    total = [0.0] * len(completions)
    each: Dict[str, List[float]] = {}
    for reward in rewards:
        values = [float(v) for v in reward.function(prompts, completions, records)]
        if len(values) != len(completions) or not all(math.isfinite(v) for v in values):
            raise ValueError(
                f"reward {reward.name!r} returned {len(values)} values for {len(completions)} completions"
                f" ({values[:4]}...): it must return one finite float per completion"
            )
        each[reward.name] = values
        total = [t + reward.weight * v for t, v in zip(total, values, strict=True)]
    return total, each


def scored_on_every_rank(
    rewards: Sequence[Reward],
    prompts: List[str],
    completions: List[str],
    records: List[Dict[str, Any]],
    device: Any = "cpu",
) -> Tuple[List[float], Dict[str, float]]:
    """:func:`scored` on this rank's completions, and each reward's mean. A reward that raises on one rank raises on
    every rank (the others would wait in the next collective): a flag is all-reduced after scoring, on ``device``
    (NCCL reduces device tensors only)."""
    import torch
    import torch.distributed as dist

    failure: Optional[Exception] = None
    total: List[float] = [0.0] * len(completions)
    each: Dict[str, List[float]] = {}
    try:
        total, each = scored(rewards, prompts, completions, records)
    except Exception as error:  # raised below, on every rank
        failure = error
    if dist.is_available() and dist.is_initialized():
        failed = torch.tensor([failure is not None], dtype=torch.int32, device=device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failure is None and failed.item():
            raise RuntimeError("rl.reward failed on another rank (its error is in that rank's log)")
    if failure is not None:
        raise failure
    return total, {name: sum(values) / len(values) for name, values in each.items()}


def score_completions(
    rewards: List[Reward], maker: "ExampleMaker", prompts: List["Prompt"], rollout: "Rollout"
) -> Tuple[List[float], Dict[str, float]]:
    """The rewards of ``rollout``'s completions, decoded with their end marker cut, on every rank."""
    texts = completions_text(rollout, lambda ids: cut_at_end_of_turn(maker.decode(ids, skip_special_tokens=True)))
    records, device = [p.record for p in prompts], rollout.input_ids.device
    return scored_on_every_rank(rewards, [p.text for p in prompts], texts, records, device)
