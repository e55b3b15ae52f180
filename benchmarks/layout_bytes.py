"""Bytes each rank sends per training step under each layout of 4 ranks, split by mesh dimension: what a layout puts
on the links between nodes, the figure that decides a layout on a cluster.

Four CPU ranks stand for two nodes of two (ranks 0-1 and 2-3; on GPUs the inner mesh dims are the ranks of one
node). Each layout trains an HF Llama from config under ``bf16-true`` on the same global batch; one step after a
warm-up is recorded op by op (``diagnostics.collectives.recording_group_traffic``: FSDP's gathers and
reduce-scatters, the replicated params' all-reduce, tensor parallelism's all-reduces, the pipeline's sends), each op
counted at the bytes a ring makes this rank send, and filed under the mesh dim whose group it ran on. "Between
nodes" is the bytes on groups that span both nodes.

    python -m benchmarks.layout_bytes [--hidden 256] [--layers 4] [--batch 8] [--seq 128]
"""

import argparse
import statistics
from collections import defaultdict
from typing import Any, Dict, List, Tuple

import torch

from lightning_mixedfsdp.testing import run_distributed

WORLD, RANKS_PER_NODE = 4, 2
LAYOUTS: Dict[str, Dict[str, Any]] = {
    "FSDP 4": {"data_parallel_size": 4},
    "HSDP 2 x 2": {"data_parallel_replicate_size": 2, "data_parallel_size": 2},
    "PP 2 x FSDP 2": {"pipeline_parallel_size": 2, "data_parallel_size": 2},
    "PP 2 x TP 2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_size": 1},
    "PP 2 x CP 2": {"pipeline_parallel_size": 2, "context_parallel_size": 2, "data_parallel_size": 1},
}


def _model(hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _loss(output: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _dim_names(meshes: Any) -> Dict[Tuple[int, ...], str]:
    """Each of this rank's groups, by its ranks, with the mesh dim (or dims) it spans."""
    import torch.distributed as dist

    names: Dict[Tuple[int, ...], str] = {}
    candidates = [(meshes.data_parallel, "data_parallel")]
    if meshes.pipeline is not None:
        candidates.append((meshes.pipeline, "pipeline"))
    for dim in meshes.root.mesh_dim_names or ():
        candidates.append((meshes.root[dim], dim))
    for mesh, name in candidates:
        if mesh.ndim == 1 and mesh.size() > 1:
            names.setdefault(tuple(dist.get_process_group_ranks(mesh.get_group())), name)
    names.setdefault(tuple(range(dist.get_world_size())), "world")
    return names


def _step(fabric: Any, model: Any, optimizer: Any, tokens: torch.Tensor) -> None:
    if fabric.strategy.pipelined:
        fabric.strategy.pipeline_step(model, tokens, target=tokens, loss_fn=_loss)
    else:
        fabric.backward(_loss(model(tokens), tokens))
    optimizer.step()
    optimizer.zero_grad()


def _measure(rank: int, world_size: int, args: Dict[str, Any]) -> Dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from lightning_mixedfsdp.diagnostics.collectives import recording_group_traffic
    from lightning_mixedfsdp.fabric import MixedFSDP2Strategy

    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 512, (args["batch"], args["seq"]), generator=generator)
    out: Dict[str, Any] = {}
    for layout in args["layouts"]:
        options = dict(LAYOUTS[layout])
        if "pipeline_parallel_size" in options:
            options["pipeline_microbatches"] = 2
        try:
            fabric = L.Fabric(
                accelerator="cpu", devices=world_size, precision="bf16-true", strategy=MixedFSDP2Strategy(**options)
            )
            fabric.launch()
            model = fabric.setup(_model(args["hidden"], args["layers"]))
        except ValueError as error:  # a layout the strategy refuses: its reason goes in the table
            out[layout] = {"refused": str(error)}
            continue
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
        sampler = fabric.strategy.distributed_sampler_kwargs
        tokens = batch.chunk(sampler["num_replicas"])[sampler["rank"]]
        _step(fabric, model, optimizer, tokens)
        with recording_group_traffic() as traffic:
            _step(fabric, model, optimizer, tokens)
        names = _dim_names(fabric.strategy.meshes)
        by_dim: Dict[str, float] = defaultdict(float)
        between = 0.0
        for record in traffic:
            ranks = tuple(dist.get_process_group_ranks(record.group))
            if len(ranks) == 1:  # a mesh dim of size 1 (FSDP over one rank under PP x TP): nothing moves
                continue
            by_dim[names.get(ranks, f"ranks {list(ranks)}")] += record.sent_bytes
            if len({r // RANKS_PER_NODE for r in ranks}) > 1:
                between += record.sent_bytes
        out[layout] = {"by_dim": dict(by_dim), "between_nodes": between}
    return out


def main(argv: Any = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.layout_bytes")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = vars(parser.parse_args(argv))
    results = run_distributed(_measure, WORLD, args, timeout=1800)
    print(
        f"HF Llama hidden {args['hidden']}, {args['layers']} layers, bf16-true, global batch {args['batch']} x"
        f" {args['seq']} tokens; 4 ranks as 2 nodes of 2. KiB each rank sends in one step (mean over the ranks):"
    )
    table: Dict[str, Any] = {}
    for layout in args["layouts"]:
        ranks: List[Dict[str, Any]] = [r[layout] for r in results]
        if "refused" in ranks[0]:
            table[layout] = {"refused": ranks[0]["refused"]}
            reason = ranks[0]["refused"].split("  - ")[-1].split(":")[0]
            print(f"  {layout:<15} refused: {reason}")
            continue
        dims = sorted({dim for r in ranks for dim in r["by_dim"]})
        by_dim = {dim: statistics.mean(r["by_dim"].get(dim, 0.0) for r in ranks) for dim in dims}
        between = statistics.mean(r["between_nodes"] for r in ranks)
        total = sum(by_dim.values())
        table[layout] = {"by_dim": by_dim, "between_nodes": between, "total": total}
        split = ", ".join(f"{dim} {value / 2**10:.0f}" for dim, value in by_dim.items())
        print(f"  {layout:<15} total {total / 2**10:>8.0f}   between nodes {between / 2**10:>8.0f}   ({split})")
    return table


if __name__ == "__main__":
    main()
