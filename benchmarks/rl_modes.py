"""A GRPO step's time in each generation mode, the recipe (``conf/comparison_grpo.yaml``) run through the runner on 2
trainer ranks: colocated (``rl.generation: gathered``), on a generator rank (``ranks``, 1 generator) and one step
stale (``ranks`` with ``rl.max_staleness: 1``). Median step time over the steps after the first (the slower
rank's), from a callback around each training batch.

    python -m benchmarks.rl --modes --warm-start runs/comparison_warm_start/export

On 2 shared CPU cores the generator process competes with the trainers for the same cores, so the overlap cannot
show a speed-up here: what it measures is the sync and hand-off's cost. Figures, never asserted."""

import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence

MODES = {
    "colocated (gathered)": ["rl.generation=gathered"],
    "generator rank": ["rl.generation=ranks", "rl.generator_ranks=1"],
    "generator rank, one step stale": ["rl.generation=ranks", "rl.generator_ranks=1", "rl.max_staleness=1"],
}


def _timed(rank: int, world: int, overrides: List[str]) -> List[float]:
    import lightning.pytorch as pl

    from lightning_mixedfsdp.recipes.objectives.registry import objective_class
    from lightning_mixedfsdp.recipes.run import runner
    from lightning_mixedfsdp.recipes.run.checkpoints import RunCheckpoints
    from lightning_mixedfsdp.recipes.run.loader import load_recipe
    from lightning_mixedfsdp.recipes.run.stopping import StopRequest

    recipe = load_recipe("conf/comparison_grpo.yaml", overrides, launching=False)
    times: List[float] = []

    class StepTimes(pl.Callback):
        def on_train_batch_start(self, *_: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *_: Any) -> None:
            times.append(time.perf_counter() - self.start)

    trainer = runner.build_trainer(recipe, RunCheckpoints(runner.run_folder(recipe), 0, 1, StopRequest()))
    trainer.callbacks.append(StepTimes())
    objective = objective_class(recipe)
    trainer.fit(objective.from_recipe(recipe), datamodule=objective.data(recipe))
    return times


def generation_modes(warm_start: str, steps: int, out: Path, extra: Sequence[str] = ()) -> Dict[str, float]:
    from lightning_mixedfsdp.testing import run_distributed

    medians = {}
    for name, overrides in MODES.items():
        folder = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
        common = [f"model.pretrained={warm_start}", f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}",
                  "trainer.checkpoint_every_n_steps=0", f"output.dir={folder}", *extra]  # fmt: skip
        ranks = run_distributed(_timed, 2, [*common, *overrides], timeout=3600)
        medians[name] = statistics.median(max(rank[i] for rank in ranks) for i in range(1, steps))
    first = next(iter(medians.values()))
    print(f"GRPO step time, 2 trainer ranks (gloo, CPU), {steps} steps, median of steps 2 onwards (the slower rank's)")
    print("| generation | step s | vs colocated |")
    print("|---|---|---|")
    for name, seconds in medians.items():
        print(f"| {name} | {seconds:.3f} | {seconds / first:.2f}x |")
    return medians
