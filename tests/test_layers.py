"""The rooms' direction as a user of the torch-only layers sees it: they import and shard a model with Lightning not
installed (the import contracts themselves run in CI as ``lint-imports``)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_LIGHTNING = """
import sys

class NotInstalled:
    # what an environment without Lightning answers: no module of that name
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NotInstalled())

import os
import torch
import torch.distributed as dist
from torch import nn

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")

from lightning_mixedfsdp import MixedFSDPConfig, clip_grad_norm_, format_plan
from lightning_mixedfsdp.mesh import build_parallel_meshes
from lightning_mixedfsdp.pipeline import shard_model


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


torch.manual_seed(0)
model = Net()
config = MixedFSDPConfig(print_report=True)
sharded = shard_model(model, config, config.bulk_dtypes("bf16-true"), build_parallel_meshes("cpu", 1, 1, 1, 1),
                      torch.device("cpu"))
optimizer = torch.optim.AdamW(sharded.module.parameters(), lr=1e-2)
for _ in range(2):
    loss = sharded.module(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean()
    loss.backward()
    clip_grad_norm_(sharded.module.parameters(), 1.0, error_if_nonfinite=True)
    optimizer.step()
    optimizer.zero_grad()
dtypes = sorted({(n.split(".")[-2], str(p.dtype)) for n, p in sharded.module.named_parameters()})
print("DTYPES", dtypes)
print("LIGHTNING", sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "lightning_utilities")))
print("REPORT", format_plan(sharded.applied.plan).splitlines()[0])
dist.destroy_process_group()
"""


def test_the_torch_only_layers_plan_shard_and_train_without_lightning() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_LIGHTNING, port], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0].isupper())
    assert lines["LIGHTNING"] == "[]"
    # the LayerNorms stay fp32 beside the bf16 Linears: the plan was applied
    assert lines["DTYPES"] == str(sorted({("norm", "torch.float32"), ("proj", "torch.bfloat16")}))
    assert lines["REPORT"].startswith("mixed_fsdp2 dtype plan: 8 params")
    # print_report=True: the report through the package's logger, on stderr as no logging was configured
    assert "mixed_fsdp2 dtype plan: 8 params" in done.stderr and "blocks.*.norm.weight" in done.stderr


def test_every_class_and_function_stays_small():
    """The package's size limits, so one concern stays one place: no class over 180 lines (config groups included),
    no function over 60."""
    import ast

    too_long = []
    for path in sorted((ROOT / "lightning_mixedfsdp").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            limit = 180 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if lines > limit:
                    too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} > {limit})")
    assert not too_long, too_long
