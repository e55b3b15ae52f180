"""One GPU, an HF Llama of 1.1B params (hidden 2048, 22 layers), seq 2048 x micro-batch 4: step time, tokens/s,
peak memory and MFU of mixed_fsdp2 against the uniform FSDP2 a user writes by hand, in eager, activation
checkpointing and compile modes.

    python -m benchmarks.gpu_llama                       # the whole table (CUDA); prints it and writes --out
    python -m benchmarks.gpu_llama --tiny --device cpu   # smoke test of every set-up and mode on the CPU
    python -m benchmarks.gpu_llama --float8              # float8 against bf16, eager and compiled (CUDA, sm89+)
    python -m benchmarks.gpu_llama --float8 --model 8b --batch 1 --modes ac compile   # Llama-3-8B's shapes

Set-ups (world size 1, ``fully_shard`` per decoder layer and the root):
  A    uniform bf16 FSDP2 by hand (the norms lose fp32: fast, numerically wrong)
  B    mixed_fsdp2, bf16-true (fp32 norms replicated; autograd keeps their bf16 inputs, not fp32 copies)
  Bd   B with ``nonfinite_check="device_assert"``: the clip's non-finite check without its host sync
  Br   B with the norms' fp32 math recomputed in backward (``recompute_keep_fp32_modules=True``)
  N    per-norm fully_shard with an fp32 policy (axolotl's approach)
  A'   uniform FSDP2 with fp32 master weights and MixedPrecisionPolicy(param_dtype=bf16): bf16-mixed's fair baseline
  D    mixed_fsdp2, bf16-mixed
  HF   transformers' own FSDP2 plan (``DistributedConfig(fsdp_size=1)``) on a bf16 model
  A8   A with torchao's float8 tensorwise training by hand (``convert_to_float8_training`` with torchao's own size
       filter, float8 all-gather, the scales precomputed after each step): what torchtitan users write
  B8   mixed_fsdp2 bf16-true with ``float8="tensorwise"`` (the plan picks the layers; float8 all-gather on CUDA)
  B8r  mixed_fsdp2 bf16-true with ``float8="rowwise"``

``--float8`` runs A, A8, B, B8 and B8r in one process per mode (on a CPU they emulate float8): B8 against A8 is the
cost of the fp32 norms under float8, B8 against B the float8 speed-up.

Eager and AC: the set-ups of one precision share a process and are timed in turn, one step each per round
(round-robin), so drift cannot favour one; peak memory is the step's peak above what the process holds before it
(all set-ups' params and optimizer states are resident, the same for each). Compile: one set-up per process
(dynamo's recompile limit is shared across set-ups), per-block ``compile`` in torchtitan's order. Every loss goes
through ``clip_gradients`` with ``error_if_nonfinite=True`` (Fabric's default) for B, Bd and D: a catchable error
and one host sync per step for B and D, a device-side assert for Bd. MFU counts 6 x params
+ 12 x layers x hidden x seq FLOPs per token against the GPU's dense bf16 peak (989 TFLOP/s for an H100 SXM).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

LLAMA_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
)
MODELS = {"1b": LLAMA_1B, "8b": LLAMA_8B}
GROUPS = {"bf16-true": ["A", "B", "Bd", "Br", "N"], "bf16-mixed": ["A'", "D"], "peer": ["HF"]}
FLOAT8_GROUPS = {"float8": ["A", "A8", "B", "B8", "B8r"]}
MIXED_FSDP2 = ("B", "Bd", "Br", "D", "B8", "B8r")
FLOAT8_RECIPES = {"B8": "tensorwise", "B8r": "rowwise"}
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def build(setup: str, config: Dict[str, Any], mode: str, device: torch.device) -> nn.Module:
    """One set-up, sharded on a 1-rank mesh, with AC and compile in torchtitan's order when ``mode`` asks. What must
    run after each optimizer step is in ``AFTER_STEP[setup]``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from lightning_mixedfsdp import MixedFSDPConfig
    from lightning_mixedfsdp.mesh import build_parallel_meshes
    from lightning_mixedfsdp.model_setup import shard_model

    torch.manual_seed(0)
    hf_config = LlamaConfig(**config, use_cache=False, attn_implementation="sdpa")
    if setup == "HF":
        return _transformers_fsdp(hf_config, mode, device)
    with torch.device(device):  # HF's init on the device: seconds, not the CPU's minutes for 1.1B params
        model = AutoModelForCausalLM.from_config(hf_config)
    meshes = build_parallel_meshes(device.type, 1, 1, 1, 1)
    if setup in MIXED_FSDP2:
        flag = "bf16-mixed" if setup == "D" else "bf16-true"
        fields: Dict[str, Any] = {"activation_checkpointing": "full" if mode == "ac" else "none"}
        fields["compile"] = mode == "compile"
        fields["recompute_keep_fp32_modules"] = setup == "Br"
        if setup in FLOAT8_RECIPES:
            fields.update(float8=FLOAT8_RECIPES[setup], float8_emulate=device.type != "cuda")
        mixed = MixedFSDPConfig(**fields)
        sharded = shard_model(model, mixed, mixed.bulk_dtypes(flag), meshes, device)
        if sharded.applied is not None and sharded.applied.after_step:
            AFTER_STEP[setup] = lambda: [action() for action in sharded.applied.after_step]  # type: ignore[union-attr]
        return sharded.module
    if setup == "A8":
        _float8_by_hand(model, device)
    return _by_hand(model, setup, mode, meshes.fsdp)


