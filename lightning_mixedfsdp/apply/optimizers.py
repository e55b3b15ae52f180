"""Optimizers over sharded params. ``fully_shard`` registers new (DTensor) params, so an optimizer built before setup
holds tensors the model no longer uses: :func:`rebind_optimizer` points its param groups at the sharded params (its
hyperparameters kept), as FSDP1's ``use_orig_params`` did. And an optimizer that is not elementwise computes each
update from the whole matrix: on a rank's shard it would compute another update, silently, so
:func:`refuse_whole_matrix_optimizer` refuses the ones known by name."""

from typing import Dict, List, Optional

from torch import nn
from torch.optim import Optimizer

from lightning_mixedfsdp.model.names import canonical_name

WHOLE_MATRIX_OPTIMIZERS: Dict[str, str] = {
    "Muon": "orthogonalises each 2-D update over the whole matrix (Newton-Schulz)",  # torch's: apply/muon.py
    "Adafactor": "factors each matrix's second moment over its whole rows and columns",
    "Shampoo": "preconditions each matrix with statistics of the whole matrix",
    "DistributedShampoo": "preconditions each matrix with statistics of the whole matrix",
    "SOAP": "preconditions each matrix with statistics of the whole matrix",
    "GaLoreAdamW": "projects each matrix's gradient on a subspace of the whole matrix",
    "Lamb": "scales each param's update by the norm of the whole param (its trust ratio)",
    "LAMB": "scales each param's update by the norm of the whole param (its trust ratio)",
    "LARS": "scales each param's update by the norm of the whole param (its trust ratio)",
}
"""Optimizers (by class name, their subclasses too) whose update of a param depends on the whole param, not on each
element alone. Elementwise ones (SGD, Adam, AdamW, Adagrad, RMSprop, 8-bit Adams, a user's own) run on shards
unchanged; ``torch.optim.Muon`` is taken over by :func:`~lightning_mixedfsdp.apply.muon.install_sharded_muon` before
this refusal is asked (another class named Muon is still refused)."""


def params_by_identity(module: nn.Module) -> Dict[int, str]:
    """Each param of ``module`` (tied ones once) by identity, with its canonical name: what :func:`rebind_optimizer`
    maps from, taken before setup replaces them."""
    return {id(param): canonical_name(name) for name, param in module.named_parameters()}


def rebind_optimizer(
    optimizer: Optimizer, names: Dict[int, str], module: nn.Module, owner: str, other_stages: bool = False
) -> None:
    """Point ``optimizer``'s param groups at ``module``'s params of the same names (``names``: the params it held
    before setup, by identity). Params of other modules stay; frozen params that setup removed (a 4-bit base's
    weights) leave their group, and so do, with ``other_stages``, the params of other ranks' pipeline stages."""
    if optimizer.state:
        raise ValueError(
            f"{owner}: `setup(model, optimizer)` got an optimizer with state already ({type(optimizer).__name__}"
            " stepped before setup); its state belongs to the unsharded params. Set the model up first, build the"
            " optimizer from the set-up model's parameters, then call `setup_optimizers(optimizer)`."
        )
    current = {canonical_name(name): param for name, param in module.named_parameters()}
    for group in optimizer.param_groups:
        rebound: List[nn.Parameter] = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None:  # not the model's: leave it
                rebound.append(param)
            elif name in current:
                rebound.append(current[name])
            elif param.requires_grad and not other_stages:
                raise ValueError(
                    f"{owner}: the optimizer holds {name!r}, which the set-up model no longer has. Set the model up"
                    " first, build the optimizer from its parameters, then call `setup_optimizers(optimizer)`."
                )
        group["params"] = rebound


def refuse_whole_matrix_optimizer(optimizer: Optimizer, owner: str) -> None:
    """Raise when ``optimizer`` is a known whole-matrix optimizer and holds a param sharded over several ranks."""
    known = next(
        (WHOLE_MATRIX_OPTIMIZERS[c.__name__] for c in type(optimizer).__mro__ if c.__name__ in WHOLE_MATRIX_OPTIMIZERS),
        None,
    )
    if known is None:
        return
    sharded = _first_sharded(optimizer)
    if sharded is None:
        return
    kind = type(optimizer)
    raise ValueError(
        f"{owner}: {kind.__module__}.{kind.__name__} {known}, but FSDP2 hands it each rank's shard of the params"
        f" ({sharded}), so every rank would compute its update from its own part: silently wrong updates. Use an"
        " elementwise optimizer (torch.optim.AdamW, Adam, SGD, ...) for the sharded params, or run without"
        " sharding them (one process, or data_parallel_size=1)."
    )


def _first_sharded(optimizer: Optimizer) -> Optional[str]:
    from torch.distributed.tensor import DTensor, Shard

    for group in optimizer.param_groups:
        for param in group["params"]:
            if not isinstance(param, DTensor):
                continue
            mesh = param.device_mesh
            for dim, placement in enumerate(param.placements):
                if isinstance(placement, Shard) and mesh.size(dim) > 1:
                    return (
                        f"a {tuple(param.shape)} param split over {mesh.size(dim)} ranks along its dim {placement.dim}"
                    )
    return None
