"""Muon on sharded params, exactly as ``torch.optim.Muon`` computes it on whole matrices.

Muon's momentum (and Nesterov's look-ahead) is elementwise: it runs on each rank's shard of the momentum buffer,
which stays sharded like its param, so checkpoints need nothing new. Only the orthogonalisation needs the whole
matrix: :func:`~lightning_mixedfsdp.apply.muon_exchange.orthogonalise` computes it once per matrix, on one owner rank
of its shard group. Weight decay and the lr adjustment (``adjust_lr_fn``, from the whole matrix's shape) apply as
torch applies them.

Two ways in:

- the user's own ``torch.optim.Muon``, set up through the strategy: :func:`install_sharded_muon` takes its step over
  (its step hooks still run around it);
- :class:`MuonWithAdamW`, one optimizer whose param groups are Muon's or AdamW's (torch's functional ``adamw``), which
  :func:`muon_with_adamw` builds from a model: Muon for the 2-D weights inside the repeated blocks, AdamW for the
  embeddings, the output head, norms, biases and keep-fp32 params. It runs the same in one process and sharded.

What Muon cannot take is refused, naming the param and the fix (:func:`muon_problems`)."""

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.optim.adamw import adamw

from lightning_mixedfsdp.apply.muon_exchange import MatrixUpdate, layout_problem, orthogonalise
from lightning_mixedfsdp.apply.step_takeover import StepAround
from lightning_mixedfsdp.compat.torch import muon_adjusted_lr
from lightning_mixedfsdp.model.tensors import local_tensor

MUON_KEY = "muon"
"""The param-group entry of :class:`MuonWithAdamW` that says which algorithm the group runs."""
MUON_DEFAULTS: Dict[str, Any] = {
    "lr": 0.02,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": (3.4445, -4.775, 2.0315),
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
}
"""``torch.optim.Muon``'s options (its defaults, but the lr: 0.02, Keller Jordan's and Moonlight's)."""
FOREIGN_OPTIONS = ("amsgrad", "betas", "maximize", "dampening", "foreach", "fused", "capturable", "differentiable")
"""Options of other optimizers that Muon does not have: a Muon group that sets one is refused (torch ignores it)."""


Orthogonalise = Callable[[Sequence[MatrixUpdate]], List[Tensor]]
"""Each update's local rows of its whole matrix's orthogonalisation (:func:`orthogonalise`; ``benchmarks/muon.py``
passes the naive one, every rank gathering every matrix)."""


def muon_update(
    optimizer: Optimizer, groups: Iterable[Dict[str, Any]], orthogonalise: Orthogonalise = orthogonalise
) -> None:
    """One Muon step of ``groups``' params that have grads, their state in ``optimizer.state``; every matrix of every
    group orthogonalised in one exchange per (shard group, dtype)."""
    held: List[Tuple[Tensor, Dict[str, Any]]] = []
    updates: List[MatrixUpdate] = []
    for group in groups:
        momentum = group["momentum"]
        settings = (tuple(group["ns_coefficients"]), group["ns_steps"], group["eps"])
        for param in group["params"]:
            if param.grad is None:
                continue
            state = optimizer.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            grad, buffer = local_tensor(param.grad), local_tensor(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - momentum)
            rows = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            held.append((param, group))
            updates.append(MatrixUpdate(param, rows, settings))
    for (param, group), orthogonal in zip(held, orthogonalise(updates), strict=True):
        lr = float(group["lr"])
        adjusted = muon_adjusted_lr(lr, group["adjust_lr_fn"], param.shape)
        value = local_tensor(param)
        value.mul_(1 - lr * group["weight_decay"])
        value.add_(orthogonal, alpha=-adjusted)


