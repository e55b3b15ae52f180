"""Recipe files: a structured schema, OmegaConf merging (schema < YAML file < dotlist overrides), all problems at
once, each with its fix."""

import difflib
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lightning_mixedfsdp.config import MixedFSDPConfig, StorageChoice, flat_names, group_classes, precision_problem
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlamaConfig
from lightning_mixedfsdp.strategies.intake import STRATEGY_NAME


class RecipeError(ValueError):
    """Every problem of a recipe (file and overrides), listed together."""


@dataclass
class TrainerSection:
    accelerator: str = "cpu"
    """Lightning accelerator: ``cpu``, ``gpu``/``cuda`` or ``auto``."""
    devices: int = 2
    """Processes per node; the runner launches them itself."""
    num_nodes: int = 1
    """Nodes; launch the same command on each (torchrun, SLURM)."""
    precision: str = "bf16-true"
    """``bf16-true``, ``bf16-mixed`` or ``32-true``; keep-fp32 params stay fp32 in every case."""
    max_steps: int = 250
    """Optimizer steps to train for."""
    accumulate_grad_batches: int = 1
    """Micro-batches per optimizer step; gradients are reduced once per step."""
    gradient_clip_val: float = 1.0
    """Global gradient-norm clip; 0 turns clipping off."""
    val_check_interval: int = 125
    """Training batches between held-out evaluations."""
    checkpoint_every_n_steps: int = 50
    """Save ``checkpoints/step=N.ckpt`` every N optimizer steps, so a killed run loses at most N steps; 0: only
    ``last.ckpt`` (at the end, and when SIGINT/SIGTERM stops the run)."""
    keep_checkpoints: int = 2
    """The newest numbered checkpoints kept (older ones are deleted as new ones are written); ``last.ckpt`` is kept
    besides them."""
    log_every_n_steps: int = 10
    """Steps between logged training losses (CSV under ``output.dir/logs``)."""
    seed: int = 1234
    """Seeds the model's init and the data order."""
    logger: str = "csv"
    """Where the metrics go besides ``logs/version_N/metrics.csv`` (which the plot reads): ``csv`` (only there),
    ``tensorboard`` (``logs/``; needs ``tensorboard``) or ``wandb`` (needs ``wandb``; offline unless you log in)."""


@dataclass
class StrategySection(MixedFSDPConfig):
    """``MixedFSDPConfig`` plus the strategy's checkpoint format (every parallel degree is in ``parallelism``; the
    flat keys ``strategy.data_parallel_size`` and ``strategy.data_parallel_replicate_size`` reach it)."""

    name: str = STRATEGY_NAME
    """The Lightning strategy; recipes train with ``mixed_fsdp2``."""
    save_distributed_checkpoint: bool = True
    """Checkpoints as torch DCP folders (each rank writes its shards); ``False``: one file gathered on rank 0."""


@dataclass
class ModelSection(TinyLlamaConfig):
    """The reference byte-level Llama (``TinyLlamaConfig``) with the main job's sizes, unless ``hf_config`` or
    ``pretrained`` names a Hugging Face model."""

    dim: int = 128
    n_layers: int = 4
    hidden_dim: int = 384
    mixer_layers: List[int] = field(default_factory=lambda: [1])
    hf_config: Optional[Any] = None
    """An HF model built from config: a local ``config.json``, a directory holding one, or inline fields with
    ``model_type``. Built on the meta device and initialised by HF's own init, one wrap unit at a time."""
    pretrained: Optional[str] = None
    """A local HF model directory (``config.json`` and safetensors, one file or sharded with an index) to fine-tune.
    Rank 0 streams the weights into the shards; the tensors a mixed-dtype checkpoint holds in fp32 stay exact. An
    image-text model (any ``AutoModelForImageTextToText`` architecture: Llava, Qwen2-VL, Gemma 3, ...) is built and
    loaded the same way, with its processor."""
    trust_remote_code: bool = False
    """Let transformers run the Python code a ``model.pretrained`` (or ``model.hf_config``) folder ships (an
    ``auto_map`` in its ``config.json`` for a model type transformers does not know) to build the model; without it
    such a folder is refused before launch. This project's own exports load without it."""
    freeze: Optional[List[str]] = None
    """Regular expressions searched in parameter names: the matching params are frozen before the plan (no grad, no
    optimizer state, held at the compute dtype), e.g. ``[embed_tokens, "layers\\.[0-3]\\."]``. None: an image-text
    model's vision tower (``vision_tower``, ``vision_model``; Qwen's ``visual`` but its merger, the projector), nothing
    for other models; ``[]``: nothing."""

    def hf_source(self) -> Optional[Any]:
        """The HF config source: ``hf_config``, or the ``pretrained`` directory's config; None for the reference
        model."""
        return self.hf_config if self.hf_config is not None else self.pretrained


