"""Recipe files: a structured schema, OmegaConf merging (schema < YAML file < dotlist overrides), all problems at
once, each with its fix."""

import difflib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_mixedfsdp.config import MixedFSDPConfig, precision_problem
from lightning_mixedfsdp.recipes.models import TinyLlamaConfig
from lightning_mixedfsdp.strategies.mixin import STRATEGY_NAME


class RecipeError(ValueError):
    """Every problem of a recipe (file and overrides), listed together."""


@dataclass
class TrainerSection:
    accelerator: str = "cpu"
    """Lightning accelerator: ``cpu``, ``gpu``/``cuda`` or ``auto``."""
    devices: int = 2
    """Processes per node; the runner launches them itself."""
    num_nodes: int = 1
    precision: str = "bf16-true"
    """``bf16-true``, ``bf16-mixed`` or ``32-true``; keep-fp32 params stay fp32 in every case."""
    max_steps: int = 250
    accumulate_grad_batches: int = 1
    gradient_clip_val: float = 1.0
    val_check_interval: int = 125
    """Training batches between held-out evaluations."""
    log_every_n_steps: int = 10
    seed: int = 1234


@dataclass
class StrategySection(MixedFSDPConfig):
    """``MixedFSDPConfig`` plus the strategy's mesh and checkpoint options."""

    name: str = STRATEGY_NAME
    """The Lightning strategy; recipes train with ``mixed_fsdp2``."""
    data_parallel_size: Optional[int] = None
    """Ranks a param is sharded over; ``None`` = all ranks not used by replication."""
    data_parallel_replicate_size: int = 1
    """HSDP replicas (e.g. the number of nodes)."""
    save_distributed_checkpoint: bool = True


@dataclass
class ModelSection(TinyLlamaConfig):
    """The reference byte-level Llama (``TinyLlamaConfig``) with the main job's sizes."""

    dim: int = 128
    n_layers: int = 4
    hidden_dim: int = 384
    mixer_layers: List[int] = field(default_factory=lambda: [1])


@dataclass
class DataSection:
    seq_len: int = 128
    batch_size: int = 8
    """Per device."""
    held_out_every: int = 10
    """Every n-th stdlib file (sorted) is held out for evaluation."""
    max_bytes: int = 4_000_000
    """Cap on the training (and held-out) corpus size."""
    val_windows: int = 64


@dataclass
class OptimizerSection:
    lr: float = 3e-3
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 20


@dataclass
class OutputSection:
    dir: str = "runs/stdlib_llama"
    """Checkpoints, logs and the safetensors export go here."""
    export_dtype: str = "bf16"
    """Save dtype of the export; keep-fp32 params are exported in fp32."""


