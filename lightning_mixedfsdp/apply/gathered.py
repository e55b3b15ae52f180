"""Params held gathered across many forwards: generation (an RL rollout decodes token by token) runs every unit's
forward once per new token, and FSDP would all-gather each unit's params every time. Inside
:func:`gathered_params` each unit of the model is all-gathered once, kept unsharded across the forwards (no
collective per token: ranks whose completions end sooner stop without waiting for the others), and resharded at the
end. It holds the whole model's params in their compute dtype on each rank for that time: the price of the speed
(``benchmarks/rl.py`` measures both)."""

from contextlib import contextmanager
from typing import Any, Iterator, List, Tuple

from torch import nn

from lightning_mixedfsdp.compat.torch import (
    fsdp_lazy_init,
    fsdp_post_forward_mesh_infos,
    set_fsdp_post_forward_mesh_infos,
)


def fsdp_modules(module: nn.Module) -> List[nn.Module]:
    """The ``fully_shard``-ed modules in ``module``, outermost first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


@contextmanager
def gathered_params(root: nn.Module, model: nn.Module) -> Iterator[None]:
    """Every FSDP unit of ``model`` all-gathered once and kept unsharded until the block ends, then resharded and its
    reshard-after-forward setting restored. ``root``: the module FSDP's root is in (the LightningModule: FSDP's
    lazy init, which otherwise runs at the first forward, needs the root). A model FSDP does not shard: as it is."""
    roots = fsdp_modules(root)
    units = fsdp_modules(model)
    if not units:
        yield
        return
    fsdp_lazy_init(roots[0])
    saved: List[Tuple[Any, List[Any]]] = []
    try:
        for unit in units:
            saved.append((unit, fsdp_post_forward_mesh_infos(unit)))
            set_fsdp_post_forward_mesh_infos(unit, [None] * len(saved[-1][1]))
            unit.unshard()  # type: ignore[operator]
        yield
    finally:
        for unit, infos in saved:
            unit.reshard()
            set_fsdp_post_forward_mesh_infos(unit, infos)