@dataclass
class DataSection:
    files: List[str] = field(default_factory=list)
    """One path or a list of paths, globs or directories: every text file (``.txt``, ``.py``, ``.md``, ... any
    UTF-8 text) is a document, a ``.jsonl`` file a document per line; empty: the Python standard library's source."""
    text_field: str = "text"
    """The field of each jsonl line that holds its text."""
    tokenizer: str = "bytes"
    """``bytes`` (vocabulary 256), or a local HF tokenizer directory (a run's ``export/`` too: the byte-level one is
    the byte tokenizer)."""
    trust_remote_code: bool = False
    """Let transformers run the Python code a ``data.tokenizer`` directory ships (an ``auto_map`` in its
    ``config.json`` or ``tokenizer_config.json``) to load it; without it such a directory is refused before launch.
    This project's own exports load without it."""
    seq_len: int = 128
    """Tokens per training window; text is packed into windows of this length."""
    batch_size: int = 8
    """Windows per device per micro-batch."""
    held_out_every: int = 10
    """Every n-th document is held out for evaluation (never trained on)."""
    max_bytes: int = 4_000_000
    """Cap on the text read for training (and again for the held-out split)."""
    val_windows: int = 64
    """Held-out windows (fine-tuning: held-out rows) evaluated for the perplexity."""
    format: Optional[str] = None
    """``text`` (continued pre-training: the loss on every token), ``chat`` (each ``.jsonl`` line holds ``messages``,
    a list of ``{role, content}``; the loss on the assistant turns), ``instruction`` (``prompt`` and
    ``completion``; the loss on the completion), ``preference`` (``prompt``, ``chosen`` and ``rejected``: text, or
    a list of messages ending with a user turn and one assistant message each; preference tuning) or ``vision``
    (``messages`` with image parts and ``images``, trl's vision format; an image-text model) or ``prompts``
    (``prompt``: text, or messages ending with a user turn, and the fields the reward reads; ``objective: grpo``).
    None: detected from the first ``.jsonl`` line's fields (text files: ``text``). Without ``data.files``, ``chat``,
    ``instruction`` and ``preference`` train on questions about the standard library's functions answered by their
    docstrings (a preference pair's rejected answer: the same words in reverse order); ``vision`` on generated
    coloured shapes (``conf/shapes_vlm.yaml``)."""
    packing: bool = True
    """Fine-tuning: pack several conversations into each row of ``seq_len`` tokens, positions restarting at each and
    attention never crossing one; False: one conversation per row, padded (labelled -100). Context parallelism
    trains unpacked."""
    too_long: str = "truncate"
    """Fine-tuning: a conversation longer than ``seq_len`` is cut to it (``truncate``), left out (``drop``), or
    refused before launch (``error``); the count is reported."""
    chat_template: Optional[str] = None
    """A Jinja chat template (its text, or a file holding it) in place of the tokenizer's; the byte tokenizer's is
    ``<|role|>\\n{content}<|end|>\\n`` per message."""