@dataclass
class Recipe:
    trainer: TrainerSection = field(default_factory=TrainerSection)
    strategy: StrategySection = field(default_factory=StrategySection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    output: OutputSection = field(default_factory=OutputSection)

    def strategy_kwargs(self) -> Dict[str, Any]:
        config = {f.name: getattr(self.strategy, f.name) for f in fields(MixedFSDPConfig)}
        return {
            "config": MixedFSDPConfig(**config),
            "data_parallel_size": self.strategy.data_parallel_size or "auto",
            "data_parallel_replicate_size": self.strategy.data_parallel_replicate_size,
            "save_distributed_checkpoint": self.strategy.save_distributed_checkpoint,
        }


def load_recipe(path: Optional[str], overrides: Sequence[str] = ()) -> Recipe:
    """Schema defaults < the YAML file < ``key.sub=value`` overrides; raise :class:`RecipeError` with every problem.

    Each leaf is merged on its own, so a typo does not hide the next problem; the semantic checks then run on the
    valid leaves and their problems are reported in the same error.
    """
    schema = OmegaConf.structured(Recipe)
    problems: List[str] = []
    leaves: List[Tuple[str, Any]] = []
    if path is not None:
        if not Path(path).is_file():
            raise RecipeError(f"Recipe file {path!r} does not exist; pass --config conf/<recipe>.yaml.")
        found, valid = _check_each_leaf(schema, OmegaConf.to_container(OmegaConf.load(path)), source=path)
        problems += found
        leaves += valid
    for override in overrides:
        if "=" not in override:
            problems.append(f"override {override!r} is not key=value; write e.g. trainer.max_steps=100")
            continue
        try:
            layer = OmegaConf.to_container(OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as error:
            problems.append(f"override {override!r}: {_first_line(error)}")
            continue
        found, valid = _check_each_leaf(schema, layer, source=f"override {override!r}")
        problems += found
        leaves += valid
    merged = OmegaConf.merge(schema, *(_nested(dotted, value) for dotted, value in leaves))
    recipe: Recipe = OmegaConf.to_object(merged)
    problems += validate_recipe(recipe)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise RecipeError(f"Recipe has {len(problems)} problem(s):\n{listed}")
    return recipe


def validate_recipe(recipe: Recipe) -> List[str]:
    """Semantic checks the schema's types cannot express."""
    problems = [f"strategy.{p}" for p in recipe.strategy.problems()]
    if recipe.strategy.name != STRATEGY_NAME:
        problems.append(f"strategy.name={recipe.strategy.name!r}: recipes train with {STRATEGY_NAME!r}; set it back")
    if precision_problem(recipe.trainer.precision) is not None:
        problems.append(f"trainer.{precision_problem(recipe.trainer.precision)}")
    for name in ("devices", "num_nodes", "max_steps", "accumulate_grad_batches", "val_check_interval"):
        if getattr(recipe.trainer, name) < 1:
            problems.append(f"trainer.{name}={getattr(recipe.trainer, name)} must be >= 1")
    if recipe.model.dim % recipe.model.n_heads:
        problems.append(
            f"model.dim={recipe.model.dim} is not divisible by model.n_heads={recipe.model.n_heads}; change one"
        )
    bad_layers = [i for i in recipe.model.mixer_layers if not 0 <= i < recipe.model.n_layers]
    if bad_layers:
        problems.append(f"model.mixer_layers={bad_layers} outside 0..{recipe.model.n_layers - 1}; fix the indices")
    if recipe.data.seq_len < 2 or recipe.data.batch_size < 1:
        problems.append("data.seq_len must be >= 2 and data.batch_size >= 1")
    if recipe.output.export_dtype not in ("bf16", "fp32"):
        problems.append(f"output.export_dtype={recipe.output.export_dtype!r}: use 'bf16' or 'fp32'")
    return problems


def _check_each_leaf(
    schema: Any, values: Any, source: str, prefix: str = ""
) -> Tuple[List[str], List[Tuple[str, Any]]]:
    """Problems, and the (dotted key, value) leaves that merge into the schema cleanly."""
    if not isinstance(values, dict):
        return [f"{source}: expected a mapping of sections, got {type(values).__name__}"], []
    problems: List[str] = []
    valid: List[Tuple[str, Any]] = []
    node = OmegaConf.select(schema, prefix[:-1]) if prefix else schema
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in node:
            problems.append(f"{source}: unknown key {dotted!r}{_suggest(key, node)}")
        elif isinstance(value, dict) and OmegaConf.is_dict(node[key]):
            found, good = _check_each_leaf(schema, value, source, prefix=f"{dotted}.")
            problems += found
            valid += good
        else:
            try:
                OmegaConf.merge(schema, _nested(dotted, value))
                valid.append((dotted, value))
            except OmegaConfBaseException as error:
                problems.append(f"{source}: {dotted}={value!r}: {_first_line(error)}")
    return problems, valid


def _nested(dotted: str, value: Any) -> Any:
    config = OmegaConf.create()
    OmegaConf.update(config, dotted, value, force_add=True)
    return config


def _suggest(key: str, node: Any) -> str:
    close = difflib.get_close_matches(str(key), [str(k) for k in node.keys()], n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {sorted(str(k) for k in node.keys())}"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
