"""The recipe runner: ``python -m lightning_mixedfsdp.train --config conf/<recipe>.yaml key.sub=value ...``

Launches ``trainer.devices`` processes itself (Lightning re-runs this command in each), prints the dtype report,
trains with a progress bar, reports held-out perplexity before and after, saves checkpoints, and writes under
``output.dir``: ``export/`` (safetensors, ``config.json``, tokenizer; ``from_pretrained`` loads it), with LoRA
``adapter/`` (PEFT's format), ``metrics.png`` (loss and perplexity against the step), ``console.log``.

``--resume last`` continues from the run's newest checkpoint with the same data stream; with a larger
``trainer.max_steps`` it trains on to it. Ctrl-C or SIGTERM saves ``last.ckpt`` at the next step boundary and exits;
copies within 2 s are the same request, another one later aborts at once.
``--dry-run`` prints the plan and the per-rank memory and trains nothing.
"""

import argparse
import os
import re
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

import lightning_mixedfsdp  # noqa: F401  registers "mixed_fsdp2"
from lightning_mixedfsdp.apply.muon import split_for_muon, split_lines
from lightning_mixedfsdp.compat.extras import MissingPackage, installed
from lightning_mixedfsdp.config import DTYPES, MixedFSDPConfig
from lightning_mixedfsdp.planning.memory import estimate_memory
from lightning_mixedfsdp.planning.planner import plan_sharding
from lightning_mixedfsdp.planning.report import format_plan
from lightning_mixedfsdp.planning.stages import plan_stages, stage_of_params
from lightning_mixedfsdp.recipes.data.chat import BYTE_CHAT_TEMPLATE
from lightning_mixedfsdp.recipes.data.chat_corpus import ChatCorpus
from lightning_mixedfsdp.recipes.data.sft import template_text
from lightning_mixedfsdp.recipes.data.text import HFTokenizer, TextCorpus
from lightning_mixedfsdp.recipes.data.vision import VisionCorpus
from lightning_mixedfsdp.recipes.objectives.objective import Objective, build_model
from lightning_mixedfsdp.recipes.objectives.registry import objective_class
from lightning_mixedfsdp.recipes.run.checkpoints import RunCheckpoints
from lightning_mixedfsdp.recipes.run.console import keep_console, process_rank, progress_bar
from lightning_mixedfsdp.recipes.run.dry_run import format_summary
from lightning_mixedfsdp.recipes.run.generate import generate_answer, held_out_question
from lightning_mixedfsdp.recipes.run.hf_export import write_byte_tokenizer, write_reference_config
from lightning_mixedfsdp.recipes.run.loader import load_recipe
from lightning_mixedfsdp.recipes.run.plot import plot_metrics, read_metrics
from lightning_mixedfsdp.recipes.run.run_folder import RunFolder, RunFolderError, resume_from
from lightning_mixedfsdp.recipes.run.stage_plans import stage_lines
from lightning_mixedfsdp.recipes.run.stopping import StopRequest
from lightning_mixedfsdp.recipes.settings.inputs import (
    checkpoint_fp32_patterns,
    load_hf_config,
    reference_model_config,
)
from lightning_mixedfsdp.recipes.settings.schema import Recipe, RecipeError, recipe_storage
from lightning_mixedfsdp.strategies.precision_monitor import PrecisionMonitor
from lightning_mixedfsdp.strategies.trainer import MixedFSDP2Strategy


@dataclass
class Outcome:
    """What a launch of the runner did."""

    untrained: Optional[float]
    """Held-out perplexity before training (from the run's first launch when this one resumed)."""
    trained: Optional[float]
    """Held-out perplexity at the last step; None when a stop request ended the run."""
    steps: int
    stopped_by: Optional[StopRequest] = None
    """The request that stopped the run before ``max_steps``."""


def strategy_config(recipe: Recipe) -> MixedFSDPConfig:
    """The recipe's strategy section, plus what its models need: a pretrained directory is loaded into the shards
    (no random init, except LoRA adapters) with the fp32 tensors of a mixed-dtype checkpoint kept fp32; what the
    objective's other models need (a teacher's)."""
    config = recipe.mixed_fsdp_config()
    if recipe.model.pretrained is not None:
        config.dtypes.keep_fp32_params = [
            *config.dtypes.keep_fp32_params,
            *checkpoint_fp32_patterns(recipe.model.pretrained),
        ]
        config.weights.init_meta_params = recipe.peft.enabled
    objective_class(recipe).strategy_needs(recipe, config)
    return config


