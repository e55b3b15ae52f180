"""A GRPO generator rank (``rl.generation: ranks``), started by trainer rank 0 (``rl/generator_ranks.py``):

    python -m lightning_mixedfsdp.recipes.run.generator_process RECIPE_PICKLE HOST:PORT SYNC_RANK SYNC_SIZE

It sets the recipe's policy up alone, a world of one: the strategy's own plan and casts (keep-fp32 params, the fp32
head), its FSDP units of one rank holding every tensor whole. Then it serves the trainers over their process group
until told to stop: the weights' layout once (checked against its own tensors), each version's weights received
whole into its params, and rollouts: for each trainer rank it serves (``r % generators``), that rank's prompts
sampled with that rank's seed, as the colocated sampler would, and scored by the recipe's reward."""

import hashlib
import os
import pickle
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch import nn

from lightning_mixedfsdp.compat.torch import rendezvous_store, standalone_gloo_group
from lightning_mixedfsdp.model.names import canonical_name, unwrap_model
from lightning_mixedfsdp.recipes.data.prompts import PROMPTS, Prompt, read_prompts
from lightning_mixedfsdp.recipes.data.sft import ExampleMaker
from lightning_mixedfsdp.recipes.data.text import make_tokenizer
from lightning_mixedfsdp.recipes.objectives.grpo import needed_fields
from lightning_mixedfsdp.recipes.objectives.objective import build_model
from lightning_mixedfsdp.recipes.rl import sync_wire
from lightning_mixedfsdp.recipes.rl.generation import generate
from lightning_mixedfsdp.recipes.rl.generator_processes import ERROR_FILE
from lightning_mixedfsdp.recipes.rl.generator_ranks import seed_of
from lightning_mixedfsdp.recipes.rl.rewards import load_rewards, score_completions
from lightning_mixedfsdp.recipes.rl.rollouts import Sampling
from lightning_mixedfsdp.recipes.run.runner import strategy_config
from lightning_mixedfsdp.recipes.settings.schema import PeftSection, Recipe


def policy_alone(recipe: Recipe, sync_rank: int) -> Any:
    """The recipe's policy set up by the strategy in a world of one (its own process group), on the device after
    the trainers' (a GPU machine: trainers on the first ``trainer.devices``, generators next)."""
    from lightning.fabric import Fabric

    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    devices: Any = 1 if recipe.trainer.accelerator == "cpu" else [recipe.trainer.devices + sync_rank - 1]
    kwargs = recipe.strategy_kwargs()
    kwargs["config"] = strategy_config(recipe)
    strategy = MixedFSDP2Strategy(**kwargs)
    fabric = Fabric(accelerator=recipe.trainer.accelerator, devices=devices, strategy=strategy,
                    precision=recipe.trainer.precision)  # type: ignore[arg-type]  # fmt: skip
    fabric.launch()
    model = fabric.setup_module(build_model(recipe.model, PeftSection()))
    return model.train(not recipe.rl.disable_dropout)  # the trainers' mode in their RL forwards