@dataclass
class PeftSection:
    enabled: bool = False
    """Train LoRA adapters (peft) on a frozen base instead of the whole model; HF models only."""
    r: int = 8
    """LoRA rank."""
    alpha: int = 16
    """LoRA scaling numerator (``lora_alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapters' input."""
    target_modules: List[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    """Module names that get adapters."""

    def lora_arguments(self) -> Optional[Dict[str, Any]]:
        """``peft.LoraConfig``'s arguments when adapters are enabled (None otherwise)."""
        if not self.enabled:
            return None
        return dict(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules)
        )


@dataclass
class TeacherSection:
    pretrained: Optional[str] = None
    """A frozen teacher to distil from: a local HF model directory or one of this project's exports (its tokenizer
    must be the data's). Set, the recipe distils (``objective: distillation``); the teacher is sharded at its storage
    dtype, frozen, and left out of checkpoints and exports (it is read from here again on resume)."""
    quantize: str = "none"
    """``nf4``: the teacher's Linear weights in 4 bits (torchao's NF4, as ``strategy.quantize_base``); ``none``: at
    the storage dtype."""
    offload: str = "none"
    """``cpu``: the teacher's shards in host memory between its forwards (``strategy.memory.offload_frozen``; the
    student and its optimizer states stay on the device); ``none``: on the device."""


@dataclass
class DistillSection:
    loss: str = "forward_kl"
    """The divergence of the student's token distribution from the teacher's: ``forward_kl`` (KL(teacher ||
    student)), ``reverse_kl`` (KL(student || teacher)) or ``jsd`` (Jensen-Shannon), over the tokenizer's tokens."""
    temperature: float = 1.0
    """Both models' logits are divided by it before the softmax; the divergence is multiplied by its square."""
    weight: float = 0.5
    """The divergence's share of the loss, the labels' cross-entropy the rest: ``1`` distils only, ``0`` trains on
    the labels alone (the teacher still runs: its held-out perplexity is still reported)."""
    chunk_tokens: int = 1024
    """Tokens whose logits the loss makes at once: no step holds either model's logits for more of them."""


@dataclass
class PreferenceSection:
    reference: Optional[str] = None
    """What the policy's log-probabilities are compared with: ``copy``, a frozen copy of the starting weights
    (``model.pretrained``), sharded at its storage dtype beside the policy and left out of checkpoints and exports;
    ``adapters_off`` (with peft), the policy's own base with its adapters disabled, no second model;
    ``precomputed``, the starting weights' scores of every pair, computed in one pass before training and stored in
    the run folder (``reference_log_probs.pt``), no reference model in training. Unset: ``adapters_off`` with peft,
    ``copy`` without."""
    reference_quantize: str = "none"
    """``nf4``: the ``copy`` reference's Linear weights in 4 bits; ``none``: at the storage dtype."""
    reference_offload: str = "none"
    """``cpu``: the ``copy`` reference's shards in host memory between its forwards; ``none``: on the device."""
    loss: str = "sigmoid"
    """``sigmoid`` (DPO: ``-log sigmoid(beta x margin)`` of the summed log-probability ratios) or ``ipo`` (IPO:
    ``(margin - 1 / (2 beta))**2`` of the per-token mean log-probability ratios)."""
    beta: float = 0.1
    """How far the policy may move from the reference (DPO's beta; IPO's regularisation)."""
    sft_weight: float = 0.0
    """Adds this times the chosen answer's negative log-likelihood (per token) to the loss; 0: off."""