AFTER_STEP: Dict[str, Callable[[], Any]] = {}


def _float8_by_hand(model: nn.Module, device: torch.device) -> None:
    """torchtitan's float8: torchao's tensorwise conversion with its own size filter (the output head left out),
    float8 all-gather on CUDA and the scales precomputed after each step."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    cuda = device.type == "cuda"
    config = replace(Float8LinearConfig(), emulate=not cuda, enable_fsdp_float8_all_gather=cuda)
    convert_to_float8_training(
        model, config=config, module_filter_fn=_auto_filter_for_recipe("tensorwise", ["lm_head"])
    )
    if cuda:
        AFTER_STEP["A8"] = lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def _by_hand(model: nn.Module, setup: str, mode: str, mesh: Any) -> nn.Module:
    """A, N, A': what users write today, in torchtitan's order (AC -> compile -> fully_shard)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16, fp32 = torch.bfloat16, torch.float32
    if setup in ("A", "N", "A8"):
        model.to(bf16)
    bulk = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32 if setup == "A'" else bf16)
    norm_policy = MixedPrecisionPolicy(param_dtype=fp32, reduce_dtype=fp32, output_dtype=bf16)
    layers = model.model.layers
    for index, layer in enumerate(layers):
        if setup == "N":
            for module in layer.modules():
                if type(module).__name__.endswith("RMSNorm"):
                    module.to(fp32)
                    fully_shard(module, mesh=mesh, mp_policy=norm_policy)
        if mode == "ac":
            layer = checkpoint_wrapper(layer)
        if mode == "compile":
            layer.compile()
        layers[index] = layer
        fully_shard(layer, mesh=mesh, mp_policy=bulk)
    if setup == "N":
        model.model.norm.to(fp32)
        fully_shard(model.model.norm, mesh=mesh, mp_policy=norm_policy)
    return fully_shard(model, mesh=mesh, mp_policy=bulk)