def muon_problems(optimizer: Optimizer, names: Dict[int, str], muon_groups: Sequence[Dict[str, Any]]) -> List[str]:
    """What Muon cannot take in ``muon_groups`` (of ``optimizer``; ``names``: params by identity): a param that is
    not 2-D (an expert stack too), one split along more than its rows, an option Muon lacks, a param in two groups."""
    problems = []
    seen: Dict[int, int] = {}
    for index, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) in seen and seen[id(param)] != index:
                problems.append(
                    f"{_name(param, names)} is in param groups {seen[id(param)]} and {index}; give each param one group"
                )
            seen.setdefault(id(param), index)
    for group in muon_groups:
        foreign = [option for option in FOREIGN_OPTIONS if group.get(option)]
        if foreign:
            problems.append(
                f"a Muon param group sets {', '.join(f'{o}={group[o]!r}' for o in foreign)}, which Muon does not have;"
                " remove it (or give those params to AdamW)"
            )
        for param in group["params"]:
            if param.ndim != 2:
                what = "an expert stack (one matrix per expert)" if param.ndim == 3 else f"{param.ndim}-D"
                problems.append(
                    f"{_name(param, names)} {tuple(param.shape)} is {what}: Muon orthogonalises 2-D weights; give it"
                    " to AdamW (lightning_mixedfsdp.muon_with_adamw does)"
                )
            elif layout_problem(param) is not None:
                problems.append(
                    f"{_name(param, names)}: {layout_problem(param)}, and Muon needs each matrix whole on one rank;"
                    " give it to AdamW, or shard it by rows only (no tensor parallelism)"
                )
    return problems


def _name(param: Tensor, names: Dict[int, str]) -> str:
    return repr(names.get(id(param), f"a {tuple(param.shape)} param"))


def install_sharded_muon(optimizer: Optimizer, names: Dict[int, str], bf16_updates: str, owner: str) -> bool:
    """Make ``optimizer`` (a ``torch.optim.Muon``, or a subclass that keeps its step, or a :class:`MuonWithAdamW`)
    compute each matrix's update whole; False for any other optimizer. Raises, naming ``owner``, what Muon cannot
    take."""
    if isinstance(optimizer, MuonWithAdamW):
        groups = [g for g in optimizer.param_groups if g[MUON_KEY]]
    elif isinstance(optimizer, torch.optim.Muon) and type(optimizer).step is torch.optim.Muon.step:
        groups = list(optimizer.param_groups)  # torch's math: a subclass with a step of its own is not taken over
    else:
        return False
    problems = muon_problems(optimizer, names, groups)
    if bf16_updates != "nearest":
        problems.append(
            f"dtypes.bf16_updates={bf16_updates!r} writes AdamW's, Adam's and SGD's updates, not Muon's (whose"
            " update is orthogonalised over the whole matrix); set bf16_updates='nearest', or keep fp32 masters"
            " (precision='bf16-mixed')"
        )
    if problems:
        kind = type(optimizer)
        raise ValueError(f"{owner}: {kind.__module__}.{kind.__name__}: " + "; ".join(problems))
    if not isinstance(optimizer, MuonWithAdamW) and not getattr(optimizer, "_mixed_fsdp_muon", False):
        optimizer._mixed_fsdp_muon = True  # type: ignore[attr-defined]
        # the class's step over no params (its hooks still run), then Muon over every group
        StepAround(optimizer, keep=lambda _: False, after=lambda o: muon_update(o, o.param_groups))
    return True


class MuonWithAdamW(Optimizer):
    """One optimizer whose param groups run Muon (``group["muon"]`` true: ``torch.optim.Muon``'s math, each matrix
    orthogonalised whole, sharded or not) or AdamW (torch's functional ``adamw``). Automatic optimization, gradient
    clipping, LR schedulers (each group's ``lr``) and checkpoints work as with any optimizer: a Muon param's state is
    its ``momentum_buffer``, an AdamW param's ``step``, ``exp_avg`` and ``exp_avg_sq``."""

    def __init__(self, param_groups: List[Dict[str, Any]], orthogonalise: Orthogonalise = orthogonalise) -> None:
        self.orthogonalise = orthogonalise
        groups = [{**({**MUON_DEFAULTS} if g.get(MUON_KEY) else {}), **g} for g in param_groups]
        for group in groups:
            group.setdefault(MUON_KEY, False)
            if not group[MUON_KEY]:
                group.setdefault("betas", (0.9, 0.95))
                group.setdefault("eps", 1e-8)
                group.setdefault("weight_decay", 0.01)
        super().__init__(groups, defaults={"lr": MUON_DEFAULTS["lr"]})

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group[MUON_KEY]:
                self._adamw(group)
        muon_update(self, [group for group in self.param_groups if group[MUON_KEY]], self.orthogonalise)
        return loss

    def _adamw(self, group: Dict[str, Any]) -> None:
        params, grads, first, second, steps = [], [], [], [], []
        for param in group["params"]:
            if param.grad is None:
                continue
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            params.append(param)
            grads.append(param.grad)
            first.append(state["exp_avg"])
            second.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if params:
            beta1, beta2 = group["betas"]
            adamw(
                params, grads, first, second, [], steps, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            )  # fmt: skip