@dataclass
class RlSection:
    reward: Any = "exact_match"
    """The verifiable reward: ``exact_match`` (1 where the line's ``answer`` equals the completion's last word or
    number, case-folded), ``path/to/file.py:function`` or ``package.module:function`` (called as
    ``function(prompts, completions, records) -> list[float]``), or a list of ``{function, weight}`` summed."""
    prompts_per_step: int = 4
    """Prompts each rank samples completions for per optimizer step."""
    group_size: int = 8
    """Completions sampled per prompt; advantages are normalised within each prompt's group (2 at least)."""
    temperature: float = 1.0
    """Sampling temperature; the log-probs (generator's and training's) are of the logits over it."""
    top_p: float = 1.0
    """Nucleus sampling: tokens outside the smallest set of this probability are not drawn (1: off)."""
    max_new_tokens: int = 32
    """Tokens a completion may have (its end marker included)."""
    loss: str = "grpo"
    """``grpo`` (each completion's token mean, advantages over the group's std), ``dr_grpo`` (no std; the token sum
    over completions x max_new_tokens) or ``dapo`` (the token mean over the step's completion tokens)."""
    clip: float = 0.2
    """PPO's clip: the probability ratio to the generator's is clipped below at ``1 - clip``."""
    clip_high: Optional[float] = None
    """The clip above, at ``1 + clip_high`` (DAPO's clip-higher, e.g. 0.28); unset: ``clip``."""
    updates_per_rollout: int = 1
    """Optimizer steps on each rollout (PPO epochs); new rollouts every this many steps."""
    beta: float = 0.0
    """Weight of a k3 KL penalty to a frozen reference; 0: no reference held."""
    reference: Optional[str] = None
    """With ``beta`` > 0, the reference: ``copy`` (a frozen copy of ``model.pretrained``) or ``adapters_off`` (peft:
    the policy's base); unset: ``adapters_off`` with peft, ``copy`` without."""
    disable_dropout: bool = True
    """Run the policy in eval mode in every RL forward (sampling, the trainer's log-probs, the reference, the trained
    forward; on generator ranks too): with dropout on, each of mu, pi_old and pi_theta would see its own dropout mask
    (LoRA's, attention's), and the ratios would measure the masks (trl's ``disable_dropout``, verl's eval-mode
    log-probs). False keeps the model's modes as Lightning sets them."""
    fp32_head: bool = True
    """Compute the output head's matmul and the logits in fp32 (its storage stays bf16): the model's output
    embedding is added to ``strategy.dtypes.fp32_compute_modules``. False: the head computes in the bulk dtype."""
    generation: str = "gathered"
    """How rollouts decode: ``gathered`` (each unit all-gathered once per rollout and held until it ends: faster,
    the whole model's params in the compute dtype on every rank), ``sharded`` (FSDP's all-gathers at every
    decoding step: the memory of training) or ``ranks`` (on ``generator_ranks`` processes of their own, fed the
    weights after every optimizer step; held-out evaluation stays on the trainers, gathered)."""
    generator_ranks: int = 0
    """With ``generation: ranks``: the generator processes started beside the trainers (``trainer.devices`` counts
    the trainers); each holds the policy whole and serves whole trainer ranks' rollouts (1 to the trainers' count)."""
    max_staleness: int = 0
    """``0``: each rollout is sampled with the current weights; ``1`` (generator ranks): the next rollout is sampled
    while the trainers train on this one, with the weights one step older."""
    sync_bucket_mb: float = 64.0
    """The weights travel to the generator ranks in buckets of this many MiB (a larger tensor alone)."""
    verify_sync: bool = False
    """After every weight sync each generator hashes its params (SHA-256 of their bytes) and trainer rank 0 compares
    the hash with what it sent; a difference raises on every trainer rank. Costs a pass over the weights on both."""
    correction: str = "none"
    """The off-policy correction of every rollout (``rl/corrections.py``): ``none`` (PPO's ratio against the
    generator's log-probs), ``tis`` (the trainer's over the generator's probability, truncated into the bounds),
    ``mis`` (tokens whose weight is outside the bounds rejected) or ``icepop`` (``mis`` per token, [0.5, 5])."""
    correction_level: str = "token"
    """Whose weight a correction bounds: each ``token``'s, the completion's product (``sequence``) or its geometric
    mean (``geometric``)."""
    correction_bounds: Optional[List[float]] = None
    """``[low, high]`` with ``0 <= low <= 1 < high``; unset: [0, 2] for ``tis`` at every level and for ``mis`` per
    token and per sequence, [0.999, 1.001] for ``mis`` at the ``geometric`` level (verl's), [0.5, 5] for ``icepop``
    (Ring-1T's)."""
    mismatch_limit: Optional[float] = None
    """The largest ``logprob_mismatch`` a launch's first rollout may have: above it every rank raises, naming the
    model class and the value, since the rollouts are then not the trained policy's samples (a cache that decodes
    differently from the model's forward). Unset: 1e-3 under ``trainer.precision: 32-true``, 1e-2 otherwise (bf16
    kernels round differently one token at a time than over the sequence: 5e-5 to 5e-4 measured)."""


