"""Device meshes for data parallelism: pure FSDP (1-D) or HSDP (replicate x shard), plus tensor parallelism."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP_REPLICATE, DP_SHARD, DATA_PARALLEL, TENSOR_PARALLEL = (
    "data_parallel_replicate",
    "data_parallel_shard",
    "data_parallel",
    "tensor_parallel",
)


@dataclass(frozen=True)
class ParallelMeshes:
    root: "DeviceMesh"
    """The full mesh ``(data_parallel_replicate, data_parallel_shard, tensor_parallel)``."""
    fsdp: "DeviceMesh"
    """The mesh handed to ``fully_shard``: 1-D (shard) or, for HSDP, 2-D (replicate, shard)."""
    data_parallel: "DeviceMesh"
    """All data-parallel ranks flattened into one dim: the group replicated gradients are averaged over."""


def build_parallel_meshes(
    device_type: str,
    replicate_size: int,
    shard_size: int,
    tensor_parallel_size: int,
    world_size: int,
    owner: str = "mixed_fsdp2",
) -> ParallelMeshes:
    from torch.distributed.device_mesh import init_device_mesh

    if replicate_size * shard_size * tensor_parallel_size != world_size:
        raise ValueError(
            f"{owner}: data_parallel_replicate_size={replicate_size} x data_parallel_size={shard_size}"
            f" x tensor_parallel_size={tensor_parallel_size} must equal the world size ({world_size});"
            " change the sizes or the number of devices/nodes."
        )
    root = init_device_mesh(
        device_type,
        (replicate_size, shard_size, tensor_parallel_size),
        mesh_dim_names=(DP_REPLICATE, DP_SHARD, TENSOR_PARALLEL),
    )
    data_parallel = flatten_mesh(root[DP_REPLICATE, DP_SHARD], DATA_PARALLEL)
    fsdp = root[DP_REPLICATE, DP_SHARD] if replicate_size > 1 else root[DP_SHARD]
    return ParallelMeshes(root=root, fsdp=fsdp, data_parallel=data_parallel)


def flatten_mesh(mesh: "DeviceMesh", name: str) -> "DeviceMesh":
    """Flatten all dims of ``mesh`` into one named dim.

    ``DeviceMesh._flatten`` is private; checked on torch 2.13.0, which has no public replacement. Keep the returned
    object: slicing the flattened dim back out of the root mesh is deprecated.
    """
    return mesh._flatten(name)
