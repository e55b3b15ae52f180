"""The recipe runner: ``python -m lightning_mixedfsdp.train --config conf/<recipe>.yaml key.sub=value ...``.

Launches ``trainer.devices`` processes itself (Lightning re-runs this command in each), prints the dtype report,
trains with a progress bar, reports held-out perplexity before and after, saves a checkpoint and a safetensors
export under ``output.dir``.
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

import lightning_mixedfsdp  # noqa: F401  registers "mixed_fsdp2"
from lightning_mixedfsdp.recipes.data import StdlibCorpus
from lightning_mixedfsdp.recipes.lm import CausalLM
from lightning_mixedfsdp.recipes.schema import Recipe, RecipeError, load_recipe
from lightning_mixedfsdp.strategies.trainer import MixedFSDP2Strategy

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def run(recipe: Recipe) -> Dict[str, Optional[float]]:
    """Train as the recipe says; return the held-out perplexity before and after training."""
    pl.seed_everything(recipe.trainer.seed, verbose=False)
    output = Path(recipe.output.dir)
    trainer = pl.Trainer(
        accelerator=recipe.trainer.accelerator,
        devices=recipe.trainer.devices,
        num_nodes=recipe.trainer.num_nodes,
        strategy=MixedFSDP2Strategy(**recipe.strategy_kwargs()),
        precision=recipe.trainer.precision,
        max_steps=recipe.trainer.max_steps,
        max_epochs=1,  # the training set holds exactly max_steps optimizer steps
        accumulate_grad_batches=recipe.trainer.accumulate_grad_batches,
        gradient_clip_val=recipe.trainer.gradient_clip_val,
        val_check_interval=recipe.trainer.val_check_interval,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=-1,  # the whole held-out set before training: the untrained perplexity
        log_every_n_steps=recipe.trainer.log_every_n_steps,
        logger=CSVLogger(output, name="logs"),
        callbacks=[ModelCheckpoint(dirpath=output / "checkpoints", save_last=True, save_top_k=0)],
        enable_model_summary=False,
    )
    data = recipe.data
    world = recipe.trainer.devices * recipe.trainer.num_nodes
    samples = recipe.trainer.max_steps * recipe.trainer.accumulate_grad_batches * data.batch_size * world
    datamodule = StdlibCorpus(
        data.seq_len,
        data.batch_size,
        samples,
        data.val_windows,
        data.held_out_every,
        data.max_bytes,
        recipe.trainer.seed,
    )
    optim = recipe.optimizer
    module = CausalLM(
        recipe.model, optim.lr, optim.weight_decay, list(optim.betas), optim.warmup_steps, recipe.trainer.max_steps
    )
    trainer.fit(module, datamodule=datamodule)

    export_dir = output / "export"
    trainer.strategy.export_safetensors(module.model, export_dir, dtype=EXPORT_DTYPES[recipe.output.export_dtype])
    before, after = module.untrained_perplexity, module.perplexities.get(f"step {trainer.global_step}")
    rank_zero_info(
        f"held-out perplexity: {before:.2f} untrained -> {after:.2f} after {trainer.global_step} steps\n"
        f"checkpoint: {output / 'checkpoints' / 'last.ckpt'}\nexport: {export_dir}"
    )
    return {"untrained": before, "trained": after}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="recipe YAML (e.g. conf/stdlib_llama.yaml); defaults apply without one")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the file")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(args.config, args.overrides)
    except RecipeError as error:
        print(error, file=sys.stderr)
        raise SystemExit(2) from None
    run(recipe)


if __name__ == "__main__":
    main()