@dataclass
class OptimizerSection:
    name: str = "adamw"
    """``adamw`` (every trainable param), or ``muon``: one optimizer (``lightning_mixedfsdp.muon_with_adamw``) with
    Muon for the 2-D weights inside the repeated blocks, each orthogonalised whole on its owner rank, and AdamW for
    the embeddings, the output head, norms, biases and keep-fp32 params."""
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.01
    """Weight decay (AdamW's and, with ``name: muon``, Muon's)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    warmup_steps: int = 20
    """Linear warm-up steps, then ``schedule``."""
    schedule: str = "cosine"
    """The learning rate after the warm-up: ``cosine`` (decay to 10 % of ``lr`` at ``trainer.max_steps``), ``linear``
    (the same ends, a straight line) or ``constant`` (``lr`` until the end, as RL runs often train)."""
    muon_lr: float = 0.02
    """``name: muon``: Muon's peak learning rate (its matrices follow the same warm-up and decay)."""
    adjust_lr_fn: str = "original"
    """``name: muon``: how Muon scales its lr by a matrix's shape (``torch.optim.Muon``'s ``adjust_lr_fn``):
    ``original`` (sqrt(max(1, rows / cols)), Keller Jordan's) or ``match_rms_adamw`` (0.2 x sqrt(max(rows, cols)),
    Moonlight's, whose updates have AdamW's size: ``muon_lr`` can then be AdamW's lr)."""


@dataclass
class OutputSection:
    dir: str = "runs/stdlib_llama"
    """The run folder: checkpoints, logs, ``metrics.png``, ``console.log``, the export (``export/``) and LoRA
    adapters (``adapter/``) go here; ``--resume last`` continues the run it holds."""
    export_dtype: str = "bf16"
    """Save dtype of the export; keep-fp32 params are exported in fp32."""


@dataclass
class MonitorSection:
    every_n_steps: int = 0
    """Measure which bf16 params' updates round away every N optimizer steps (``PrecisionMonitor``: the shares in the
    CSV log as ``stalled_share/<param>``, a warning naming a stalled param with the keep-fp32 rule that keeps it, a
    summary line at the end); 0: off."""
    threshold: float = 0.5
    """A param is stalled on a sample when more than this share of its elements with a gradient did not change."""
    patience: int = 3
    """Samples in a row a param must be stalled before it is named."""


