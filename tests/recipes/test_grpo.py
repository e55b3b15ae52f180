"""Reinforcement learning with verifiable rewards (``objective: grpo``) and the fp32-compute head it trains with.

One launch of 2 ranks runs: each ``rl.loss``'s loss and grads on given rollouts (tokens, generator log-probs, rewards)
on a sharded HF Llama, against the formula written out here on one process over the union of the ranks' rollouts;
decoding on ranks whose completions end at different lengths (gathered and sharded generation), against the unsharded
model's greedy tokens, followed by a training step; ``dtypes.fp32_compute_modules`` on an untied and a tied head under
bf16-true (the logits an fp32 matmul of the bf16 weight, the storage bf16 and sharded, a tied embedding's lookup
bf16); the generator-trainer mismatch with the head in bf16 and in fp32; DAPO with a masking correction against one
process; and the recipe through the runner: a straight run, and a run stopped at step 2 and resumed, whose losses
repeat the straight run's; a bf16 Mamba checkpoint under 32-true (trained in fp32, sampling what the trainer scores:
a masking correction of bounds 1 +- 1e-5 keeps every token), and with a broken state cache (every rank refuses the
first rollout). Each refusal runs here, before any launch."""

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mixedfsdp.recipes.rl.losses import LOSSES, LossSettings, grpo_loss
from lightning_mixedfsdp.recipes.rl.rewards import exact_match, last_answer
from lightning_mixedfsdp.recipes.rl.rollouts import Rollout, completion_log_probs, positions_of
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.settings.schema import RecipeError
from tests.conftest import Launch
from tests.recipes.exports import assert_the_export_states_its_dtype
from tests.recipes.grpo_formula import written_advantages
from tests.recipes.second_model import TEACHER_VOCAB, make_llama_folder
from tests.scenarios import full_grads, make_fabric

pytestmark = pytest.mark.compat  # a private torch or transformers API: .ci/compat runs it on both ends

WORLD = 2
GROUP, PROMPTS_PER_RANK, LENGTH, PROMPT_LEN, MAX_NEW = 4, 2, 12, 5, 7
CLIP, CLIP_HIGH = 0.2, 0.28
CASES: Tuple[Tuple[str, float], ...] = (*((kind, 0.0) for kind in LOSSES), ("grpo", 0.1))
"""Each ``rl.loss``, and GRPO with a KL to a reference (``beta`` 0.1)."""


