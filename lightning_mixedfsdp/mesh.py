"""Device meshes for data parallelism: pure FSDP (1-D) or HSDP (replicate x shard), plus tensor parallelism, and the
expert meshes of expert parallelism."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from lightning_mixedfsdp._torch_compat import flatten_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP_REPLICATE, DP_SHARD, DATA_PARALLEL, TENSOR_PARALLEL = (
    "data_parallel_replicate",
    "data_parallel_shard",
    "data_parallel",
    "tensor_parallel",
)
EXPERT_DATA_PARALLEL, EXPERT_PARALLEL = "expert_data_parallel", "expert_parallel"


@dataclass(frozen=True)
class ExpertMeshes:
    """Expert parallelism splits the data-parallel shard ranks into ``expert_data_parallel x expert_parallel``
    (EP innermost: an EP group is adjacent ranks, on GPUs one node); HSDP replicas stay outside."""

    root: "DeviceMesh"
    """``(expert_data_parallel, expert_parallel)``, or with HSDP ``(data_parallel_replicate, expert_data_parallel,
    expert_parallel)``: the mesh the expert params live on."""
    fsdp: "DeviceMesh"
    """The mesh the experts modules are ``fully_shard``-ed over: the ranks holding the same experts (with HSDP 2-D,
    replicate x expert_data_parallel)."""
    expert_parallel: "DeviceMesh"
    """The ranks one MoE layer's experts are split over; tokens move between them by all-to-all."""
    tensor_parallel: "DeviceMesh"
    """The ranks sharing one batch (size 1: expert parallelism does not compose with tensor parallelism here)."""

    @property
    def shard_size(self) -> int:
        """Ranks the experts' FSDP reduce-scatter runs over (``expert_data_parallel``)."""
        return self.root[EXPERT_DATA_PARALLEL].size()


@dataclass(frozen=True)
class ParallelMeshes:
    root: "DeviceMesh"
    """The full mesh: ``(data_parallel, tensor_parallel)`` (Lightning's), or for HSDP
    ``(data_parallel_replicate, data_parallel_shard, tensor_parallel)``."""
    fsdp: "DeviceMesh"
    """The mesh handed to ``fully_shard``: 1-D (shard) or, for HSDP, 2-D (replicate, shard)."""
    data_parallel: "DeviceMesh"
    """All data-parallel ranks flattened into one dim: the group replicated gradients are averaged over."""
    experts: Optional[ExpertMeshes] = None
    """The expert meshes when ``expert_parallel_size > 1``."""


def meshes_of_2d(root: "DeviceMesh") -> ParallelMeshes:
    """The meshes of Lightning's ``(data_parallel, tensor_parallel)`` mesh: params sharded over ``data_parallel``."""
    data_parallel = root[DATA_PARALLEL]
    return ParallelMeshes(root=root, fsdp=data_parallel, data_parallel=data_parallel)


def check_mesh_product(replicate: int, shard: int, tensor_parallel: int, world_size: int, owner: str) -> None:
    """Lightning's error type and words for sizes that do not multiply to the world size."""
    if replicate * shard * tensor_parallel != world_size:
        raise RuntimeError(
            f"{owner}: the sizes `data_parallel_replicate_size={replicate}`, `data_parallel_size={shard}` and"
            f" `tensor_parallel_size={tensor_parallel}` multiplied should equal the world size ({world_size});"
            " change the sizes or the number of devices/nodes."
        )


def build_parallel_meshes(
    device_type: str,
    replicate_size: int,
    shard_size: int,
    tensor_parallel_size: int,
    world_size: int,
    owner: str = "mixed_fsdp2",
) -> ParallelMeshes:
    """HSDP: params sharded over ``data_parallel_shard`` and replicated over ``data_parallel_replicate``; replicated
    params' grads reduced over both, flattened into ``data_parallel``. With ``replicate_size == 1`` the same as
    Lightning's 2-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    check_mesh_product(replicate_size, shard_size, tensor_parallel_size, world_size, owner)
    if replicate_size == 1:
        root = init_device_mesh(
            device_type, (shard_size, tensor_parallel_size), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL)
        )
        return meshes_of_2d(root)
    root = init_device_mesh(
        device_type,
        (replicate_size, shard_size, tensor_parallel_size),
        mesh_dim_names=(DP_REPLICATE, DP_SHARD, TENSOR_PARALLEL),
    )
    data_parallel = flatten_mesh(root[DP_REPLICATE, DP_SHARD], DATA_PARALLEL)
    fsdp = root[DP_REPLICATE, DP_SHARD] if replicate_size > 1 else root[DP_SHARD]
    return ParallelMeshes(root=root, fsdp=fsdp, data_parallel=data_parallel)


def check_expert_parallel_size(
    expert_parallel_size: int, shard_size: int, tensor_parallel_size: int, owner: str
) -> None:
    """Expert parallelism splits the data-parallel shard ranks; it needs a size that divides them, and no TP."""
    problems = []
    if shard_size % expert_parallel_size:
        problems.append(
            f"expert_parallel_size={expert_parallel_size} must divide the data-parallel shard ranks"
            f" (data_parallel_size={shard_size}): the experts are split over ranks that hold different batches; use a"
            " divisor of it"
        )
    if tensor_parallel_size != 1:
        problems.append(
            f"expert_parallel_size={expert_parallel_size} with tensor_parallel_size={tensor_parallel_size} is not"
            " supported; use tensor_parallel_size=1 with expert parallelism"
        )
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems) + ".")


def build_expert_meshes(
    device_type: str, replicate_size: int, shard_size: int, expert_parallel_size: int, tensor_parallel: "DeviceMesh"
) -> ExpertMeshes:
    """The meshes of :class:`ExpertMeshes`, rank for rank aligned with the dense data-parallel mesh (rank ``r * shard
    + s`` holds batch ``s`` of replica ``r`` in both)."""
    from torch.distributed.device_mesh import init_device_mesh

    expert_shard = shard_size // expert_parallel_size
    if replicate_size == 1:
        root = init_device_mesh(
            device_type, (expert_shard, expert_parallel_size), mesh_dim_names=(EXPERT_DATA_PARALLEL, EXPERT_PARALLEL)
        )
        fsdp = root[EXPERT_DATA_PARALLEL]
    else:
        root = init_device_mesh(
            device_type,
            (replicate_size, expert_shard, expert_parallel_size),
            mesh_dim_names=(DP_REPLICATE, EXPERT_DATA_PARALLEL, EXPERT_PARALLEL),
        )
        fsdp = root[DP_REPLICATE, EXPERT_DATA_PARALLEL]
    return ExpertMeshes(root=root, fsdp=fsdp, expert_parallel=root[EXPERT_PARALLEL], tensor_parallel=tensor_parallel)