@dataclass
class Recipe:
    objective: Optional[str] = None
    """What is trained: ``language_modeling`` (text), ``sft`` (chat or instruction data), ``distillation`` (either,
    from ``teacher.pretrained``), ``preference`` (preference pairs: DPO or IPO against a frozen reference) or
    ``grpo`` (prompts: reinforcement learning with verifiable rewards); unset: the one the recipe asks for (a
    teacher: ``distillation``), else the one the data's format trains (``recipes/objectives/registry.py`` lists
    them)."""
    trainer: TrainerSection = field(default_factory=TrainerSection)
    strategy: StrategySection = field(default_factory=StrategySection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    peft: PeftSection = field(default_factory=PeftSection)
    teacher: TeacherSection = field(default_factory=TeacherSection)
    distill: DistillSection = field(default_factory=DistillSection)
    preference: PreferenceSection = field(default_factory=PreferenceSection)
    rl: RlSection = field(default_factory=RlSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    output: OutputSection = field(default_factory=OutputSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)

    def mixed_fsdp_config(self) -> MixedFSDPConfig:
        """The strategy section as the strategy's config, its storage as the recipe's precision names it
        (:func:`recipe_storage`)."""
        config = MixedFSDPConfig(**{f.name: getattr(self.strategy, f.name) for f in fields(MixedFSDPConfig)})
        config.dtypes = replace(config.dtypes, storage=recipe_storage(self.trainer.precision, config.dtypes.storage))
        return config

    def strategy_kwargs(self) -> Dict[str, Any]:
        return {
            "config": self.mixed_fsdp_config(),
            "save_distributed_checkpoint": self.strategy.save_distributed_checkpoint,
        }

    @property
    def world_size(self) -> int:
        return self.trainer.devices * self.trainer.num_nodes


def recipe_storage(precision: str, storage: StorageChoice) -> StorageChoice:
    """The storage a recipe trains in: ``trainer.precision: 32-true`` reads ``storage: auto`` as fp32, since the
    runner loads the model and a recipe asking for 32-true asks for fp32 params, whatever dtype the checkpoint was
    saved in. Fabric and the Trainer keep Lightning's meaning of 32-true (the model as it arrives: a user who built
    it bf16 meant bf16). Any other precision, and ``storage: keep`` (the checkpoint's dtypes), stand as given."""
    return "fp32" if precision == "32-true" and storage == "auto" else storage


def merge_recipe(path: Optional[str], overrides: Sequence[str] = ()) -> Tuple[Recipe, List[str]]:
    """Schema defaults < the YAML file < ``key.sub=value`` overrides: the merged recipe and every problem of its
    fields (the files it points at are checked by ``recipes.loader.load_recipe``).

    Each leaf is merged on its own, so a typo does not hide the next problem; the semantic checks then run on the
    valid leaves and their problems are reported in the same error.
    """
    schema = OmegaConf.structured(Recipe)
    problems: List[str] = []
    leaves: List[Tuple[str, Any]] = []
    if path is not None:
        if not Path(path).is_file():
            raise RecipeError(missing_recipe_message(path))
        values = _with_nested_strategy(OmegaConf.to_container(OmegaConf.load(path)))
        found, valid = _check_each_leaf(schema, values, source=path)
        problems += found
        leaves += valid
    for override in overrides:
        if "=" not in override:
            if override.endswith((".yaml", ".yml")) or Path(override).is_file():
                problems.append(f"override {override!r} is not key=value; did you mean `--config {override}`?")
            else:
                problems.append(f"override {override!r} is not key=value; write e.g. trainer.max_steps=100")
            continue
        try:
            layer = OmegaConf.to_container(OmegaConf.from_dotlist([override]))
        except OmegaConfBaseException as error:
            problems.append(f"override {override!r}: {_first_line(error)}")
            continue
        found, valid = _check_each_leaf(schema, _with_nested_strategy(layer), source=f"override {override!r}")
        problems += found
        leaves += valid
    merged = OmegaConf.merge(schema, *(_nested(dotted, value) for dotted, value in leaves))
    recipe = cast(Recipe, OmegaConf.to_object(merged))
    problems += validate_recipe(recipe)
    return recipe, problems


def missing_recipe_message(path: str) -> str:
    """A missing recipe file: the closest recipe name, and the recipes there are (in the folder the path names, else
    ``conf/`` here, else the ``conf/`` of this checkout)."""
    given = Path(path)
    folders = [given.parent, Path("conf"), Path(__file__).resolve().parents[2] / "conf"]
    folder = next((f for f in folders if f.is_dir() and any(f.glob("*.yaml"))), None)
    message = f"Recipe file {path!r} does not exist; pass --config conf/<recipe>.yaml"
    if folder is None:
        return message + "."
    names = sorted(p.name for p in folder.glob("*.yaml"))
    close = difflib.get_close_matches(given.name, names, n=1)
    hint = f"; did you mean {str(folder / close[0])!r}?" if close else ""
    return f"{message}{hint} Recipes in {folder}/: {', '.join(names)}."


_PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}


def recipe_spelling(problem: str) -> str:
    """A problem of the strategy's config as a recipe says it: every option by its recipe key (``float8.emulate`` ->
    ``strategy.float8.emulate``) and Python's literals as YAML's (``True`` -> ``true``, ``None`` -> ``null``), so the
    fix it gives can be copied into the recipe or onto the command line."""
    groups = "|".join(group_classes())
    spelled = re.sub(rf"(?<![\w.$])(?=(?:{groups})\.\w)", "strategy.", problem)
    spelled = re.sub(r"\b(True|False|None)\b", lambda found: _PYTHON_LITERALS[found.group(1)], spelled)
    return spelled if spelled.startswith("strategy.") else f"strategy.{spelled}"


OPTIMIZERS = ("adamw", "muon")
ADJUST_LR_FNS = ("original", "match_rms_adamw")
LR_SCHEDULES = ("cosine", "linear", "constant")


def optimizer_problems(recipe: Recipe) -> List[str]:
    """What the optimizer section asks that cannot run, each with its fix."""
    optimizer, problems = recipe.optimizer, []
    if optimizer.name not in OPTIMIZERS:
        problems.append(f"optimizer.name={optimizer.name!r} is none of {', '.join(OPTIMIZERS)}; pick one")
    if optimizer.adjust_lr_fn not in ADJUST_LR_FNS:
        problems.append(f"optimizer.adjust_lr_fn={optimizer.adjust_lr_fn!r} is none of {', '.join(ADJUST_LR_FNS)}")
    if optimizer.schedule not in LR_SCHEDULES:
        problems.append(f"optimizer.schedule={optimizer.schedule!r} is none of {', '.join(LR_SCHEDULES)}; pick one")
    if optimizer.warmup_steps < 0:
        problems.append(f"optimizer.warmup_steps={optimizer.warmup_steps} must be >= 0 (0: no warm-up)")
    if optimizer.name != "muon":
        return problems
    if recipe.strategy.dtypes.bf16_updates != "nearest":
        problems.append(
            f"optimizer.name=muon with strategy.dtypes.bf16_updates={recipe.strategy.dtypes.bf16_updates!r}: the"
            " bf16 write-back computes AdamW's updates, not Muon's; set bf16_updates=nearest or optimizer.name=adamw"
        )
    if recipe.peft.enabled:
        problems.append(
            "optimizer.name=muon with peft.enabled=true: LoRA's factors are not the weights Muon is for (untested);"
            " set optimizer.name=adamw"
        )
    if recipe.strategy.parallelism.tensor_parallel_size not in (1, "auto"):
        problems.append(
            "optimizer.name=muon with tensor parallelism: Muon needs each matrix whole on one rank, and tensor"
            " parallelism splits its columns; set optimizer.name=adamw"
        )
    return problems


def validate_recipe(recipe: Recipe) -> List[str]:
    """Semantic checks the schema's types cannot express."""
    problems = [recipe_spelling(p) for p in recipe.strategy.problems()]
    if recipe.strategy.name != STRATEGY_NAME:
        problems.append(f"strategy.name={recipe.strategy.name!r}: recipes train with {STRATEGY_NAME!r}; set it back")
    if precision_problem(recipe.trainer.precision) is not None:
        problems.append(f"trainer.{precision_problem(recipe.trainer.precision)}")
    elif recipe.strategy.bf16_updates_problem(recipe.trainer.precision) is not None:
        problems.append(recipe_spelling(str(recipe.strategy.bf16_updates_problem(recipe.trainer.precision))))
    problems += optimizer_problems(recipe)
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
    if recipe.trainer.checkpoint_every_n_steps < 0:
        problems.append(
            f"trainer.checkpoint_every_n_steps={recipe.trainer.checkpoint_every_n_steps} must be >= 0 (0: only"
            " last.ckpt)"
        )
    if recipe.trainer.keep_checkpoints < 1:
        problems.append(f"trainer.keep_checkpoints={recipe.trainer.keep_checkpoints} must be >= 1")
    if recipe.data.held_out_every < 2:
        problems.append(
            f"data.held_out_every={recipe.data.held_out_every} must be >= 2 (every n-th document is held out; 1 would"
            " leave nothing to train on)"
        )
    if recipe.data.val_windows < 1 or recipe.data.max_bytes < 1:
        problems.append("data.val_windows and data.max_bytes must be >= 1")
    problems += data_choice_problems(recipe.data, recipe.strategy.parallelism.context_parallel_size)
    monitor = recipe.monitor
    if monitor.every_n_steps < 0 or not 0 <= monitor.threshold < 1 or monitor.patience < 1:
        problems.append(
            f"monitor.every_n_steps={monitor.every_n_steps} (>= 0; 0 is off), monitor.threshold={monitor.threshold}"
            f" (in [0, 1)) and monitor.patience={monitor.patience} (>= 1): fix the one out of range"
        )
    if recipe.trainer.logger not in LOGGERS:
        problems.append(f"trainer.logger={recipe.trainer.logger!r}: use one of {', '.join(LOGGERS)}")
    betas = list(recipe.optimizer.betas)
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        problems.append(f"optimizer.betas={betas} must be two values in [0, 1), e.g. [0.9, 0.95]")
    if recipe.peft.enabled and (recipe.peft.r < 1 or not recipe.peft.target_modules):
        problems.append("peft.r must be >= 1 and peft.target_modules name at least one module when peft.enabled")
    if recipe.output.export_dtype not in ("bf16", "fp32"):
        problems.append(f"output.export_dtype={recipe.output.export_dtype!r}: use 'bf16' or 'fp32'")
    return problems  # the mesh sizes and the model under them: recipes.loader, as the strategy checks them


FORMATS = ("text", "chat", "instruction", "preference", "vision", "prompts")
TOO_LONG = ("truncate", "drop", "error")
LOGGERS = ("csv", "tensorboard", "wandb")


def data_choice_problems(data: DataSection, context_parallel: int) -> List[str]:
    """The data section's choices, and the sequence length context parallelism splits."""
    problems = []
    if data.format is not None and data.format not in FORMATS:
        problems.append(f"data.format={data.format!r}: use one of {', '.join(FORMATS)}, or leave it out to detect it")
    if data.too_long not in TOO_LONG:
        problems.append(f"data.too_long={data.too_long!r}: use one of {', '.join(TOO_LONG)}")
    if isinstance(context_parallel, int) and context_parallel > 1 and data.seq_len % (2 * context_parallel):
        problems.append(
            f"data.seq_len={data.seq_len} must divide into 2 x strategy.parallelism.context_parallel_size ="
            f" {2 * context_parallel} chunks (head-tail load balancing); use a multiple of {2 * context_parallel}"
        )
    return problems


def _with_nested_strategy(values: Any) -> Any:
    """A recipe layer with its ``strategy`` section in the nested spelling: a flat name moves into its group
    (``strategy.float8_emulate`` -> ``strategy.float8.emulate``) and a group given one value sets its main field
    (``strategy.float8: rowwise`` -> ``strategy.float8.recipe``); anything else is left for the schema to check."""
    if not isinstance(values, dict) or not isinstance(values.get("strategy"), dict):
        return values
    classes, flat = group_classes(), flat_names()
    section: Dict[str, Any] = {}
    for key, value in values["strategy"].items():
        if key in flat and key not in classes:
            group, option = flat[key]
            existing = section.get(group)
            section[group] = {**(existing if isinstance(existing, dict) else {}), option: value}
        elif (
            key in classes and classes[key].MAIN_FIELD is not None and not isinstance(value, dict) and value is not None
        ):
            existing = section.get(key)
            section[key] = {**(existing if isinstance(existing, dict) else {}), classes[key].MAIN_FIELD: value}
        elif key in classes and isinstance(value, dict) and isinstance(section.get(key), dict):
            section[key] = {**section[key], **value}
        else:
            section[key] = value
    return {**values, "strategy": section}


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
            if isinstance(value, str) and OmegaConf.is_list(node[key]):
                value = [value]  # a list field takes one value too: data.files=train.jsonl
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