def _transformers_fsdp(hf_config: Any, mode: str, device: torch.device) -> nn.Module:
    """transformers' own FSDP2 plan: ``maybe_distribute_model`` with ``DistributedConfig(fsdp_size=1)``."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    if mode == "ac":
        model.gradient_checkpointing_enable()
    distributed = DistributedConfig(fsdp_size=1)
    model = type(model).maybe_distribute_model(model, distributed, None)  # type: ignore[attr-defined]
    if mode == "compile":
        for layer in model.model.layers:
            layer.compile()
    return model


def clip(model: nn.Module, setup: str) -> None:
    """Fabric's default clipping, error_if_nonfinite=True: ours for B, Bd, Br and D, torch's for the rest."""
    if setup in MIXED_FSDP2:
        from lightning_mixedfsdp import clip_grad_norm_

        check = "device_assert" if setup == "Bd" else "raise"
        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True, nonfinite_check=check)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=False)


def _single_process_group(cuda: bool) -> torch.device:
    """A world-size-1 process group (NCCL on GPU 0, else gloo) for FSDP2 in this process; its device."""
    import torch.distributed as dist

    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    return device


def measure(setups: List[str], config: Dict[str, Any], mode: str, steps: int, warmup: int, batch: int, seq: int):
    import torch.distributed as dist

    device = _single_process_group(torch.cuda.is_available())
    models = {name: build(name, config, mode, device) for name in setups}
    optimizers = {
        name: torch.optim.AdamW(m.parameters(), lr=1e-5, fused=device.type == "cuda") for name, m in models.items()
    }
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config["vocab_size"], (batch, seq), generator=generator).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: Dict[str, List[float]] = {name: [] for name in setups}
    peaks: Dict[str, List[float]] = {name: [] for name in setups}
    losses: Dict[str, List[float]] = {name: [] for name in setups}
    for step in range(warmup + steps):
        for name in setups:
            model, optimizer = models[name], optimizers[name]
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            start = time.perf_counter()
            loss = model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            clip(model, name)
            optimizer.step()
            if name in AFTER_STEP:
                AFTER_STEP[name]()
            optimizer.zero_grad(set_to_none=True)
            sync()
            elapsed = time.perf_counter() - start
            if step >= warmup:
                times[name].append(elapsed)
                losses[name].append(loss.item())
                if device.type == "cuda":
                    peaks[name].append((torch.cuda.max_memory_allocated() - before) / 2**30)
    dist.destroy_process_group()
    params = sum(p.numel() for p in next(iter(models.values())).parameters())
    return {
        name: {
            "step_ms": statistics.median(times[name]) * 1e3,
            "step_peak_gib": max(peaks[name]) if peaks[name] else None,
            "loss": losses[name][-1],
            "params": params,
        }
        for name in setups
    }


def host_syncs(config: Dict[str, Any], batch: int, seq: int) -> Dict[str, int]:
    """Synchronizing calls per step of B (forward, backward, clip with error_if_nonfinite=True as B and as Bd, step,
    zero_grad) under ``torch.cuda.set_sync_debug_mode``."""
    import warnings

    import torch.distributed as dist

    device = _single_process_group(cuda=True)
    model = build("B", config, "eager", device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    tokens = torch.randint(0, config["vocab_size"], (batch, seq)).to(device)
    counts: Dict[str, int] = {}
    for step in range(3):
        phases: Dict[str, Callable[[], Any]] = {
            "forward+backward": lambda: model(input_ids=tokens, labels=tokens).loss.backward(),
            "clip (error_if_nonfinite=True, raise)": lambda: clip(model, "B"),
            "clip (error_if_nonfinite=True, device_assert)": lambda: clip(model, "Bd"),
            "optimizer step": optimizer.step,
            "zero_grad": lambda: optimizer.zero_grad(set_to_none=True),
        }
        for phase, run in phases.items():
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                run()
                torch.cuda.set_sync_debug_mode("default")
            if step == 2:  # after warm-up (first steps allocate and init lazily)
                counts[phase] = sum("synchronizing operation" in str(w.message) for w in caught)
    dist.destroy_process_group()
    return counts


def nonfinite(config: Dict[str, Any], setup: str) -> Dict[str, Any]:
    """Where a non-finite norm with ``error_if_nonfinite=True`` surfaces on CUDA. B (``"raise"``): at the clip, as
    a RuntimeError the loop catches before skipping the batch, and the next step trains. Bd (``"device_assert"``):
    not at the clip (no host sync) but at the next call that waits for the GPU; the optimizer step queued after the
    failed assert never runs, and the process cannot use the GPU again."""

    device = _single_process_group(cuda=True)
    model = build(setup, config, "eager", device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, config["vocab_size"], (1, 16)).to(device)
    events: List[str] = []
    for step in range(2):
        model(input_ids=tokens, labels=tokens).loss.backward()
        if step == 0:
            first = next(p for p in model.parameters() if p.grad is not None)
            first.grad.to_local().fill_(float("inf"))  # type: ignore[union-attr]
        try:
            clip(model, setup)
            events.append(f"step {step}: clip returned")
            optimizer.step()
            events.append(f"step {step}: optimizer step returned")
            torch.cuda.synchronize()
            events.append(f"step {step}: synchronize returned")
        except RuntimeError as error:
            events.append(f"step {step}: raised: {str(error).splitlines()[0][:100]}")
        optimizer.zero_grad(set_to_none=True)
    return {"events": events}


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def mfu(step_ms: float, params: int, config: Dict[str, Any], tokens: int) -> Optional[float]:
    peak = next((value for key, value in PEAK_TFLOPS.items() if key in gpu_name()), None)
    if peak is None:
        return None
    layers, hidden, seq = config["num_hidden_layers"], config["hidden_size"], tokens
    flops_per_token = 6 * params + 12 * layers * hidden * seq
    return flops_per_token * tokens / (step_ms / 1e3) / (peak * 1e12)


def _child(args: argparse.Namespace) -> None:
    config = TINY if args.tiny else MODELS[args.model]
    if args.host_syncs:
        result: Any = host_syncs(config, args.batch, args.seq)
    elif args.nonfinite:
        result = nonfinite(TINY, args.nonfinite)
    else:
        result = measure(args.setups.split(","), config, args.mode, args.steps, args.warmup, args.batch, args.seq)
    print("RESULT " + json.dumps(result))


def _run_child(argv: List[str]) -> Any:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_llama", "--child", *argv], capture_output=True, text=True
    )
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"error": (out.stderr or out.stdout)[-2000:]}


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setups", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="eager", help=argparse.SUPPRESS)
    parser.add_argument("--host-syncs", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nonfinite", default="", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--modes", nargs="+", default=["eager", "ac", "compile"])
    parser.add_argument("--groups", nargs="+", default=list(GROUPS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--out", default="benchmarks/results/gpu_llama.json")
    parser.add_argument("--float8", action="store_true", help="float8 against bf16 (set-ups A, A8, B, B8, B8r)")
    parser.add_argument("--model", default="1b", choices=list(MODELS), help="Llama shapes: 1.1B or Llama-3-8B")
    args = parser.parse_args(argv)
    groups_by_name = FLOAT8_GROUPS if args.float8 else GROUPS
    if args.float8:
        args.groups = list(FLOAT8_GROUPS)
        args.out = args.out.replace("gpu_llama.json", "gpu_llama_float8.json")
    if args.tiny:
        args.seq, args.batch = min(args.seq, 64), min(args.batch, 2)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if args.child:
        _child(args)
        return {}
    shared = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch)]
    shared += ["--seq", str(args.seq), "--model", args.model] + (["--tiny"] if args.tiny else [])
    results: Dict[str, Any] = {"gpu": gpu_name(), "torch": torch.__version__, "batch": args.batch, "seq": args.seq}
    for mode in args.modes:
        for group in args.groups:
            setups = groups_by_name[group]
            if mode == "compile":  # one compiled set-up per process
                for setup in setups:
                    results[f"{mode}/{setup}"] = _run_child(["--setups", setup, "--mode", mode, *shared])
            else:
                results[f"{mode}/{group}"] = _run_child(["--setups", ",".join(setups), "--mode", mode, *shared])
            print(json.dumps({k: v for k, v in results.items() if k.startswith(mode)}), flush=True)
    if args.device == "cuda" and torch.cuda.is_available() and not args.float8:
        results["host_syncs"] = _run_child(["--host-syncs", *shared])
        results["nonfinite"] = {setup: _run_child(["--nonfinite", setup]) for setup in ("B", "Bd")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(format_table(results, TINY if args.tiny else MODELS[args.model]))
    return results


def format_table(results: Dict[str, Any], config: Dict[str, Any]) -> str:
    tokens = results["batch"] * results["seq"]
    lines = [f"GPU: {results['gpu']}, torch {results['torch']}, seq {results['seq']} x micro-batch {results['batch']}"]
    lines.append("| mode | set-up | step ms | tokens/s | step peak GiB | MFU | vs baseline |")
    lines.append("|---|---|---|---|---|---|---|")
    for key, value in results.items():
        if "/" not in key or not isinstance(value, dict):
            continue
        mode = key.split("/")[0]
        rows = value if "error" not in value else {key.split("/")[1]: value}
        for setup, row in rows.items():
            if "error" in row or "step_ms" not in row:
                lines.append(f"| {mode} | {setup} | error: {str(row.get('error', row))[-120:]!r} | | | | |")
                continue
            baseline = _baseline(results, mode, setup)
            ratio = f"{row['step_ms'] / baseline:.3f}" if baseline else "-"
            util = mfu(row["step_ms"], row["params"], config, tokens)
            peak = f"{row['step_peak_gib']:.2f}" if row.get("step_peak_gib") is not None else "-"
            lines.append(
                f"| {mode} | {setup} | {row['step_ms']:.1f} | {tokens / (row['step_ms'] / 1e3):,.0f} | {peak} |"
                f" {f'{util:.1%}' if util else '-'} | {ratio} |"
            )
    for mode in dict.fromkeys(key.split("/")[0] for key in results if "/" in key):
        steps = {s: _step_ms(results, mode, s) for s in ("A", "A8", "B", "B8", "B8r")}
        for fast, slow in (("A8", "A"), ("B8", "B"), ("B8r", "B")):
            if steps[fast] and steps[slow]:
                lines.append(f"{mode}: float8 speed-up {slow}/{fast} = {steps[slow] / steps[fast]:.3f}x")
    if "host_syncs" in results:
        lines.append(f"host syncs per step of B: {results['host_syncs']}")
    if "nonfinite" in results:
        lines.append(f"a non-finite norm with error_if_nonfinite=True: {results['nonfinite']}")
    return "\n".join(lines)


def _step_ms(results: Dict[str, Any], mode: str, setup: str) -> Optional[float]:
    for key in (f"{mode}/float8", f"{mode}/bf16-true", f"{mode}/{setup}"):
        row = results.get(key, {}).get(setup)
        if isinstance(row, dict) and "step_ms" in row:
            return row["step_ms"]
    return None


def _baseline(results: Dict[str, Any], mode: str, setup: str) -> Optional[float]:
    """A for A, A8, B, Bd, Br, N and HF; A' for A' and D; A8 for B8 and B8r (the same recipe by hand)."""
    name = "A'" if setup in ("A'", "D") else "A8" if setup in FLOAT8_RECIPES else "A"
    group = "bf16-mixed" if name == "A'" else "bf16-true"
    row = (
        results.get(f"{mode}/{group}", {}).get(name)
        or results.get(f"{mode}/float8", {}).get(name)
        or results.get(f"{mode}/{name}", {}).get(name)
    )
    return row["step_ms"] if isinstance(row, dict) and "step_ms" in row else None


if __name__ == "__main__":
    main()