def storage_line(recipe: Recipe) -> str:
    """What the bulk is stored in and why, for the console and the dry run."""
    precision, asked = recipe.trainer.precision, recipe.strategy.dtypes.storage
    storage = recipe_storage(precision, asked)
    if storage != asked:
        return (
            f"trainer.precision={precision}: the bulk is stored and trained in fp32 (strategy.dtypes.storage=auto);"
            " strategy.dtypes.storage=keep keeps the checkpoint's dtypes"
        )
    return f"trainer.precision={precision}, strategy.dtypes.storage={asked}"


def build_trainer(recipe: Recipe, checkpoints: RunCheckpoints) -> pl.Trainer:
    folder = run_folder(recipe)
    kwargs = recipe.strategy_kwargs()
    kwargs["config"] = strategy_config(recipe)
    pipelined = recipe.strategy.parallelism.pipeline_parallel_size > 1
    return pl.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        num_nodes=recipe.trainer.num_nodes,
        strategy=MixedFSDP2Strategy(**kwargs),
        precision=recipe.trainer.precision,  # type: ignore[arg-type]  # a flag the schema checked
        max_steps=recipe.trainer.max_steps,
        max_epochs=1,  # one epoch, however often resumed or extended: every checkpoint is saved inside it
        accumulate_grad_batches=recipe.trainer.accumulate_grad_batches,
        # a pipelined objective clips in its own step (manual optimization), over every stage
        gradient_clip_val=None if pipelined else recipe.trainer.gradient_clip_val or None,
        val_check_interval=recipe.trainer.val_check_interval,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,  # the whole held-out set before training: the untrained perplexity
        log_every_n_steps=recipe.trainer.log_every_n_steps,
        logger=build_loggers(recipe.trainer.logger, folder),
        callbacks=[checkpoints, *monitors(recipe), progress_bar()],
        enable_checkpointing=False,  # RunCheckpoints saves
        default_root_dir=folder.root,  # where Lightning's SLURM requeue saves hpc_ckpt_N.ckpt, which resume_from finds
        use_distributed_sampler=False,  # the data module shards its own resumable stream
        enable_model_summary=False,
    )


def monitors(recipe: Recipe) -> List[PrecisionMonitor]:
    """The precision monitor, when ``monitor.every_n_steps`` turns it on."""
    settings = recipe.monitor
    if settings.every_n_steps == 0:
        return []
    return [PrecisionMonitor(settings.every_n_steps, settings.threshold, settings.patience)]


def build_loggers(choice: str, folder: RunFolder) -> List[Logger]:
    """The CSV log (``logs/version_N/metrics.csv``, which the plot reads) and the logger ``trainer.logger`` adds, all
    with the launch's one version: TensorBoard's events in the same ``logs/version_N``, the W&B run named after it
    (each logger picking its own next version would put TensorBoard one past the folder the CSV log just made)."""
    version = folder.next_log_version()
    loggers: List[Logger] = [CSVLogger(folder.root, name="logs", version=version)]
    if choice == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(folder.root, name="logs", version=version))
    elif choice == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        name = f"{folder.root.name} version_{version}"
        loggers.append(WandbLogger(save_dir=str(folder.root), project="lightning_mixedfsdp", name=name))
    return loggers


def run(recipe: Recipe, checkpoint: Optional[Path] = None, command: str = "") -> Outcome:
    """Train as the recipe says, from ``checkpoint`` if given; export, plot and summarise unless a stop request
    ended the run first (then say how to continue: ``command`` with ``--resume last``)."""
    pl.seed_everything(recipe.trainer.seed, verbose=False)
    folder = run_folder(recipe)
    stop = StopRequest()
    checkpoints = RunCheckpoints(folder, recipe.trainer.checkpoint_every_n_steps, recipe.trainer.keep_checkpoints, stop)
    trainer = build_trainer(recipe, checkpoints)
    objective = objective_class(recipe)
    datamodule = objective.data(recipe)
    module = objective.from_recipe(recipe)
    rank_zero_info(storage_line(recipe))
    if checkpoint is not None:
        rank_zero_info(f"resuming from {checkpoint}")
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(checkpoint) if checkpoint is not None else None)
    steps = trainer.global_step
    if checkpoints.stopped_at is None:
        export(trainer, module, datamodule, recipe)
    outcome = Outcome(module.evaluation(None), module.evaluation(steps), steps)
    if trainer.is_global_zero:
        metrics = read_metrics(folder.logs)
        if outcome.untrained is None:  # a resumed launch: the first launch logged it
            outcome.untrained = next(iter(metrics.get(module.untrained_key, {}).values()), None)
        plot_metrics(metrics, folder.plot, f"{folder.root}: {steps} steps")
    if checkpoints.stopped_at is not None:
        outcome.stopped_by = stop
        rank_zero_info(
            f"stopped at step {steps} of {recipe.trainer.max_steps}: checkpoint {folder.last}, plot {folder.plot}\n"
            f"continue with: {command} --resume last"
        )
        return outcome
    rank_zero_info(
        f"{module.summary(outcome.untrained, outcome.trained, steps, recipe.model.pretrained is not None)}\n"
        f"checkpoint: {folder.last}\nexport: {folder.export}\nplot: {folder.plot}\nconsole log: {folder.console}"
    )
    if isinstance(datamodule, ChatCorpus) and trainer.is_global_zero:
        show_an_answer(recipe, datamodule)
    return outcome


