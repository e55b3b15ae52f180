"""The parallel dims of a run in one object, as torchtitan's ``ParallelDims``: the sizes (HSDP replicas, data-parallel
shard ranks, context parallelism, tensor parallelism, expert parallelism), their validation (every problem at once),
the device meshes built from them (dense, context-parallel and expert) and the gradient divide factors they imply.

The world is ``pipeline x replicate x shard x context_parallel x tensor_parallel`` (torchtitan's order), tensor
parallelism innermost, pipeline stages outermost (between nodes on GPUs); each stage's ranks shard its params as if
the stage were the whole model. The dense mesh is
pure FSDP (1-D) or HSDP (replicate x shard), params sharded over the shard ranks times the context-parallel ranks
(torchtitan's ``dp_shard_cp``); the context-parallel ranks of one data-parallel rank share its batch and split its
sequences. Expert parallelism splits the shard ranks into ``expert_data_parallel x expert_parallel``.
"""

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, TypeVar

from torch import nn

from lightning_mixedfsdp.compat.torch import flatten_mesh
from lightning_mixedfsdp.config.groups import MeshSize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DP_REPLICATE, DP_SHARD, DATA_PARALLEL, TENSOR_PARALLEL = (
    "data_parallel_replicate",
    "data_parallel_shard",
    "data_parallel",
    "tensor_parallel",
)
EXPERT_DATA_PARALLEL, EXPERT_PARALLEL = "expert_data_parallel", "expert_parallel"
CONTEXT_PARALLEL, DP_SHARD_CP, GRADIENT = "context_parallel", "data_parallel_shard_cp", "gradient"
PIPELINE = "pipeline"

TModel = TypeVar("TModel", bound=nn.Module)
ParallelizeFn = Callable[[TModel, "DeviceMesh"], TModel]
"""``fn(model, device_mesh) -> model``: the user's tensor parallelism or wrappers, run on the full mesh."""


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
    gradient_divide_factor: float
    """What the experts' FSDP groups divide their reduced grads by: every data-parallel rank, as for dense grads. An
    expert's grad on one rank already sums the tokens of its EP group (the all-to-all's backward brings them back);
    the reduce over the ranks holding the same experts sums the rest."""

    @property
    def shard_size(self) -> int:
        """Ranks the experts' FSDP reduce-scatter runs over (``expert_data_parallel``)."""
        return self.root[EXPERT_DATA_PARALLEL].size()


@dataclass(frozen=True)
class ParallelMeshes:
    root: "DeviceMesh"
    """The full mesh: ``(data_parallel, tensor_parallel)`` (Lightning's), or for HSDP
    ``(data_parallel_replicate, data_parallel_shard, tensor_parallel)``; with context parallelism
    ``(data_parallel_replicate, data_parallel_shard_cp, tensor_parallel)``."""
    fsdp: "DeviceMesh"
    """The mesh handed to ``fully_shard``: 1-D (shard, or shard x context parallel) or, for HSDP, 2-D (replicate,
    shard)."""
    data_parallel: "DeviceMesh"
    """The ranks that see different batches (replicate x shard), flattened: the samplers' and evaluation's ranks."""
    gradient: Optional["DeviceMesh"] = None
    """Every rank that holds a replica of the model (data-parallel x context-parallel), flattened: replicated
    gradients are averaged over it, buffers kept equal on it. None: the data-parallel mesh (no context
    parallelism)."""
    context_parallel: Optional["DeviceMesh"] = None
    """The ranks one batch's sequences are split over, when ``context_parallel_size > 1``."""
    experts: Optional[ExpertMeshes] = None
    """The expert meshes when ``expert_parallel_size > 1``."""
    pipeline: Optional["DeviceMesh"] = None
    """The ranks one replica's pipeline stages run on (``pipeline_parallel_size > 1``); the other meshes are this
    rank's stage's."""
    outer: Optional["DeviceMesh"] = None
    """Semi-synchronous replicas (``replicate_sync``): the replicate dim the outer sync runs over, each replica then
    sharded over its own shard ranks alone. None: every gradient crosses the replicate dim every step."""

    @property
    def replicas(self) -> "DeviceMesh":
        """The mesh replicated gradients are averaged and buffers synced over."""
        return self.gradient if self.gradient is not None else self.data_parallel