def _llama(vocab: int = 96, tie: bool = False, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _rollouts() -> Dict[str, torch.Tensor]:
    """Both ranks' rollouts, rank 0's rows first: left-padded prompts, completions of different lengths, generator
    log-probs off the policy's (ratios away from 1, some clipped), a reference's, 0/1 rewards."""
    generator = torch.Generator().manual_seed(7)
    rows = WORLD * PROMPTS_PER_RANK * GROUP
    ids = torch.randint(3, 96, (rows, LENGTH), generator=generator)
    mask = torch.ones(rows, LENGTH, dtype=torch.long)
    completion = torch.zeros(rows, LENGTH, dtype=torch.long)
    for row in range(rows):
        padding = row % 3
        mask[row, :padding] = 0
        ids[row, :padding] = 0
        new = 1 + (row * 5) % MAX_NEW  # 1 to 7 completion tokens, then padding
        completion[row, PROMPT_LEN : PROMPT_LEN + new] = 1
        mask[row, PROMPT_LEN + new :] = 0
    noise = (torch.rand(rows, LENGTH, generator=generator) - 0.5) * 0.8
    rewards = torch.randint(0, 2, (rows,), generator=generator).float()
    rewards[:GROUP] = 0.0  # a group all wrong: no advantage
    return {"ids": ids, "mask": mask, "completion": completion, "noise": noise, "rewards": rewards}


def _rank_rows(rank: int) -> slice:
    per_rank = PROMPTS_PER_RANK * GROUP
    return slice(rank * per_rank, (rank + 1) * per_rank)


def _rollout(data: Dict[str, torch.Tensor], rows: slice, old: torch.Tensor) -> Rollout:
    return Rollout(data["ids"][rows], data["mask"][rows], data["completion"][rows], old, PROMPT_LEN)


def _old_and_reference(model: nn.Module, data: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """The generator's log-probs (the policy's plus noise) and a reference's (the policy's minus the noise) of every
    row, from the unsharded model."""
    with torch.no_grad():
        exact = completion_log_probs(model, _rollout(data, slice(None), torch.zeros(1)), 1.0)
    on = data["completion"].bool()
    return torch.where(on, exact + data["noise"], 0 * exact), torch.where(on, exact - data["noise"], 0 * exact)


def formula(
    log_probs: torch.Tensor, old: torch.Tensor, reference: torch.Tensor, completion: torch.Tensor,
    rewards: torch.Tensor, kind: str, beta: float,
) -> torch.Tensor:  # fmt: skip
    """GRPO's loss written out token by token: group-normalised advantages, PPO's clipped surrogate, k3 KL; per
    completion then per batch (grpo), over completions x max_new_tokens (dr_grpo), or over every token (dapo)."""
    rows = log_probs.shape[0]
    per_row: List[torch.Tensor] = []
    token_terms: List[torch.Tensor] = []
    for row, advantage in enumerate(written_advantages(rewards, GROUP, scaled=kind != "dr_grpo")):
        terms = []
        for t in range(LENGTH):
            if completion[row, t]:
                ratio = torch.exp(log_probs[row, t] - old[row, t])
                clipped = ratio.clamp(1 - CLIP, 1 + CLIP_HIGH)
                term = -torch.minimum(ratio * advantage, clipped * advantage)
                gap = reference[row, t] - log_probs[row, t]
                terms.append(term + beta * (torch.exp(gap) - gap - 1))
        token_terms += terms
        per_row.append(torch.stack(terms).sum() / len(terms))
    if kind == "grpo":
        return torch.stack(per_row).mean()
    if kind == "dr_grpo":
        return torch.stack(token_terms).sum() / (rows * MAX_NEW)
    return torch.stack(token_terms).sum() / len(token_terms)


# -- what each rank runs


def _losses_on_given_rollouts(rank: int) -> Dict[str, Any]:
    import torch.distributed as dist

    data = _rollouts()
    old, reference = _old_and_reference(_llama(), data)
    fabric = make_fabric(WORLD)
    model = fabric.setup_module(_llama())
    out: Dict[str, Any] = {}
    rows = _rank_rows(rank)
    for kind, beta in CASES:
        rollout = _rollout(data, rows, old[rows])
        log_probs = completion_log_probs(model, rollout, 1.0)
        tokens = rollout.completion_mask.sum().float()
        dist.all_reduce(tokens)
        parts = grpo_loss(
            log_probs, rollout.generator_log_probs, rollout.completion_mask, data["rewards"][rows],
            LossSettings(kind, GROUP, CLIP, CLIP_HIGH, MAX_NEW, beta), reference[rows],
            tokens if kind == "dapo" else None, WORLD,
        )  # fmt: skip
        fabric.backward(parts.loss)
        out[f"{kind} {beta}"] = {"grads": full_grads(model), "clip_fraction": parts.clip_fraction.item()}
        model.zero_grad(set_to_none=True)
    rollout = _rollout(data, rows, old[rows])
    kept = _masked_dapo(completion_log_probs(model, rollout, 1.0), old[rows], rollout.completion_mask,
                        data["rewards"][rows])  # fmt: skip
    out["mis dapo"] = {"grads": full_grads(model), "kept": kept}
    return out


MIS = (0.8, 1.25)
"""Bounds that reject some of ``_rollouts``' tokens (the generator's log-probs are the policy's plus up to 0.4)."""


def _masked_dapo(log_probs: torch.Tensor, generated: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor) -> float:
    """DAPO's loss with ``rl.correction=mis`` (pi_old: the first forward's, detached), its backward; the kept tokens
    of every rank (the denominator), all-reduced when launched."""
    import torch.distributed as dist

    from lightning_mixedfsdp.recipes.rl.corrections import correction_of, importance_weights

    weights = importance_weights(log_probs.detach(), generated, mask, correction_of("mis", "token", MIS))
    tokens, ranks = weights.kept.sum(), 1
    if dist.is_initialized():
        dist.all_reduce(tokens)
        ranks = dist.get_world_size()
    settings = LossSettings("dapo", GROUP, CLIP, CLIP_HIGH, MAX_NEW)
    loss = grpo_loss(log_probs, log_probs.detach(), weights.kept, rewards, settings, None, tokens, ranks,
                     weights.weights).loss  # fmt: skip
    loss.backward()
    return float(tokens)


def _greedy_prompts(model: nn.Module, end_after: int) -> Tuple[List[List[int]], int]:
    """Two prompts and an end token such that greedy decoding ends the first at its first token and never the
    second (within ``end_after`` tokens), found on the unsharded model."""
    from lightning_mixedfsdp.recipes.rl.rollouts import Sampling, sample

    candidates = [[5 + i, 17, 30 + 2 * i, 9] for i in range(12)]
    first = sample(model, candidates[:1], Sampling(1, 0.0), [], 0)
    end = int(first.input_ids[0, -1])
    for prompt in candidates[1:]:
        other = sample(model, [prompt], Sampling(end_after, 0.0), [], 0)
        if end not in other.input_ids[0, len(prompt) :].tolist():
            return [candidates[0], prompt], end
    raise AssertionError("no prompt decodes without the end token")


def _different_lengths(rank: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from lightning_mixedfsdp.apply.gathered import gathered_params
    from lightning_mixedfsdp.recipes.rl.rollouts import Sampling, sample

    plain = _llama(seed=1)
    prompts, end = _greedy_prompts(plain, MAX_NEW)
    expected = sample(plain, [prompts[rank]], Sampling(MAX_NEW, 0.0), [end], 0)
    fabric = make_fabric(WORLD)
    model = fabric.setup_module(_llama(seed=1))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))

    def all_ended(mine: bool) -> bool:
        flag = torch.tensor([0 if mine else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag) == 0

    out: Dict[str, Any] = {"expected": expected.input_ids}
    with gathered_params(model, model):
        out["gathered"] = sample(model, [prompts[rank]], Sampling(MAX_NEW, 0.0), [end], 0).input_ids
    out["sharded"] = sample(model, [prompts[rank]], Sampling(MAX_NEW, 0.0), [end], 0, None, all_ended).input_ids
    loss = model(input_ids=out["sharded"]).logits.float().mean()  # a step after: the collectives still pair up
    fabric.backward(loss)
    optimizer.step()
    out["stepped"] = True
    return out


def _head_hooks(seen: Dict[str, Any]) -> Tuple[Any, Any]:
    """Forward hooks that record, in ``seen``, the head's gathered weight, input and logits, and the embedding's
    output."""

    def head_hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        weight, hidden = module.weight, inputs[0]
        seen.update(weight_dtype=weight.dtype, input_dtype=hidden.dtype, logits_dtype=output.dtype)
        seen["equal"] = torch.equal(output, F.linear(hidden.float(), weight.float()))

    def embed_hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        seen["embedding_output"] = output.dtype

    return head_hook, embed_hook


def _fp32_head(rank: int) -> Dict[str, Any]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    out: Dict[str, Any] = {}
    for tie in (False, True):
        fabric = make_fabric(WORLD, "bf16-true", strategy=MixedFSDP2Strategy(fp32_compute_modules=["^lm_head$"]))
        model = fabric.setup_module(_llama(tie=tie))
        seen: Dict[str, Any] = {}
        head_hook, embed_hook = _head_hooks(seen)
        inner = model.module
        handles = [
            inner.lm_head.register_forward_hook(head_hook),
            inner.model.embed_tokens.register_forward_hook(embed_hook),
        ]
        logits = model(input_ids=torch.randint(0, 96, (2, 9))).logits
        logits.float().logsumexp(-1).mean().backward()
        for handle in handles:
            handle.remove()
        weight = inner.lm_head.weight
        seen.update(
            storage=weight.dtype, local_rows=weight.to_local().shape[0], rows=weight.shape[0],
            tied=weight is inner.model.embed_tokens.weight, embedding_storage=inner.model.embed_tokens.weight.dtype,
            grad=None if weight.grad is None else weight.grad.dtype, logits=logits.dtype,
        )  # fmt: skip
        out["tied" if tie else "untied"] = seen
    return out


def _peaked_llama(steps: int = 100) -> Dict[str, torch.Tensor]:
    """A tiny Llama (vocab 600) trained until its next-token distributions are peaked, as a policy's are: on a random
    init both heads give the same mismatch (logits near 0 round alike in bf16; measured 1.00x), after 100 steps of
    sequences ``x -> 7x + 13 + noise`` the fp32 head's is 0.38x of the bf16 head's (one process)."""
    torch.manual_seed(0)
    model = _llama(vocab=600, seed=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        tokens = [torch.randint(0, 600, (16, 1), generator=generator)]
        for _ in range(31):
            tokens.append((tokens[-1] * 7 + 13 + torch.randint(0, 3, (16, 1), generator=generator)) % 600)
        ids = torch.cat(tokens, 1)
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    return model.state_dict()


def _mismatch(rank: int) -> Dict[str, float]:
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy
    from lightning_mixedfsdp.recipes.rl.rollouts import Sampling, log_prob_mismatch, sample

    out = {}
    trained = _peaked_llama()
    prompts = [[(7 * p + 3 * rank + i) % 600 for i in range(6)] for p in range(8) for _ in range(4)]
    for name, head in (("bf16", []), ("fp32", ["^lm_head$"])):
        fabric = make_fabric(WORLD, "bf16-true", strategy=MixedFSDP2Strategy(fp32_compute_modules=head))
        policy = _llama(vocab=600, seed=2)
        policy.load_state_dict(trained)
        model = fabric.setup_module(policy)
        generator = torch.Generator().manual_seed(11 + rank)
        rollout = sample(model, prompts, Sampling(24, 1.0), [], 0, generator)
        with torch.no_grad():
            train = completion_log_probs(model, rollout, 1.0)
        out[name] = log_prob_mismatch(train, rollout.generator_log_probs, rollout.completion_mask).item()
    return out


def _runner(
    folder: Path, policy: str, prompts: str, steps: int, output: str, checkpoint: Any = None, extra: Any = ()
) -> Dict[str, List[float]]:
    from lightning_mixedfsdp.recipes.run import runner
    from lightning_mixedfsdp.recipes.run.plot import read_metrics

    recipe_overrides = [*_recipe(policy, prompts, str(folder / output), steps), *extra]
    runner.run(load_recipe(None, recipe_overrides, launching=False), checkpoint)
    metrics = read_metrics(folder / output / "logs")
    return {name: [values[step] for step in sorted(values)] for name, values in metrics.items()}


def _resume(rank: int, folder: str, policy: str, prompts: str) -> Dict[str, Any]:
    """A straight run and one resumed from its step 2, both with a copied reference (``rl.beta``); LoRA with the
    adapters-off reference, activation checkpointing, the precision monitor and stochastic bf16 updates."""
    where = Path(folder)
    kl = ["rl.beta=0.04"]
    straight = _runner(where, policy, prompts, 4, "straight", extra=kl)
    step_2 = where / "straight" / "checkpoints" / "step=2.ckpt"
    resumed = _runner(where, policy, prompts, 4, "resumed", step_2, extra=kl)
    length = f"{Path(prompts).parent / 'length_reward.py'}:length"
    composed = _runner(where, policy, prompts, 3, "composed", extra=[
        f"rl.reward=[exact_match,{{function: '{length}', weight: 0.5}}]", "peft.enabled=true", "rl.beta=0.04",
        "rl.reference=adapters_off", "strategy.activation_checkpointing=full", "monitor.every_n_steps=1",
        "trainer.precision=bf16-true", "strategy.dtypes.bf16_updates=stochastic", "rl.generation=sharded",
        "rl.loss=dapo",
    ])  # fmt: skip
    return {"straight": straight["train_loss"], "resumed": resumed["train_loss"], "composed": composed, "kl": straight}


def _forgetful_step(model: nn.Module, input_ids: torch.Tensor, *_: Any) -> Tuple[torch.Tensor, Any]:
    """A decoding step whose state cache keeps nothing: after the prompt, each token sees only itself (a cache that
    decodes differently from the model's forward, on every transformers version)."""
    return model(input_ids=input_ids[:, -1:]).logits, "a state that holds nothing"


def _mamba(rank: int, folder: str, policy: str, prompts: str) -> Dict[str, Any]:
    """GRPO on an HF Mamba (Mamba-1) under 32-true: its generator decodes without a cache, the trainer's forward, so
    the mismatch is rounding; then the same run with a broken state cache (the generator that samples another
    distribution): the launch's first rollout raises on every rank, naming the class and the value."""
    from lightning_mixedfsdp.recipes.rl import rollouts

    where, fp32 = Path(folder), ["trainer.precision=32-true"]
    exact = [*fp32, "rl.correction=mis", "rl.correction_bounds=[0.99999,1.00001]"]  # mu = pi_old to 1e-5, or masked
    out: Dict[str, Any] = {"exact": _runner(where, policy, prompts, 2, "mamba", extra=exact)}
    decodes_with_cache, cached_step = rollouts.decodes_with_cache, rollouts.cached_step
    rollouts.decodes_with_cache, rollouts.cached_step = (lambda model: True), _forgetful_step  # type: ignore[assignment]
    try:
        _runner(where, policy, prompts, 2, "mamba_cached", extra=fp32)
        out["refused"] = None
    except RuntimeError as error:
        out["refused"] = str(error)
    finally:
        rollouts.decodes_with_cache, rollouts.cached_step = decodes_with_cache, cached_step
    return out


ONE_UPDATE = ["trainer.precision=32-true", "trainer.gradient_clip_val=1.0", "trainer.checkpoint_every_n_steps=0"]


def _one_update(rank: int, folder: str, policy: str, prompts: str) -> Dict[str, Any]:
    """One recipe step under 32-true (AdamW with weight decay, the clip, the schedule) through the runner's own
    Trainer: this rank's rollout, its rewards, and the params after the update."""
    import lightning.pytorch as pl

    from lightning_mixedfsdp.recipes.objectives.registry import objective_class
    from lightning_mixedfsdp.recipes.run import runner
    from lightning_mixedfsdp.recipes.run.checkpoints import RunCheckpoints
    from lightning_mixedfsdp.recipes.run.stopping import StopRequest

    length = f"rl.reward={Path(prompts).parent / 'length_reward.py'}:length"  # rewards that differ: advantages
    overrides = [*_recipe(policy, prompts, str(Path(folder) / "one_update"), 1), *ONE_UPDATE, length]
    recipe = load_recipe(None, overrides, launching=False)
    captured: Dict[str, Any] = {}

    class Capture(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            # after the optimizer's step (Lightning runs the closure, backward and the clip inside it): the grads
            # it applied
            step_hook = lambda *_: captured.update(grads=full_grads(module.model))  # noqa: E731
            trainer.optimizers[0].register_step_post_hook(step_hook)

        def on_train_batch_end(self, trainer: Any, module: Any, *_: Any) -> None:
            rollout = module.rollout
            captured.update(rewards=module.rollout_rewards.cpu(), params=_full_params(module.model))
            captured["rollout"] = {name: getattr(rollout, name).cpu() for name in
                                   ("input_ids", "attention_mask", "completion_mask")}  # fmt: skip
            captured["rollout"]["prompt_len"] = rollout.prompt_len

    trainer = runner.build_trainer(recipe, RunCheckpoints(runner.run_folder(recipe), 0, 1, StopRequest()))
    trainer.callbacks.append(Capture())
    objective = objective_class(recipe)
    trainer.fit(objective.from_recipe(recipe), datamodule=objective.data(recipe))
    return captured


def _full_params(model: nn.Module) -> Dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}  # fmt: skip


def _generator_ranks(rank: int, folder: str, policy: str, prompts: str) -> Dict[str, Any]:
    """The same 32-true run sampled on the trainers (gathered) and on a generator rank; a bf16 run one step stale
    with TIS; each sync verified (the generator's params hashed against what the trainers sent)."""
    where, fp32 = Path(folder), ["trainer.precision=32-true"]
    ranks = ["rl.generation=ranks", "rl.generator_ranks=1", "rl.verify_sync=true", "rl.sync_bucket_mb=0.01"]
    exact = ["rl.correction=mis", "rl.correction_bounds=[0.99999,1.00001]"]
    return {
        "gathered": _runner(where, policy, prompts, 3, "gen_gathered", extra=[*fp32, *exact]),
        "ranks": _runner(where, policy, prompts, 3, "gen_ranks", extra=[*fp32, *exact, *ranks]),
        "stale": _runner(where, policy, prompts, 3, "gen_stale", extra=[*ranks, "rl.max_staleness=1",
                                                                        "rl.correction=tis"]),
    }  # fmt: skip


def _formulas_and_generators(rank: int, world: int, folder: str, inputs: str) -> Dict[str, Any]:
    policy, prompts = str(Path(inputs) / "policy"), str(Path(inputs) / "prompts.jsonl")
    return {
        "losses": _losses_on_given_rollouts(rank),
        "lengths": _different_lengths(rank),
        "fp32_head": _fp32_head(rank),
        "mismatch": _mismatch(rank),
        "generators": _generator_ranks(rank, folder, policy, prompts),
    }


def _runs(rank: int, world: int, folder: str, inputs: str) -> Dict[str, Any]:
    policy, prompts = str(Path(inputs) / "policy"), str(Path(inputs) / "prompts.jsonl")
    return {
        "resume": _resume(rank, folder, policy, prompts),
        "mamba": _mamba(rank, folder, str(Path(inputs) / "mamba"), prompts),
        "one_update": _one_update(rank, folder, policy, prompts),
    }


LAUNCH = Launch((_formulas_and_generators, _runs), WORLD, timeout=600, fixtures=("inputs",))
"""Two launches side by side: while one's trainers wait on a generator process importing, the other's compute."""


# -- the inputs


def _prompt_lines(count: int = 60) -> List[Dict[str, Any]]:
    return [{"prompt": f"Which is larger, {i % 9 + 1} or {(i * 4) % 9 + 1}?", "answer": str(i)} for i in range(count)]


def _write_lines(path: Path, lines: List[Any]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _recipe(policy: str, prompts: str, output: str, steps: int, devices: int = WORLD) -> List[str]:
    return [
        "objective=grpo", "trainer.accelerator=cpu", f"trainer.devices={devices}", f"trainer.max_steps={steps}",
        "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "trainer.checkpoint_every_n_steps=2",
        "trainer.precision=bf16-true", f"model.pretrained={policy}", f"data.files=[{prompts}]", "data.seq_len=64",
        "data.held_out_every=10", "data.val_windows=2", "rl.prompts_per_step=2", "rl.group_size=4",
        "rl.max_new_tokens=6", "optimizer.lr=0.01", "optimizer.warmup_steps=1", f"output.dir={output}",
    ]  # fmt: skip


def make_mamba_folder(folder: Path) -> Path:
    """An HF Mamba (Mamba-1) from config, saved in bf16, with the byte tokenizer: a recurrent state cache, no
    attention."""
    from transformers import AutoModelForCausalLM

    from lightning_mixedfsdp.recipes.run.hf_export import write_byte_tokenizer
    from tests.hf_models import tiny_config

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(tiny_config("mamba", vocab_size=TEACHER_VOCAB))
    model.to(torch.bfloat16).save_pretrained(folder)  # saved bf16: a 32-true recipe trains it in fp32
    write_byte_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("grpo_inputs")
    make_llama_folder(folder / "policy")
    shutil.copytree(folder / "policy", folder / "dropout_policy")  # the same weights, attention dropout 0.1
    config = json.loads((folder / "dropout_policy" / "config.json").read_text())
    (folder / "dropout_policy" / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    make_mamba_folder(folder / "mamba")
    _write_lines(folder / "prompts.jsonl", _prompt_lines())
    length = "def length(prompts, completions, records):\n    return [len(c) / 10 for c in completions]\n"
    (folder / "length_reward.py").write_text(length)
    # a reward module that kills the generator process (python -m ...generator_process), not the trainers
    generator = "import os, signal, sys\nGENERATOR = sys.argv[0].endswith('generator_process.py')\n"
    (folder / "dying_reward_at_start.py").write_text(f"{generator}if GENERATOR:\n    raise SystemExit(7)\n{length}")
    (folder / "dying_reward_killed.py").write_text(
        f"{generator}def length(prompts, completions, records):\n    if GENERATOR:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n    return [len(c) / 10 for c in completions]\n"
    )
    # fails on the generator's first call only: trainer rank 0's rollout fails, rank 1's does not
    (folder / "dying_reward_first_call.py").write_text(
        f"{generator}CALLS = []\ndef length(prompts, completions, records):\n    CALLS.append(1)\n"
        "    if GENERATOR and len(CALLS) == 1:\n        raise ValueError('the reward failed once')\n"
        "    return [len(c) / 10 for c in completions]\n"
    )
    return folder


# -- the loss


@pytest.mark.parametrize("case", CASES, ids=[f"{kind}-beta{beta}" for kind, beta in CASES])
def test_each_loss_and_its_grads_on_two_ranks_equal_the_formula_on_one_process(results: list, case: Any) -> None:
    kind, beta = case
    data = _rollouts()
    old, reference = _old_and_reference(_llama(), data)
    model = _llama()
    log_probs = completion_log_probs(model, _rollout(data, slice(None), old), 1.0)
    expected = formula(log_probs, old, reference, data["completion"], data["rewards"], kind, beta)
    expected.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    got = results[0]["losses"][f"{kind} {beta}"]["grads"]
    assert got.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    assert any(results[rank]["losses"][f"{kind} {beta}"]["clip_fraction"] > 0 for rank in range(WORLD))


def test_a_masked_correction_on_two_ranks_equals_one_process_with_every_ranks_kept_tokens(results: list) -> None:
    data = _rollouts()
    old, _ = _old_and_reference(_llama(), data)
    model = _llama()
    rollout = _rollout(data, slice(None), old)
    mask = rollout.completion_mask
    kept = _masked_dapo(completion_log_probs(model, rollout, 1.0), old, mask, data["rewards"])
    assert 0 < kept < float(mask.sum())  # the bounds reject some tokens
    got = results[0]["losses"]["mis dapo"]
    assert got["kept"] == kept
    for name, param in model.named_parameters():
        torch.testing.assert_close(got["grads"][name], param.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_one_rank_loss_equals_the_formula_on_its_rollout() -> None:
    data = _rollouts()
    old, reference = _old_and_reference(_llama(), data)
    rows = _rank_rows(1)
    log_probs = completion_log_probs(_llama(), _rollout(data, rows, old[rows]), 1.0)
    completion, rewards = data["completion"][rows], data["rewards"][rows]
    for kind, beta in CASES:
        settings = LossSettings(kind, GROUP, CLIP, CLIP_HIGH, MAX_NEW, beta)
        got = grpo_loss(log_probs, old[rows], completion, rewards, settings, reference[rows]).loss
        expected = formula(log_probs, old[rows], reference[rows], completion, rewards, kind, beta)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


# -- rollouts


def test_ranks_whose_completions_end_at_different_lengths_decode_the_greedy_tokens_and_step(results: list) -> None:
    lengths = []
    for rank in range(WORLD):
        seen = results[rank]["lengths"]
        expected = seen["expected"]
        assert torch.equal(seen["gathered"], expected)  # no collective per token: each rank stops at its own end
        length = expected.shape[1]
        sharded = seen["sharded"]  # decoded as long as the longest rank, padded past its end
        assert torch.equal(sharded[:, :length], expected) and not sharded[:, length:].any()
        assert seen["stepped"]
        lengths.append(length)
    assert lengths == [4 + 1, 4 + MAX_NEW]  # one ended at its first token, the other ran to the limit


def test_positions_of_left_padded_rows_start_at_their_first_token() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert positions_of(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


# -- the head in fp32


@pytest.mark.parametrize("tie", ["untied", "tied"])
def test_an_fp32_compute_head_multiplies_in_fp32_and_stays_stored_bf16_and_sharded(results: list, tie: str) -> None:
    for rank in range(WORLD):
        seen = results[rank]["fp32_head"][tie]
        assert seen["equal"]  # the logits are the fp32 matmul of the gathered bf16 weight and the upcast input
        assert (seen["weight_dtype"], seen["input_dtype"]) == (torch.bfloat16, torch.bfloat16)
        assert seen["logits_dtype"] == seen["logits"] == torch.float32
        assert seen["storage"] == torch.bfloat16 and seen["grad"] == torch.bfloat16
        assert seen["local_rows"] == seen["rows"] // WORLD  # sharded as the root group is
        assert seen["embedding_storage"] == seen["embedding_output"] == torch.bfloat16
        assert seen["tied"] == (tie == "tied")


def test_the_fp32_head_cuts_the_generator_trainer_mismatch_to_at_most_0_6x(results: list) -> None:
    for rank in range(WORLD):
        mismatch = results[rank]["mismatch"]
        assert 0 < mismatch["fp32"] <= 0.6 * mismatch["bf16"], mismatch


def test_the_dtype_report_shows_the_head_computing_in_fp32() -> None:
    from lightning_mixedfsdp import MixedFSDPConfig
    from lightning_mixedfsdp.planning.planner import plan_sharding
    from lightning_mixedfsdp.planning.report import format_plan

    report = format_plan(plan_sharding(_llama(), MixedFSDPConfig(fp32_compute_modules=["^lm_head$"]), "bf16-true"))
    assert "compute fp32 (fp32_compute_modules)" in report
    assert any(line.startswith("lm_head.weight") and " bf16->fp32 " in line for line in report.splitlines())


def test_fp32_compute_of_a_module_that_is_not_a_linear_is_refused() -> None:
    from lightning_mixedfsdp import MixedFSDPConfig
    from lightning_mixedfsdp.planning.fp32_compute import Fp32ComputeError
    from lightning_mixedfsdp.planning.planner import plan_sharding

    expected = r"'\^model.norm\$' matches 'model.norm' \(LlamaRMSNorm\)\. Anchor the regex to the head's name"
    with pytest.raises(Fp32ComputeError, match=expected):
        plan_sharding(_llama(), MixedFSDPConfig(fp32_compute_modules=["^model.norm$"]), "bf16-true")


# -- the recipe


def test_a_resume_repeats_the_straight_runs_losses(results: list) -> None:
    for rank in range(WORLD):
        seen = results[rank]["resume"]
        assert len(seen["straight"]) == 4 and len(seen["resumed"]) == 2
        assert seen["resumed"] == pytest.approx(seen["straight"][2:], rel=1e-6, abs=1e-7)
        assert len(seen["kl"]["kl"]) == 4 and seen["kl"]["kl"][0] == pytest.approx(0.0, abs=1e-6)  # the reference
        assert seen["kl"]["kl"][-1] > 0  # is the starting policy: no KL at step 0, some once it moved


def test_the_policys_export_says_bfloat16_and_loads_as_it_was_trained(results: list, folder: Path) -> None:
    assert_the_export_states_its_dtype(folder / "straight" / "export", torch.bfloat16)


def test_a_mamba_policy_samples_what_the_trainer_scores_and_a_cache_that_does_not_is_refused(
    results: list, folder: Path
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    # the bf16 checkpoint trained in fp32 under 32-true: every param of the policy's checkpoint is fp32
    saved = FileSystemReader(str(folder / "mamba" / "checkpoints" / "last.ckpt")).read_metadata().state_dict_metadata
    policy = {key: meta for key, meta in saved.items() if key.startswith("state_dict.model.")}
    assert policy and all(meta.properties.dtype == torch.float32 for meta in policy.values())
    for rank in range(WORLD):
        seen = results[rank]["mamba"]
        assert len(seen["exact"]["logprob_mismatch"]) == 2
        assert max(seen["exact"]["logprob_mismatch"]) <= 1e-5, seen["exact"]["logprob_mismatch"]
        # mu = pi_old = pi_theta to 1e-5 at each rollout's first update: ratio 1, nothing clipped, nothing masked
        assert seen["exact"]["is_masked_fraction"] == [0.0, 0.0] and seen["exact"]["clip_fraction"] == [0.0, 0.0]
        assert all(abs(w - 1) <= 1e-5 for w in seen["exact"]["is_weight_mean"]), seen["exact"]["is_weight_mean"]
        assert all(1 <= e <= 1 + 1e-5 for e in seen["exact"]["token_mult_prob_error"]), seen["exact"]
        assert all(0 <= gap <= 1e-5 for gap in seen["exact"]["max_prob_gap"]), seen["exact"]["max_prob_gap"]
        refused = seen["refused"]
        assert refused is not None and refused.startswith("GroupRelativePolicyOptimization: on MambaForCausalLM")
        value = float(re.search(r"logprob_mismatch .* is ([0-9.e+-]+), above rl.mismatch_limit=0.001", refused)[1])
        assert value > 0.01, refused
    assert results[0]["mamba"]["refused"] == results[1]["mamba"]["refused"]  # the largest over the ranks, on both


def _union(parts: List[Dict[str, Any]]) -> Rollout:
    """The ranks' rollouts as one batch: each left-padded to the longest prompt, right-padded to the longest row
    (positions come from the attention mask: the same tokens at the same positions)."""
    prompt_len = max(part["prompt_len"] for part in parts)
    names = ("input_ids", "attention_mask", "completion_mask")
    rows = [{k: F.pad(part[k], (prompt_len - part["prompt_len"], 0)) for k in names} for part in parts]
    width = max(row["input_ids"].shape[1] for row in rows)
    merged = {k: torch.cat([F.pad(row[k], (0, width - row[k].shape[1])) for row in rows]) for k in names}
    zeros = torch.zeros(merged["input_ids"].shape)
    return Rollout(merged["input_ids"], merged["attention_mask"], merged["completion_mask"], zeros, prompt_len)


def test_the_recipes_update_on_a_fixed_rollout_equals_a_plain_loops(results: list, inputs: Path) -> None:
    from transformers import AutoModelForCausalLM

    from benchmarks.rl_learning import plain_update

    rollout = _union([results[rank]["one_update"]["rollout"] for rank in range(WORLD)])
    rewards = torch.cat([results[rank]["one_update"]["rewards"] for rank in range(WORLD)])
    model = AutoModelForCausalLM.from_pretrained(str(inputs / "policy"), dtype=torch.float32)
    # the recipe's AdamW: lr 0.01 (warm-up 1 step: the peak at step 0), betas, weight decay 0.01; the clip at 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.01)
    grads: Dict[str, torch.Tensor] = {}
    optimizer.register_step_pre_hook(lambda *_: grads.update({n: p.grad.clone() for n, p in model.named_parameters()}))
    plain_update(model, optimizer, rollout, rewards, 4, 6, 1.0, vocab=256)  # the byte tokenizer's ids
    recipe, recipe_grads = results[0]["one_update"]["params"], results[0]["one_update"]["grads"]
    assert recipe.keys() == dict(model.named_parameters()).keys() == recipe_grads.keys()
    for name, param in model.named_parameters():
        # the clipped gradient AdamW receives: GRPO's loss over both ranks' rollouts, the clip over every shard
        torch.testing.assert_close(recipe_grads[name], grads[name], rtol=1e-5, atol=1e-5 * grads[name].abs().max())
        # AdamW's first step is lr x g / (|g| + eps), +-lr wherever |g| >> eps: an element whose g is within the
        # gradients' rounding of 0 may take either sign. Every other element (and one without a gradient: weight
        # decay alone) to 1e-5
        scale = grads[name].abs().max()
        resolved = (grads[name].abs() > 1e-4 * scale) | (grads[name] == 0)
        assert resolved.float().mean() > 0.9, name  # nearly every element is compared
        torch.testing.assert_close(recipe[name][resolved], param.detach()[resolved], rtol=1e-5, atol=1e-5, msg=name)
    assert rewards.min() < rewards.max()  # some advantage to follow: the update is not weight decay alone


def test_a_generator_rank_samples_the_trainers_tokens_with_the_weights_of_each_step(results: list) -> None:
    for rank in range(WORLD):
        gathered, ranks = results[rank]["generators"]["gathered"], results[rank]["generators"]["ranks"]
        # fp32: the same tokens as sampling on the trainers (the same rewards and lengths, step by step)
        assert ranks["train_reward"] == gathered["train_reward"] and len(ranks["train_reward"]) == 3
        assert ranks["completion_length"] == gathered["completion_length"]
        torch.testing.assert_close(ranks["train_loss"], gathered["train_loss"], rtol=1e-5, atol=1e-7)
        # mu = pi_old = pi_theta to 1e-5 on the generator's rollouts: nothing rejected, nothing clipped
        assert ranks["is_masked_fraction"] == [0.0, 0.0, 0.0] and ranks["clip_fraction"] == [0.0, 0.0, 0.0]
        assert ranks["rollout_version"] == [0.0, 1.0, 2.0]  # sampled with the weights after 0, 1, 2 steps


def test_one_step_stale_rollouts_are_sampled_with_the_previous_steps_weights_and_corrected(results: list) -> None:
    for rank in range(WORLD):
        stale = results[rank]["generators"]["stale"]
        assert stale["rollout_version"] == [0.0, 0.0, 1.0]  # step k's rollout: step k-1's weights (step 0: its own)
        assert len(stale["is_weight_mean"]) == 3 and all(0 < w <= 2 for w in stale["is_weight_mean"])
        assert stale["logprob_mismatch"][1] > stale["logprob_mismatch"][0]  # a step's update between the two
        assert "val_reward" in stale  # the held-out evaluation ran on the trainers


def test_lora_with_its_base_as_reference_composes_with_checkpointing_the_monitor_and_bf16_updates(
    results: list,
) -> None:
    for rank in range(WORLD):
        composed = results[rank]["resume"]["composed"]
        assert len(composed["train_loss"]) == 3 and all(math.isfinite(v) for v in composed["train_loss"])
        assert composed["kl"][0] == pytest.approx(0.0, abs=1e-6) and composed["kl"][-1] > 0
        assert {"train_reward", "logprob_mismatch", "clip_fraction", "completion_length", "val_reward"} <= set(composed)


def test_exact_match_takes_the_completions_last_word_or_number_case_folded() -> None:
    assert last_answer("so the answer is 12.") == "12" and last_answer("...") is None
    records = [{"answer": 12}, {"answer": "Blue"}, {"answer": "3"}]
    assert exact_match([], ["It is 12", "the sky is BLUE!", "3 or 4"], records) == [1.0, 1.0, 0.0]


def _refusal(inputs: Path, *extra: str, prompts: Any = None) -> str:
    prompts = prompts or inputs / "prompts.jsonl"
    with pytest.raises(RecipeError) as error:
        load_recipe(None, [*_recipe(str(inputs / "policy"), str(prompts), str(inputs / "out"), 4), *extra])
    return str(error.value)


def test_bad_prompt_lines_are_named_by_file_and_line_all_at_once(inputs: Path) -> None:
    lines: List[Any] = list(_prompt_lines(30))
    lines[2] = {"question": "q", "answer": "1"}
    lines[4] = {"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "answer": "1"}
    lines[6] = {"prompt": "What is 1 + 1?"}
    lines[8] = {"prompt": "q", "answer": "1", "images": ["cat.png"]}
    path = _write_lines(inputs / "bad.jsonl", lines)
    message = _refusal(inputs, "data.format=prompts", prompts=path)
    assert f"data: {path}:3 has the fields ['answer', 'question'], and a prompts line needs 'prompt'" in message
    assert f"data: {path}:5 'prompt' ends with a assistant turn; the policy writes the next assistant turn" in message
    assert f"data: {path}:7 has no 'answer' field, which the reward (rl.reward) reads; add it" in message
    assert f"data: {path}:9 holds 'images': reinforcement learning takes text prompts only" in message


def test_problems_in_rl_data_and_model_are_refused_together_before_launch(inputs: Path) -> None:
    lines: List[Any] = list(_prompt_lines(30))
    lines[3] = {"question": "q", "answer": "1"}
    lines[5] = {"prompt": "What is 1 + 1?"}
    path = _write_lines(inputs / "two_bad.jsonl", lines)
    missing = inputs / "missing_policy"
    reward = f"rl.reward=[exact_match,{inputs}/missing.py:score]"
    message = _refusal(inputs, reward, f"model.pretrained={missing}", prompts=path)
    assert message.startswith("Recipe has 4 problems:"), message
    assert f"rl.reward '{inputs}/missing.py:score': {inputs}/missing.py does not exist" in message
    assert f"model.pretrained={str(missing)!r}" in message
    assert f"data: {path}:4 has the fields ['answer', 'question'], and a prompts line needs 'prompt'" in message
    assert f"data: {path}:6 has no 'answer' field, which the reward (rl.reward) reads; add it" in message


def test_a_reward_that_does_not_exist_or_takes_other_arguments_is_refused(inputs: Path) -> None:
    (inputs / "rewards.py").write_text("def two(prompts, completions):\n    return [0.0] * len(completions)\n")
    message = _refusal(inputs, f"rl.reward=[{inputs}/missing.py:score,{inputs}/rewards.py:two,json:nothing]")
    assert f"rl.reward '{inputs}/missing.py:score': {inputs}/missing.py does not exist" in message
    assert "rewards.py:two': two must take three arguments (prompts, completions, records)" in message
    assert "rl.reward 'json:nothing': json has no function 'nothing'" in message


def test_a_group_of_one_and_other_bad_rl_settings_are_refused_all_at_once(inputs: Path) -> None:
    message = _refusal(
        inputs, "rl.group_size=1", "rl.loss=ppo", "rl.top_p=0", "rl.temperature=0", "rl.generation=vllm",
        "rl.reference=copy", "trainer.accumulate_grad_batches=2",
    )  # fmt: skip
    assert "rl.group_size=1: advantages compare each completion with the others" in message
    assert "rl.loss='ppo': use one of grpo, dr_grpo, dapo" in message
    assert "rl.top_p=0.0 must be in (0, 1]" in message
    assert "rl.temperature=0.0 must be > 0" in message
    assert "rl.generation='vllm': use one of gathered, sharded" in message
    assert "rl.reference='copy' is the reference of the KL penalty, and rl.beta=0 holds none" in message
    assert "trainer.accumulate_grad_batches=2: a GRPO step is one rollout" in message


def test_adapters_off_without_peft_is_refused(inputs: Path) -> None:
    message = _refusal(inputs, "rl.beta=0.04", "rl.reference=adapters_off")
    assert "rl.reference=adapters_off is the policy's base with its LoRA adapters disabled, and peft is off" in message


def test_context_parallel_fault_tolerant_and_semi_synchronous_runs_are_refused(inputs: Path) -> None:
    assert "GRPO with strategy.parallelism.context_parallel_size=2 is not supported yet" in _refusal(
        inputs, "strategy.parallelism.context_parallel_size=2"
    )
    assert "GRPO with strategy.fault_tolerance is not supported yet" in _refusal(
        inputs, "strategy.fault_tolerance.num_replica_groups=2", "strategy.fault_tolerance.replica_id=0"
    )
    semi_sync = _refusal(
        inputs, "trainer.devices=4", "strategy.parallelism.data_parallel_replicate_size=2",
        "strategy.parallelism.replicate_sync=local_sgd",
    )  # fmt: skip
    assert "GRPO with strategy.parallelism.replicate_sync='local_sgd' is not supported" in semi_sync


def test_too_few_prompts_for_the_ranks_and_prompts_too_long_for_the_rows_are_refused(inputs: Path) -> None:
    few = _write_lines(inputs / "few.jsonl", _prompt_lines(3))
    message = _refusal(inputs, "data.format=prompts", prompts=few)
    assert (
        "data: 2 training and 1 held-out prompts (at most data.val_windows=2 evaluated); training and evaluation"
        in message
    )
    assert "need a prompt per data-parallel rank (2): add prompts, lower data.held_out_every=10" in message
    longest = len("Which is larger, 1 or 1?")
    message = _refusal(inputs, "data.seq_len=20")
    assert f"data: the longest prompt has {longest} tokens, and with rl.max_new_tokens=6 a rollout is longer" in message
    assert f"raise data.seq_len to {longest + 6} or shorten prompts" in message


RANKS = ("rl.generation=ranks", "rl.generator_ranks=1")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rl.generation=ranks"], "rl.generation=ranks samples on generator processes: set rl.generator_ranks"),
        (["rl.generator_ranks=1"], "rl.generator_ranks=1 needs rl.generation=ranks"),
        (["rl.generation=ranks", "rl.generator_ranks=3"], "rl.generator_ranks=3 with 2 trainer ranks"),
        ([*RANKS, "rl.max_staleness=2"], r"rl.max_staleness=2: 0 \(synchronous\) or 1 \(one step stale\)"),
        (["rl.max_staleness=1"], "rl.max_staleness=1 samples the next rollout while the trainers train"),
        ([*RANKS, "rl.sync_bucket_mb=0"], r"rl.sync_bucket_mb=0.0 must be > 0"),
        (
            [*RANKS, "strategy.parallelism.tensor_parallel_size=2"],
            "rl.generation=ranks with strategy.parallelism.tensor_parallel_size=2 is not supported yet",
        ),
        (
            [*RANKS, "trainer.devices=4", "strategy.parallelism.expert_parallel_size=2"],
            "rl.generation=ranks with strategy.parallelism.expert_parallel_size=2 is not supported yet",
        ),
        (
            [*RANKS, "strategy.parallelism.pipeline_parallel_size=2"],
            "rl.generation=ranks with strategy.parallelism.pipeline_parallel_size=2 is not supported yet",
        ),
        (
            [*RANKS, "peft.enabled=true", "strategy.memory.quantize_base=nf4"],
            "rl.generation=ranks with strategy.memory.quantize_base='nf4' is not supported yet",
        ),
        ([*RANKS, "trainer.num_nodes=2"], "rl.generation=ranks with trainer.num_nodes=2 is not supported yet"),
    ],
)
def test_generator_ranks_that_cannot_run_are_refused_before_launch(
    inputs: Path, overrides: List[str], message: str
) -> None:
    assert re.search(message, _refusal(inputs, *overrides))


def test_a_generator_starts_without_any_launchers_or_schedulers_variables() -> None:
    """Under torchrun a generator's Fabric found TORCHELASTIC_USE_AGENT_STORE and waited for torchrun's store."""
    from lightning_mixedfsdp.recipes.rl.generator_processes import generator_environment

    launched = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                "GROUP_RANK": "0", "ROLE_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RUN_ID": "x", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "OMPI_COMM_WORLD_RANK": "1",
                "PMI_RANK": "1", "LSB_JOBID": "3", "PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1",
                "PYTHONPATH": "/src"}  # fmt: skip
    assert generator_environment(launched) == {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1", "PYTHONPATH": "/src"}
