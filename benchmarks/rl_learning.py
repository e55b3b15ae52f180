"""How fast GRPO learns: the recipe (``conf/comparison_grpo.yaml``, 2 ranks) against a plain loop on one process,
on the job's task, over seeds; the figure is steps to a held-out reward of 0.6 (the first evaluation at or above).

The plain loop is what a user writes from the papers: one process, fp32, HF ``generate`` (sampling, temperature 1),
the same warm start, the same prompts each step (the union of the recipe's ranks' prompts: the recipe's stream), the
same group, GRPO loss (on-policy: its ratio is 1, its gradient the policy gradient), AdamW with the recipe's betas,
weight decay and clipping, the same learning-rate schedule; greedy completions of the same held-out prompts every
``--every`` steps. Its sampler is not the recipe's in one respect: ``generate`` runs with ``min_new_tokens`` equal to
the completion length, so a row never ends on the tokenizer's EOS id (each completion is cut after its first
end-of-turn marker instead), where the recipe's sampler ends a row at either.

    python -m benchmarks.rl --learning                     # 5 seeds each; about 2 hours on 2 CPU cores
    python -m benchmarks.rl --learning --seeds 1234 --horizon 10 --every 2

Needs the warm start's export (``--warm-start``; ``conf/comparison_warm_start.yaml`` writes it). Figures, never
asserted."""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from lightning_mixedfsdp.recipes.objectives.objective import lr_factor
from lightning_mixedfsdp.recipes.rl.losses import LossSettings, grpo_loss
from lightning_mixedfsdp.recipes.rl.rollouts import Rollout, completion_log_probs

RECIPE = "conf/comparison_grpo.yaml"
TARGET = 0.6


class Task:
    """The recipe's prompts, split and ordered as the recipe reads them, and its reward."""

    def __init__(self, recipe: Any) -> None:
        from lightning_mixedfsdp.recipes.data.prompts import read_prompts
        from lightning_mixedfsdp.recipes.data.sft import ExampleMaker
        from lightning_mixedfsdp.recipes.data.text import StreamOrder, make_tokenizer

        data = recipe.data
        self.maker = ExampleMaker(data, "prompts", make_tokenizer(data.tokenizer, data.trust_remote_code))
        splits = read_prompts(data, self.maker, ("answer",))
        self.train, self.held_out = splits.train, splits.held_out[: data.val_windows]
        self.order = StreamOrder(len(self.train), recipe.trainer.seed)
        self.per_step = recipe.rl.prompts_per_step * recipe.trainer.devices

    def prompts_at(self, step: int) -> List[Any]:
        """Every rank's prompts of ``step``, rank 0's first (the recipe's stream: ``StreamSampler``)."""
        first = step * self.per_step
        return [self.train[self.order(position)] for position in range(first, first + self.per_step)]

    def rewards(self, prompts: List[Any], completions: List[List[int]]) -> torch.Tensor:
        from lightning_mixedfsdp.recipes.data.chat import cut_at_end_of_turn
        from lightning_mixedfsdp.recipes.rl.rewards import exact_match

        texts = [cut_at_end_of_turn(self.maker.decode(ids, skip_special_tokens=True)) for ids in completions]
        return torch.tensor(exact_match([p.text for p in prompts], texts, [p.record for p in prompts]))


def hf_rollout(model: nn.Module, prompts: List[List[int]], end: List[int], new: int, greedy: bool) -> Rollout:
    """Completions by HF ``generate`` (left-padded, ``new`` tokens), each cut after its first end marker."""
    length = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt) :], mask[row, length - len(prompt) :] = torch.tensor(prompt), 1
    with torch.no_grad():
        out = model.generate(  # type: ignore[operator]
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=not greedy,
            temperature=1.0 if not greedy else None, top_p=None, top_k=None, pad_token_id=0,
        )  # fmt: skip
    completion = torch.zeros_like(out)
    for row in range(out.shape[0]):
        tokens = out[row, length:].tolist()
        cut = next((i + len(end) for i in range(len(tokens)) if tokens[i : i + len(end)] == end), len(tokens))
        completion[row, length : length + cut] = 1
    attention = torch.cat([mask, completion[:, length:]], 1)
    return Rollout(out * attention, attention, completion, torch.zeros(out.shape, dtype=torch.float32), length)


def plain_update(
    model: nn.Module, optimizer: torch.optim.Optimizer, rollout: Rollout, rewards: torch.Tensor, group: int,
    new: int, clip_norm: float, vocab: Optional[int] = None,
) -> float:  # fmt: skip
    """One GRPO step on ``rollout``, on-policy: the loss, its backward, the clip, AdamW's step (``vocab``: the
    tokenizer's ids, when the model's embedding is wider). The loss."""
    log_probs = completion_log_probs(model, rollout, 1.0, vocab)
    loss = grpo_loss(log_probs, log_probs.detach(), rollout.completion_mask, rewards,
                     LossSettings("grpo", group, 0.2, 0.2, new)).loss  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
    optimizer.step()
    return float(loss.detach())