@dataclass(frozen=True)
class ParallelDims:
    """Every parallel size of a run, resolved and validated: ``replicate x shard x tensor_parallel`` ranks, the shard
    ranks split again by ``expert_parallel`` for the experts."""

    replicate: int
    """HSDP replicas of the sharded model (e.g. one per node); 1 is plain FSDP."""
    shard: int
    """Data-parallel ranks each param is sharded over."""
    tensor_parallel: int = 1
    expert_parallel: int = 1
    """Ranks each MoE layer's experts are split over; 1 is off."""
    context_parallel: int = 1
    """Ranks each sequence is split over; 1 is off."""
    pipeline: int = 1
    """Pipeline stages' ranks (``pipeline_parallel_size``), outermost; 1 is off."""

    @classmethod
    def resolve(
        cls,
        *,
        world_size: int,
        devices_per_node: int,
        data_parallel_size: MeshSize = "auto",
        replicate: int = 1,
        tensor_parallel_size: MeshSize = 1,
        expert_parallel: int = 1,
        owner: str = "mixed_fsdp2",
        context_parallel: int = 1,
        pipeline: int = 1,
    ) -> "ParallelDims":
        """Resolve ``"auto"`` sizes as Lightning does and validate the result. ``tensor_parallel_size="auto"`` is the
        devices of a node; ``data_parallel_size="auto"`` takes every rank the others leave (Lightning's: the number of
        nodes, which is the same when tensor parallelism is ``"auto"``)."""
        check_sizes(data_parallel_size, replicate, tensor_parallel_size, owner)
        sizes = (data_parallel_size, replicate, tensor_parallel_size, expert_parallel, context_parallel, pipeline)
        dims = cls(*_resolved_sizes(world_size, devices_per_node, *sizes))
        dims.validate(world_size, owner)
        return dims

    @classmethod
    def resolve_problems(
        cls,
        *,
        world_size: int,
        devices_per_node: int,
        data_parallel_size: MeshSize = "auto",
        replicate: int = 1,
        tensor_parallel_size: MeshSize = 1,
        expert_parallel: int = 1,
        context_parallel: int = 1,
        pipeline: int = 1,
    ) -> List[str]:
        """What :meth:`resolve` would refuse for these sizes, one problem per item (empty when it would resolve):
        for a launcher that reports before any process starts. ``expert_parallel`` and ``context_parallel`` are
        ints >= 1 (the config checks them)."""
        problems = size_problems(data_parallel_size, replicate, tensor_parallel_size)
        if problems:
            return problems
        sizes = (data_parallel_size, replicate, tensor_parallel_size, expert_parallel, context_parallel, pipeline)
        dims = cls(*_resolved_sizes(world_size, devices_per_node, *sizes))
        return dims.problems(world_size)

    @property
    def data_parallel(self) -> int:
        """Ranks that see different batches: the replicas times the shard ranks."""
        return self.replicate * self.shard

    @property
    def lightning_data_parallel(self) -> int:
        """Lightning's own strategy's data-parallel size: every rank tensor parallelism leaves (it builds a
        ``(data_parallel, tensor_parallel)`` mesh and checks that the two multiply to the world)."""
        return self.pipeline * self.replicate * self.shard * self.context_parallel

    @property
    def expert_shard(self) -> int:
        """Ranks holding the same experts (``expert_data_parallel``), over which their FSDP group shards them."""
        return self.shard // self.expert_parallel

    @property
    def ranks(self) -> int:
        """Ranks the sizes take: pipeline x replicate x shard x context parallel x tensor parallel."""
        return self.pipeline * self.replicate * self.shard * self.context_parallel * self.tensor_parallel

    def problems(self, world_size: int) -> List[str]:
        """Every problem of these sizes for ``world_size`` ranks, each with its fix; empty when valid."""
        problems = []
        if self.ranks != world_size:
            context = f", `context_parallel_size={self.context_parallel}`" if self.context_parallel > 1 else ""
            stages = f"`pipeline_parallel_size={self.pipeline}`, " if self.pipeline > 1 else ""
            problems.append(
                f"the sizes {stages}`data_parallel_replicate_size={self.replicate}`, `data_parallel_size={self.shard}`"
                f"{context}"
                f" and `tensor_parallel_size={self.tensor_parallel}` multiplied should equal the world size"
                f" ({world_size}); change the sizes or the number of devices/nodes"
            )
        if self.expert_parallel > 1:
            problems.extend(self._expert_problems())
        if self.context_parallel > 1:
            problems.extend(self._context_problems(world_size))
        if self.pipeline > 1 and world_size % self.pipeline:
            problems.append(
                f"pipeline_parallel_size={self.pipeline} must divide the world size ({world_size}); use a divisor of it"
            )
        return problems

    def _context_problems(self, world_size: int) -> List[str]:
        problems = []
        if world_size % self.context_parallel:
            problems.append(
                f"context_parallel_size={self.context_parallel} must divide the world size ({world_size}); use a"
                " divisor of it"
            )
        if self.tensor_parallel != 1:
            problems.append(
                f"context_parallel_size={self.context_parallel} with tensor_parallel_size={self.tensor_parallel} is"
                " not supported: both split each sequence's activations, and their layouts are not composed here;"
                " use one of them"
            )
        if self.expert_parallel > 1:
            problems.append(
                f"context_parallel_size={self.context_parallel} with expert_parallel_size={self.expert_parallel} is"
                " not supported: expert parallelism splits the data-parallel shard ranks, which context parallelism"
                " extends; use one of them"
            )
        return problems

    def validate(self, world_size: int, owner: str = "mixed_fsdp2") -> "ParallelDims":
        """Raise with every problem at once (Lightning's ``RuntimeError`` for sizes that do not multiply to the
        world, as its own strategy does; a ``ValueError`` for the rest); return ``self`` when valid."""
        if self.ranks != world_size and world_size % (self.context_parallel * self.pipeline) == 0:
            raise RuntimeError(f"{owner}: " + "; ".join(self.problems(world_size)) + ".")
        problems = self.problems(world_size)
        if problems:
            raise ValueError(f"{owner}: " + "; ".join(problems) + ".")
        return self

    def _expert_problems(self) -> List[str]:
        problems = []
        if self.shard % self.expert_parallel:
            problems.append(
                f"expert_parallel_size={self.expert_parallel} must divide the data-parallel shard ranks"
                f" (data_parallel_size={self.shard}): the experts are split over ranks that hold different batches;"
                " use a divisor of it"
            )
        if self.tensor_parallel != 1:
            problems.append(
                f"expert_parallel_size={self.expert_parallel} with tensor_parallel_size={self.tensor_parallel} is not"
                " supported; use tensor_parallel_size=1 with expert parallelism"
            )
        return problems

    def build_meshes(self, device_type: str, lightning_mesh: Optional["DeviceMesh"] = None) -> ParallelMeshes:
        """The dense meshes (reusing Lightning's 2-D ``(data_parallel, tensor_parallel)`` mesh when there are no HSDP
        replicas and one is given) and, with expert parallelism, the expert meshes, rank for rank aligned."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.pipeline > 1:
            return pipeline_meshes(self, device_type)
        if self.context_parallel > 1:
            return context_parallel_meshes(self, device_type)
        if self.replicate == 1:
            root = lightning_mesh
            if root is None:
                root = init_device_mesh(
                    device_type, (self.shard, self.tensor_parallel), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL)
                )
            meshes = ParallelMeshes(root=root, fsdp=root[DATA_PARALLEL], data_parallel=root[DATA_PARALLEL])
        else:
            root = init_device_mesh(
                device_type,
                (self.replicate, self.shard, self.tensor_parallel),
                mesh_dim_names=(DP_REPLICATE, DP_SHARD, TENSOR_PARALLEL),
            )
            data_parallel = flatten_mesh(root[DP_REPLICATE, DP_SHARD], DATA_PARALLEL)
            meshes = ParallelMeshes(root=root, fsdp=root[DP_REPLICATE, DP_SHARD], data_parallel=data_parallel)
        if self.expert_parallel > 1:
            meshes = replace(meshes, experts=expert_meshes(self, device_type, meshes.root[TENSOR_PARALLEL]))
        return meshes


def semi_synchronous(meshes: ParallelMeshes) -> ParallelMeshes:
    """HSDP ``meshes`` for semi-synchronous replicas: FSDP shards over each replica's shard ranks alone (no gradient
    crosses the replicate dim), replicated params are averaged there too, and the outer sync runs over the replicate
    dim. The samplers keep every data-parallel rank: each replica trains on its own part of the data."""
    shard = meshes.root[DP_SHARD]
    return replace(meshes, fsdp=shard, gradient=shard, outer=meshes.root[DP_REPLICATE])


def _resolved_sizes(
    world_size: int,
    devices_per_node: int,
    data_parallel_size: MeshSize,
    replicate: int,
    tensor_parallel_size: MeshSize,
    expert_parallel: int,
    context_parallel: int,
    pipeline: int = 1,
) -> Tuple[int, int, int, int, int, int]:
    """``ParallelDims``' fields with ``"auto"`` sizes resolved, not validated."""
    tensor_parallel = devices_per_node if tensor_parallel_size == "auto" else int(tensor_parallel_size)
    if data_parallel_size == "auto":
        shard = max(world_size // (pipeline * replicate * tensor_parallel * context_parallel), 1)
    else:
        shard = int(data_parallel_size)
    return replicate, shard, tensor_parallel, expert_parallel, context_parallel, pipeline


def pipeline_meshes(dims: ParallelDims, device_type: str) -> ParallelMeshes:
    """``(pipeline, replicate, shard, tensor_parallel)``: rank ``((p * replicate + r) * shard + s) * tp + t`` runs
    stage ``p`` (with v stages per rank: stages ``p, p + pipeline, ...``); the data-parallel meshes are its stage's
    (FSDP shards over them, replicated grads are averaged over them, never across stages)."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(
        device_type,
        (dims.pipeline, dims.replicate, dims.shard, dims.tensor_parallel),
        mesh_dim_names=(PIPELINE, DP_REPLICATE, DP_SHARD, TENSOR_PARALLEL),
    )
    if dims.replicate == 1:
        fsdp = data_parallel = root[DP_SHARD]
    else:
        fsdp = root[DP_REPLICATE, DP_SHARD]
        data_parallel = flatten_mesh(fsdp, DATA_PARALLEL)
    experts = expert_meshes(dims, device_type, root[TENSOR_PARALLEL]) if dims.expert_parallel > 1 else None
    return ParallelMeshes(root=root, fsdp=fsdp, data_parallel=data_parallel, pipeline=root[PIPELINE], experts=experts)


def context_parallel_meshes(dims: ParallelDims, device_type: str) -> ParallelMeshes:
    """Two meshes over the same ranks: ``(replicate, shard x cp, tp)``, which the params live on (FSDP shards
    over the flattened shard x cp ranks), and ``(replicate, shard, cp, tp)``, whose dims give the context-parallel
    groups and the batch ranks. Rank ``((r * shard + s) * cp + c) * tp + t`` is the same rank in both."""
    from torch.distributed.device_mesh import init_device_mesh

    root = init_device_mesh(
        device_type,
        (dims.replicate, dims.shard * dims.context_parallel, dims.tensor_parallel),
        mesh_dim_names=(DP_REPLICATE, DP_SHARD_CP, TENSOR_PARALLEL),
    )
    layout = init_device_mesh(
        device_type,
        (dims.replicate, dims.shard, dims.context_parallel, dims.tensor_parallel),
        mesh_dim_names=(DP_REPLICATE, DP_SHARD, CONTEXT_PARALLEL, TENSOR_PARALLEL),
    )
    fsdp = root[DP_SHARD_CP] if dims.replicate == 1 else root[DP_REPLICATE, DP_SHARD_CP]
    return ParallelMeshes(
        root=root,
        fsdp=fsdp,
        data_parallel=flatten_mesh(layout[DP_REPLICATE, DP_SHARD], DATA_PARALLEL),
        gradient=flatten_mesh(root[DP_REPLICATE, DP_SHARD_CP], GRADIENT),
        context_parallel=layout[CONTEXT_PARALLEL],
    )


def expert_meshes(dims: ParallelDims, device_type: str, tensor_parallel: "DeviceMesh") -> ExpertMeshes:
    """Rank ``r * shard + s`` holds batch ``s`` of replica ``r`` in the dense and the expert meshes alike; under
    pipeline stages the pipeline dim comes first in both (each stage's experts split over its own ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    outer = ((dims.pipeline,), (PIPELINE,)) if dims.pipeline > 1 else ((), ())
    replicas = ((dims.replicate,), (DP_REPLICATE,)) if dims.replicate > 1 else ((), ())
    root = init_device_mesh(
        device_type,
        (*outer[0], *replicas[0], dims.expert_shard, dims.expert_parallel),
        mesh_dim_names=(*outer[1], *replicas[1], EXPERT_DATA_PARALLEL, EXPERT_PARALLEL),
    )
    fsdp = root[DP_REPLICATE, EXPERT_DATA_PARALLEL] if dims.replicate > 1 else root[EXPERT_DATA_PARALLEL]
    return ExpertMeshes(
        root=root,
        fsdp=fsdp,
        expert_parallel=root[EXPERT_PARALLEL],
        tensor_parallel=tensor_parallel,
        gradient_divide_factor=float(dims.data_parallel),
    )


def check_sizes(data_parallel_size: Any, replicate: Any, tensor_parallel_size: Any, owner: str) -> None:
    """Sizes that can never be right, refused when a strategy is constructed (the world is known only at launch)."""
    problems = size_problems(data_parallel_size, replicate, tensor_parallel_size)
    if problems:
        raise ValueError(f"{owner}: " + "; ".join(problems) + ".")


def size_problems(data_parallel_size: Any, replicate: Any, tensor_parallel_size: Any) -> List[str]:
    """:func:`check_sizes`' problems, one per item."""
    problems = []
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if value != "auto" and not (isinstance(value, int) and value >= 1):
            problems.append(f"{name}={value!r} must be 'auto' or an int >= 1")
    if not (isinstance(replicate, int) and replicate >= 1):
        problems.append(f"data_parallel_replicate_size={replicate!r} must be an int >= 1")
    return problems


def build_parallel_meshes(
    device_type: str,
    replicate: int,
    shard: int,
    tensor_parallel: int,
    world_size: int,
    expert_parallel: int = 1,
    context_parallel: int = 1,
    pipeline: int = 1,
) -> ParallelMeshes:
    """The meshes of :class:`ParallelDims` ``(replicate, shard, tensor_parallel, expert_parallel, context_parallel,
    pipeline)``, validated for ``world_size`` ranks: what the benchmarks and tests set up without a strategy."""
    dims = ParallelDims(replicate, shard, tensor_parallel, expert_parallel, context_parallel, pipeline)
    dims.validate(world_size)
    return dims.build_meshes(device_type)