def show_an_answer(recipe: Recipe, datamodule: ChatCorpus) -> None:
    """The first held-out question answered by the export, beside the answer the data gives."""
    found = held_out_question(recipe.data, datamodule.format)
    if found is None:
        return
    prompt, expected = found
    reference = reference_model_config(recipe.model) is not None
    answer = generate_answer(run_folder(recipe).export, prompt, datamodule.maker, trust_remote_code=reference)
    question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
    rank_zero_info(f"held-out question: {question}\nexport's answer:   {answer}\nthe data's answer: {expected}")


def export(trainer: pl.Trainer, module: Objective, datamodule: TextCorpus, recipe: Recipe) -> None:
    """``export/``: the (merged) weights, ``config.json`` (the reference model's with its code) and the tokenizer (an
    image-text model's processor), committed together; ``adapter/`` for LoRA. Every rank gathers; rank 0 writes."""
    folder = run_folder(recipe)
    strategy = trainer.strategy
    assert isinstance(strategy, MixedFSDP2Strategy) and module.model is not None
    dtype = DTYPES[recipe.output.export_dtype]

    reference = reference_model_config(recipe.model)
    chat_template = BYTE_CHAT_TEMPLATE if isinstance(datamodule, ChatCorpus) and datamodule.format == "chat" else None

    def beside_the_weights(directory: Path) -> None:
        if reference is not None:
            write_reference_config(directory, reference, dtype)
        if isinstance(datamodule, VisionCorpus):  # AutoProcessor.from_pretrained(export): tokenizer, images, template
            datamodule.processor.save_pretrained(directory)
        elif isinstance(datamodule.tokenizer, HFTokenizer):
            datamodule.tokenizer.save_pretrained(directory)
        else:
            own = datamodule.tokenizer.chat_template  # the template of the byte-level export it was read from
            write_byte_tokenizer(directory, template_text(recipe.data.chat_template) or own or chat_template)

    strategy.export_safetensors(module.model, folder.export, dtype=dtype, also_write=beside_the_weights)
    if recipe.peft.enabled:
        strategy.export_adapter(module.model, folder.adapter)