def whole_tensors(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every param and buffer under its canonical name, whole (a one-rank DTensor's local tensor is the tensor)."""
    inner = unwrap_model(model)
    tensors = {**dict(inner.named_buffers()), **dict(inner.named_parameters(remove_duplicate=False))}
    return {canonical_name(name): (t.to_local() if hasattr(t, "to_local") else t).data for name, t in tensors.items()}


def check_layout(layout: sync_wire.Layout, tensors: Dict[str, torch.Tensor], model: nn.Module) -> None:
    """The trainers' streamed tensors against this rank's own, both ways: same names and shapes, dtypes that hold
    what is sent (the same, or a floating dtype as wide or wider: under ``bf16-mixed`` a PEFT policy's trainers keep
    the frozen base in bf16, merged with its adapters as it streams, where the generator's policy, all trainable,
    stores fp32), and every tensor of its state dict received (a tensor the trainers do not send would keep its
    initial values); a tied copy of a received tensor is received with it."""
    problems = []
    for name, shape, dtype in layout:
        mine = tensors.get(name)
        if mine is None:
            problems.append(f"{name} is not in the generator's {type(unwrap_model(model)).__name__}")
        elif tuple(mine.shape) != shape or not holds(mine.dtype, sent_dtype(dtype)):
            problems.append(
                f"{name}: trainers send {shape} {dtype}, the generator holds {tuple(mine.shape)} {mine.dtype}"
            )
    sent = {name for name, _, _ in layout}
    received_storage = {tensors[name].untyped_storage().data_ptr() for name in sent if name in tensors}
    for name in state_dict_names(model):
        mine = tensors.get(name)  # None: no tensor (a module's extra state)
        if name not in sent and mine is not None and mine.untyped_storage().data_ptr() not in received_storage:
            problems.append(f"{name} of the generator's policy is not among the tensors the trainers send")
    if problems:
        raise RuntimeError("generator rank: the trainers' weights do not fit its policy: " + "; ".join(problems[:5]))


def sent_dtype(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``."""
    return getattr(torch, name.removeprefix("torch."))


EXACT_WIDENINGS = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}
"""Dtypes that hold every value of a narrower one exactly (bf16 and fp16 in fp32; not fp16 in bf16 or the reverse)."""


def holds(held: torch.dtype, sent: torch.dtype) -> bool:
    """Whether a tensor of dtype ``held`` takes a sent ``sent`` tensor's values exactly."""
    return held == sent or held in EXACT_WIDENINGS.get(sent, ())


def state_dict_names(model: nn.Module) -> List[str]:
    """The canonical names of the tensors ``model``'s state dict holds (params and persistent buffers)."""
    return [canonical_name(name) for name in unwrap_model(model).state_dict(keep_vars=True)]


class Server:
    """One generator rank's state: its policy, the training prompts, the reward, the weights' version."""

    def __init__(self, recipe: Recipe, model: nn.Module, sync_rank: int, generators: int) -> None:
        self.recipe, self.model, self.group = recipe, model, None
        self.sync_rank, self.generators = sync_rank, generators
        tokenizer = make_tokenizer(recipe.data.tokenizer, recipe.data.trust_remote_code)
        self.maker = ExampleMaker(recipe.data, PROMPTS, tokenizer)
        self.vocab = int(tokenizer.vocab_size)
        self.prompts: List[Prompt] = read_prompts(recipe.data, self.maker, needed_fields(recipe.rl)).train
        self.rewards = load_rewards(recipe.rl.reward)
        self.tensors = whole_tensors(model)
        self.layout: sync_wire.Layout = []
        self.version = -1

    def serve(self, group: Any) -> None:
        """Answer the trainers over ``group`` until told to stop."""
        self.group = group
        while True:
            kind, version, _, verify = sync_wire.receive_command(self.group)
            if kind == sync_wire.STOP:
                return
            if kind == sync_wire.LAYOUT:
                self.layout = sync_wire.broadcast_object(self.group, sending=False)
                check_layout(self.layout, self.tensors, self.model)
            elif kind == sync_wire.WEIGHTS:
                for name, _, dtype in self.layout:
                    sync_wire.receive_tensor_into(self.group, self.tensors[name], sent_dtype(dtype))
                self.version = version
                if verify:  # the params as this rank holds them now, in the order sent
                    digest = hashlib.sha256()
                    for name, _, dtype in self.layout:  # in the dtype sent (a wider one holds it exactly)
                        digest.update(sync_wire.tensor_bytes(self.tensors[name].to(sent_dtype(dtype))))
                    sync_wire.send_object(self.group, digest.hexdigest(), 0)
            elif kind == sync_wire.REQUEST:
                self.answer(sync_wire.broadcast_object(self.group, sending=False))

    def answer(self, request: Dict[str, Any]) -> None:
        """Each trainer rank this generator serves: its rollout, or the traceback of what failed."""
        for rank, indices in enumerate(request["prompts"]):
            if rank % self.generators != self.sync_rank - 1:
                continue
            try:
                reply = self.rollout_of(rank, indices, request)
            except Exception:  # the trainers raise it on every rank
                reply = {"error": traceback.format_exc()}
            sync_wire.send_object(self.group, reply, 0)

    def rollout_of(self, rank: int, indices: List[int], request: Dict[str, Any]) -> Dict[str, Any]:
        rl, device = self.recipe.rl, next(self.model.parameters()).device
        prompts = [self.prompts[i] for i in indices for _ in range(rl.group_size)]
        generator = torch.Generator(device).manual_seed(seed_of(request["seed"], request["index"], rank))
        sampling = Sampling(rl.max_new_tokens, rl.temperature, rl.top_p)
        ids = [p.ids for p in prompts]
        rollout = generate(self.model, self.model, ids, sampling, self.maker.end, self.maker.pad, "gathered",
                           generator, self.vocab)  # fmt: skip
        rewards, means = score_completions(self.rewards, self.maker, prompts, rollout)
        fields = ("input_ids", "attention_mask", "completion_mask", "generator_log_probs")
        reply: Dict[str, Any] = {name: getattr(rollout, name).cpu() for name in fields}
        reply.update(prompt_len=rollout.prompt_len, rewards=torch.tensor(rewards), means=means, version=self.version)
        return reply


def exit_with_the_trainer(folder: Path, every_s: float = 2.0) -> None:
    """End this process, and remove the run's temporary folder, once the trainer rank that started it is gone (killed
    without running its exit handlers): a generator would otherwise wait on a dead store, holding its device."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-the-trainer", daemon=True).start()


def main(argv: List[str]) -> None:
    recipe_file, address, sync_rank, sync_size = argv[0], argv[1], int(argv[2]), int(argv[3])
    exit_with_the_trainer(Path(recipe_file).parent)
    try:
        recipe: Recipe = pickle.loads(Path(recipe_file).read_bytes())
        model = policy_alone(recipe, sync_rank)
        host, port = address.rsplit(":", 1)
        server = Server(recipe, model, sync_rank, sync_size - 1)  # the tokenizer, the prompts, the reward: loaded
        store = rendezvous_store(host, int(port), sync_size, False, 1800.0)
        store.set(f"joined/{sync_rank}", "1")  # trainer rank 0 waits for these while it watches the processes
        server.serve(standalone_gloo_group(store, sync_rank, sync_size, 1800.0))
    except BaseException:
        # the trainers name this generator, its exit code and this traceback (unless they are gone with the folder)
        error_file = Path(recipe_file).parent / ERROR_FILE.format(rank=sync_rank)
        try:
            error_file.write_text(traceback.format_exc())
        except OSError:
            pass
        raise


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main(sys.argv[1:])