def muon_with_adamw(
    model: nn.Module,
    lr: float = 0.02,
    adamw_lr: float = 3e-4,
    weight_decay: float = 0.1,
    adjust_lr_fn: Optional[str] = None,
    momentum: float = 0.95,
    adamw_betas: Tuple[float, float] = (0.9, 0.95),
    adamw_weight_decay: Optional[float] = None,
) -> MuonWithAdamW:
    """One optimizer for ``model``: Muon (``lr``, ``momentum``, ``weight_decay``, ``adjust_lr_fn``: ``original`` or
    ``match_rms_adamw``) for the trainable 2-D weights inside the repeated blocks, AdamW (``adamw_lr``,
    ``adamw_betas``, ``adamw_weight_decay``, default ``weight_decay``) for the rest: embeddings, the output head,
    norms, biases, expert stacks and the params the default keep-fp32 rules pin. Build it from the set-up model
    (``fabric.setup_module`` first, or in ``configure_optimizers``) or from the plain one."""
    muon, rest = split_for_muon(model)
    decay = weight_decay if adamw_weight_decay is None else adamw_weight_decay
    groups: List[Dict[str, Any]] = []
    if muon:
        groups.append(
            {
                "params": [p for _, p in muon], MUON_KEY: True, "lr": lr, "momentum": momentum,
                "weight_decay": weight_decay, "adjust_lr_fn": adjust_lr_fn,
            }
        )  # fmt: skip
    if rest:
        adamw_params = [p for _, p in rest]
        groups.append(
            {"params": adamw_params, MUON_KEY: False, "lr": adamw_lr, "betas": adamw_betas, "weight_decay": decay}
        )
    optimizer = MuonWithAdamW(groups)
    optimizer.muon_names = [n for n, _ in muon]  # type: ignore[attr-defined]
    optimizer.adamw_names = [n for n, _ in rest]  # type: ignore[attr-defined]
    return optimizer


def split_for_muon(model: nn.Module) -> Tuple[List[Tuple[str, Tensor]], List[Tuple[str, Tensor]]]:
    """The trainable params Muon takes (2-D, inside a repeated block, not an embedding or head, not pinned fp32 by
    the default keep-fp32 rules) and the rest, by canonical name."""
    from lightning_mixedfsdp.config import MixedFSDPConfig
    from lightning_mixedfsdp.model.names import canonical_name, unwrap_model
    from lightning_mixedfsdp.planning.planner import plan_sharding

    model = unwrap_model(model)  # Fabric's wrapper, a compiled module: the names the plan gives
    plan = plan_sharding(model, MixedFSDPConfig(), "32-true")
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            embeddings.add(id(module.weight))
    muon: List[Tuple[str, Tensor]] = []
    rest: List[Tuple[str, Tensor]] = []
    for raw_name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        name = canonical_name(raw_name)
        planned = plan.params.get(name)
        in_block = any(name.startswith(unit + ".") for unit in plan.units)
        pinned = planned is not None and planned.rule is not None
        takes = param.ndim == 2 and in_block and not pinned and id(param) not in embeddings
        (muon if takes else rest).append((name, param))
    return muon, rest


def split_lines(muon: Sequence[Tuple[str, Tensor]], rest: Sequence[Tuple[str, Tensor]]) -> str:
    """The dry run's words for a split: each optimizer's counts and its state per element (the report's optimizer
    column names each param's)."""
    return (
        f"optimizer: Muon for {len(muon)} matrices ({_millions([p for _, p in muon])} params, 1 state each: the"
        f" momentum buffer); AdamW for {len(rest)} tensors ({_millions([p for _, p in rest])} params, 2 states each)"
    )


def split_summary(optimizer: MuonWithAdamW) -> str:
    """What the console says of the split: ``Muon: 24 matrices, 3.1M params; AdamW: 18 tensors, 0.4M``."""
    muon = [p for g in optimizer.param_groups if g[MUON_KEY] for p in g["params"]]
    rest = [p for g in optimizer.param_groups if not g[MUON_KEY] for p in g["params"]]
    return f"Muon: {len(muon)} matrices, {_millions(muon)} params; AdamW: {len(rest)} tensors, {_millions(rest)} params"


def _millions(params: Sequence[Tensor]) -> str:
    return f"{sum(p.numel() for p in params) / 1e6:.1f}M"