def dry_run(recipe: Recipe) -> None:
    """Print the dtype plan and per-rank memory for the recipe's model at its world size, and for each other model
    its objective holds (a teacher), as the strategy plans each child of the LightningModule; train nothing."""
    with torch.device("meta"):  # the reference model too: nothing is allocated
        models = {"model": build_model(recipe.model, recipe.peft), **objective_class(recipe).other_models(recipe)}
    world, replicate = recipe.world_size, recipe.strategy.parallelism.data_parallel_replicate_size
    config = strategy_config(recipe)
    for name, model in models.items():
        plan = plan_sharding(model, config, recipe.trainer.precision)
        muon, rest = split_for_muon(model) if name == "model" and recipe.optimizer.name == "muon" else ([], [])
        muon_names = {n for n, _ in muon}
        estimate = estimate_memory(plan, world // replicate, world, muon_names)
        if len(models) > 1:
            print(f"== {name}")
        optimizers = {n: "Muon" if n in muon_names else "AdamW" for n, _ in rest + muon} if muon else None
        print(
            format_plan(plan, optimizers=optimizers, stages=recipe_stages(model, config) if name == "model" else None)
        )
        print()
        if muon:
            print(split_lines(muon, rest))
            print()
        if config.parallelism.pipeline_parallel_size > 1:
            print("\n".join(recipe_stage_lines(recipe, config)))
        else:
            print(format_summary(plan, estimate, world, replicate, None, config.parallelism))
    print(storage_line(recipe))


def recipe_stages(model: nn.Module, config: MixedFSDPConfig) -> Optional[Dict[str, int]]:
    """Each param's pipeline stage (None without pipeline parallelism, or for a model that cannot be split)."""
    parallelism = config.parallelism
    if parallelism.pipeline_parallel_size == 1:
        return None
    num_stages = parallelism.pipeline_parallel_size * parallelism.stages_per_rank
    stages, _ = plan_stages(model, num_stages, parallelism.pipeline_split)
    return stage_of_params(model, stages) if stages is not None else None


def recipe_stage_lines(recipe: Recipe, config: MixedFSDPConfig) -> List[str]:
    """The recipe model's pipeline stages, as the strategy cuts and plans them (``stage_plans.py``)."""

    def build() -> nn.Module:
        with torch.device("meta"):
            return build_model(recipe.model, recipe.peft)

    hf = None if reference_model_config(recipe.model) else load_hf_config(recipe.model.hf_source())
    replicate = recipe.strategy.parallelism.data_parallel_replicate_size
    batch = recipe.data.batch_size
    return stage_lines(build, config, recipe.trainer.precision, recipe.world_size, replicate, hf, None, batch)


def run_folder(recipe: Recipe) -> RunFolder:
    """The recipe's run folder. Under fault tolerance each replica group is its own launch with its own folder,
    ``output.dir/replica_<id>`` (console log, metrics, plot, export), and the groups share ``output.dir/checkpoints``
    (one group writes each checkpoint): a group restarted with its command unchanged continues from the newest one,
    then heals from the live groups, and after every group died all of them resume from it."""
    settings = recipe.strategy.fault_tolerance
    return RunFolder.of(recipe.output.dir, settings.replica_id if settings is not None else None)


def quiet_known_warnings() -> None:
    """Lightning 2.6's CombinedLoader flattens the dataloaders with ``LeafSpec()``, which torch 2.13 deprecates
    (a FutureWarning, once per rank, about Lightning's code, not the user's); silenced at that call site only."""
    warnings.filterwarnings(
        "ignore",
        message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        category=FutureWarning,
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mixedfsdp.train",
        description=(__doc__ or "").replace("``", ""),  # the docstring's reST literals, as plain text
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="recipe YAML (e.g. conf/stdlib_llama.yaml); defaults apply without one")
    parser.add_argument(
        "--resume", nargs="?", const="last", help="continue from a checkpoint path, or 'last' (the newest)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the dtype plan and per-rank memory; no training")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the file")
    args = parser.parse_intermixed_args(argv)  # overrides before or after the options
    if args.resume is not None and _looks_like_override(args.resume):
        args.overrides.append(args.resume)  # `--resume trainer.max_steps=60`: --resume's value is optional
        args.resume = "last"
    quiet_known_warnings()
    missing = [name for name in RECIPE_PACKAGES if not installed(name)]
    if missing and not args.dry_run:
        print(
            f"error: the recipe runner needs {', '.join(missing)}, which the `recipes` extra installs:"
            " pip install 'lightning-mixedfsdp[recipes]' (or `pip install -e \".[recipes]\"` in a clone)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    try:
        recipe = load_recipe(args.config, args.overrides, launching=not args.dry_run)
    except RecipeError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    if args.dry_run:
        try:
            dry_run(recipe)
        except MissingPackage as missing:  # e.g. peft for LoRA: a training launch is refused by the loader instead
            print(f"error: {missing}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    folder = run_folder(recipe)
    fault_tolerant = recipe.strategy.fault_tolerance is not None
    if fault_tolerant:  # torchft's own log: a few INFO lines per step on every rank, unless the user asked for them
        os.environ.setdefault("RUST_LOG", "warn")
    continues_unasked = SLURMEnvironment.detect() or fault_tolerant
    try:
        checkpoint = resume_from(folder, args.resume, recipe.trainer.max_steps, continues_unasked)
    except RunFolderError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    keep_console(folder.root, process_rank())
    config = ["--config", args.config] if args.config else []
    command = shlex.join(["python", "-m", "lightning_mixedfsdp.train", *config, *args.overrides])
    outcome = run(recipe, checkpoint, command)
    if outcome.stopped_by is not None:
        raise SystemExit(outcome.stopped_by.exit_code)


RECIPE_PACKAGES = ("matplotlib", "transformers")
"""What the runner needs beyond the library (the run's plot; exports loaded back): the ``recipes`` extra."""


def _looks_like_override(value: str) -> bool:
    """``section.key=value`` and no such path (a checkpoint may be named ``step=50.ckpt``)."""
    return re.match(r"^[A-Za-z_]\w*\.[\w.]+=", value) is not None and not Path(value).exists()
