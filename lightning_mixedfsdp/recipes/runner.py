"""The recipe runner: ``python -m lightning_mixedfsdp.train --config conf/<recipe>.yaml key.sub=value ...``.

Launches ``trainer.devices`` processes itself (Lightning re-runs this command in each), prints the dtype report,
trains with a progress bar, reports held-out perplexity before and after, saves checkpoints, and exports the weights
under ``output.dir``: ``export/`` (safetensors, HF ``config.json``, tokenizer files; ``from_pretrained`` loads it)
and, with LoRA, ``adapter/`` (PEFT's format). ``--resume last`` continues from the last checkpoint with the same
data stream; ``--dry-run`` prints the plan and the per-rank memory and trains nothing.
"""

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

import lightning_mixedfsdp  # noqa: F401  registers "mixed_fsdp2"
from lightning_mixedfsdp.config import MixedFSDPConfig
from lightning_mixedfsdp.recipes.data import HFTokenizer, TextCorpus
from lightning_mixedfsdp.recipes.lm import CausalLM, build_hf_model
from lightning_mixedfsdp.recipes.loader import load_recipe
from lightning_mixedfsdp.recipes.schema import Recipe, RecipeError
from lightning_mixedfsdp.strategies.trainer import MixedFSDP2Strategy

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def strategy_config(recipe: Recipe) -> MixedFSDPConfig:
    """The recipe's strategy section, plus what its model needs: a pretrained directory is loaded into the shards
    (no random init, except LoRA adapters) with the fp32 tensors of a mixed-dtype checkpoint kept fp32."""
    config = recipe.mixed_fsdp_config()
    if recipe.model.pretrained is not None:
        from lightning_mixedfsdp.recipes.inputs import checkpoint_fp32_patterns

        config.keep_fp32_params = [*config.keep_fp32_params, *checkpoint_fp32_patterns(recipe.model.pretrained)]
        config.init_meta_params = recipe.peft.enabled
    return config


def build_trainer(recipe: Recipe) -> pl.Trainer:
    output = Path(recipe.output.dir)
    kwargs = recipe.strategy_kwargs()
    kwargs["config"] = strategy_config(recipe)
    every = recipe.trainer.checkpoint_every_n_steps or None
    checkpoints = ModelCheckpoint(
        dirpath=output / "checkpoints", save_last=True, save_top_k=-1 if every else 0, every_n_train_steps=every
    )
    return pl.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        num_nodes=recipe.trainer.num_nodes,
        strategy=MixedFSDP2Strategy(**kwargs),
        precision=recipe.trainer.precision,  # type: ignore[arg-type]  # a flag the schema checked
        max_steps=recipe.trainer.max_steps,
        max_epochs=1,  # the training stream holds exactly max_steps optimizer steps
        accumulate_grad_batches=recipe.trainer.accumulate_grad_batches,
        gradient_clip_val=recipe.trainer.gradient_clip_val or None,
        val_check_interval=recipe.trainer.val_check_interval,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,  # the whole held-out set before training: the untrained perplexity
        log_every_n_steps=recipe.trainer.log_every_n_steps,
        logger=CSVLogger(output, name="logs"),
        callbacks=[checkpoints],
        use_distributed_sampler=False,  # the data module shards its own resumable stream
        enable_model_summary=False,
    )


def build_module(recipe: Recipe) -> CausalLM:
    optim = recipe.optimizer
    return CausalLM(
        recipe.model,
        optim.lr,
        optim.weight_decay,
        list(optim.betas),
        optim.warmup_steps,
        recipe.trainer.max_steps,
        peft=recipe.peft,
    )


def run(recipe: Recipe, resume: Optional[str] = None) -> Dict[str, Optional[float]]:
    """Train as the recipe says; return the held-out perplexity before and after training."""
    pl.seed_everything(recipe.trainer.seed, verbose=False)
    output = Path(recipe.output.dir)
    trainer = build_trainer(recipe)
    micro_batches = recipe.trainer.max_steps * recipe.trainer.accumulate_grad_batches
    datamodule = TextCorpus(recipe.data, recipe.trainer.seed, micro_batches)
    module = build_module(recipe)
    trainer.fit(module, datamodule=datamodule, ckpt_path=_checkpoint_path(output, resume))
    export(trainer, module, datamodule, recipe)
    before, after = module.untrained_perplexity, module.perplexities.get(f"step {trainer.global_step}")
    # a resumed run skips Lightning's sanity check, so it has no "untrained" figure
    start = f"{before:.2f} untrained" if before is not None else "resumed"
    finish = f"{after:.2f}" if after is not None else "not evaluated"
    rank_zero_info(
        f"held-out perplexity: {start} -> {finish} after {trainer.global_step} steps\n"
        f"checkpoint: {output / 'checkpoints' / 'last.ckpt'}\nexport: {output / 'export'}"
    )
    return {"untrained": before, "trained": after}


def export(trainer: pl.Trainer, module: CausalLM, datamodule: TextCorpus, recipe: Recipe) -> None:
    """``export/``: the (merged) weights, the HF config and the tokenizer files; ``adapter/`` for LoRA."""
    output = Path(recipe.output.dir)
    strategy = trainer.strategy
    assert isinstance(strategy, MixedFSDP2Strategy) and module.model is not None
    strategy.export_safetensors(module.model, output / "export", dtype=EXPORT_DTYPES[recipe.output.export_dtype])
    if recipe.peft.enabled:
        strategy.export_adapter(module.model, output / "adapter")
    if isinstance(datamodule.tokenizer, HFTokenizer) and trainer.is_global_zero:
        datamodule.tokenizer.save_pretrained(output / "export")


def _checkpoint_path(output: Path, resume: Optional[str]) -> Optional[str]:
    if resume is None:
        return None
    path = output / "checkpoints" / "last.ckpt" if resume == "last" else Path(resume)
    if not path.exists():
        raise FileNotFoundError(f"--resume {resume}: {str(path)!r} does not exist; pass a checkpoint path or 'last'.")
    return str(path)


def dry_run(recipe: Recipe) -> None:
    """Print the dtype plan and per-rank memory for the recipe's model at its world size; train nothing."""
    from lightning_mixedfsdp.recipes.dry_run import format_summary
    from lightning_mixedfsdp.recipes.models import TinyLlama
    from lightning_mixedfsdp.sharding.memory import estimate_memory
    from lightning_mixedfsdp.sharding.plan import plan_sharding

    model: nn.Module
    if recipe.model.hf_source() is None:
        with torch.device("meta"):
            model = TinyLlama(recipe.model)
    else:
        model = build_hf_model(recipe.model, recipe.peft)
    world, replicate = recipe.world_size, recipe.strategy.data_parallel_replicate_size
    plan = plan_sharding(model, strategy_config(recipe), recipe.trainer.precision)
    estimate = estimate_memory(plan, shard_ranks=world // replicate, data_parallel_ranks=world)
    print(plan.report())
    print()
    print(format_summary(plan, estimate, world, replicate, None))


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (e.g. conf/stdlib_llama.yaml); defaults apply without one")
    parser.add_argument("--resume", nargs="?", const="last", help="continue from a checkpoint path, or 'last'")
    parser.add_argument("--dry-run", action="store_true", help="print the dtype plan and per-rank memory; no training")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the file")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.config, args.overrides)
    except RecipeError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    if args.dry_run:
        dry_run(recipe)
        return
    run(recipe, resume=args.resume)


if __name__ == "__main__":
    main()