def held_out_reward(model: nn.Module, task: Task, new: int) -> float:
    prompts = task.held_out
    rollout = hf_rollout(model, [p.ids for p in prompts], task.maker.end, new, greedy=True)
    completions = [row[rollout.prompt_len :][mask[rollout.prompt_len :].bool()].tolist()
                   for row, mask in zip(rollout.input_ids, rollout.completion_mask, strict=True)]  # fmt: skip
    return float(task.rewards(prompts, completions).mean())


def plain_loop(recipe: Any, steps: int, every: int) -> Dict[int, float]:
    """The plain loop's held-out reward at step 0 and every ``every`` steps."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(recipe.trainer.seed)
    model = AutoModelForCausalLM.from_pretrained(recipe.model.pretrained, torch_dtype=torch.float32)
    task, rl, optim = Task(recipe), recipe.rl, recipe.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                  weight_decay=optim.weight_decay)  # fmt: skip
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(optim.schedule, s, optim.warmup_steps, steps)
    )
    rewards = {0: held_out_reward(model, task, rl.max_new_tokens)}
    for step in range(steps):
        prompts = [p for p in task.prompts_at(step) for _ in range(rl.group_size)]
        rollout = hf_rollout(model, [p.ids for p in prompts], task.maker.end, rl.max_new_tokens, greedy=False)
        completions = [row[rollout.prompt_len :][mask[rollout.prompt_len :].bool()].tolist()
                       for row, mask in zip(rollout.input_ids, rollout.completion_mask, strict=True)]  # fmt: skip
        scores = task.rewards(prompts, completions)
        plain_update(model, optimizer, rollout, scores, rl.group_size, rl.max_new_tokens,
                     recipe.trainer.gradient_clip_val)  # fmt: skip
        schedule.step()
        if (step + 1) % every == 0:
            rewards[step + 1] = held_out_reward(model, task, rl.max_new_tokens)
            print(f"plain loop seed {recipe.trainer.seed} step {step + 1}: {rewards[step + 1]:.3f}", flush=True)
    return rewards


def recipe_run(overrides: List[str], folder: Path) -> Dict[int, float]:
    """The recipe through its command line; the held-out reward at step 0 and at each evaluation."""
    from lightning_mixedfsdp.recipes.run.plot import read_metrics

    command = [sys.executable, "-m", "lightning_mixedfsdp.train", "--config", RECIPE, *overrides,
               f"output.dir={folder}"]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = read_metrics(folder / "logs")
    rewards = {0: metrics["untrained_reward"][0]}
    rewards.update({step + 1: value for step, value in metrics["val_reward"].items()})  # logged 0-based
    return rewards


def steps_to(rewards: Dict[int, float], target: float) -> Optional[int]:
    return next((step for step in sorted(rewards) if rewards[step] >= target), None)


def summary(name: str, reached: Sequence[Optional[int]], steps: int) -> str:
    done = [s for s in reached if s is not None]
    stalled = len(reached) - len(done)
    median = statistics.median([s if s is not None else steps + 1 for s in reached])
    shown = ", ".join(str(s) if s is not None else f">{steps}" for s in reached)
    spread = f"{min(done)}-{max(done)}" if done else "none"
    return f"| {name} | {shown} | {median:g} | {spread} | {stalled} of {len(reached)} |"


def learning(args: argparse.Namespace) -> Dict[str, Any]:
    from lightning_mixedfsdp.recipes.run.loader import load_recipe

    results: Dict[str, Dict[int, Dict[int, float]]] = {"recipe": {}, "plain loop": {}}
    folder = Path(args.out)
    for seed in args.seeds:
        overrides = [
            f"trainer.seed={seed}", f"trainer.max_steps={args.horizon}", f"trainer.val_check_interval={args.every}",
            f"model.pretrained={args.warm_start}", *args.overrides,
        ]  # fmt: skip
        results["recipe"][seed] = recipe_run(overrides, folder / f"recipe_{seed}")
        recipe = load_recipe(RECIPE, overrides, launching=False)
        results["plain loop"][seed] = plain_loop(recipe, args.horizon, args.every)
        for name in results:
            curve = " ".join(f"{results[name][seed][s]:.2f}" for s in sorted(results[name][seed]))
            print(f"{name}, seed {seed}: {curve}", flush=True)
    print(f"steps to a held-out reward of {TARGET} (evaluated every {args.every} steps; >{args.horizon}: not reached)")
    print("| loop | per seed " + " ".join(map(str, args.seeds)) + " | median | range | stalled |")
    print("|---|---|---|---|---|")
    for name in results:
        reached = [steps_to(results[name][seed], TARGET) for seed in args.seeds]
        print(summary(name, reached, args.horizon))
    (folder / "learning.json").write_text(json.dumps(results))
    return results


def learning_parser(arguments: argparse.ArgumentParser) -> None:
    arguments.add_argument("--seeds", type=int, nargs="+", default=[1234, 99, 7, 5, 11])
    arguments.add_argument("--horizon", type=int, default=40, help="optimizer steps of each run")
    arguments.add_argument("--every", type=int, default=2, help="steps between held-out evaluations")
    arguments.add_argument("--warm-start", default="runs/comparison_warm_start/export")
    arguments.add_argument("--out", default="runs/rl_learning")
    arguments.add_argument("--overrides", nargs="*", default=[], help="recipe overrides for both loops")
