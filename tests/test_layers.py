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
from lightning_mixedfsdp.model_setup import shard_model


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


def import_graph() -> "dict[str, dict[str, int]]":
    """Every module of the package -> the package's modules it imports, at any depth (a function's or a
    ``TYPE_CHECKING`` block's imports included, which import-linter does not see), with the line of one such import.
    ``from package import name`` counts as importing ``package.name`` when that is a module, else ``package``."""
    import ast

    paths = {}
    for path in sorted((ROOT / "lightning_mixedfsdp").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: "dict[str, dict[str, int]]" = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges = graph.setdefault(module, {})
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against the importing module's package
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in paths and target != module:
                    edges.setdefault(target, node.lineno)
    return graph


def import_cycles(graph: "dict[str, dict[str, int]]") -> "list[list[str]]":
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index: "dict[str, int]" = {}
    low: "dict[str, int]" = {}
    stack: "list[str]" = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycle_among_the_package_modules_lazy_imports_included():
    """No module of the package reaches itself through imports, counting the ones inside functions: a lazy import
    that only breaks a cycle hides a shared piece in the wrong module (move it down instead). A function may still
    import lazily to keep an optional package or Lightning off an import path, as long as no cycle needs it."""
    graph = import_graph()
    cycles = import_cycles(graph)
    where = [f"{a} -> {b} (line {graph[a][b]})" for cycle in cycles for a in cycle for b in graph[a] if b in cycle]
    assert not cycles, where


def test_the_cycle_check_sees_a_cycle_closed_inside_a_function(tmp_path, monkeypatch):
    """The check above on a package whose only cycle is closed by a function-level import."""
    package = tmp_path / "lightning_mixedfsdp"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from lightning_mixedfsdp.high import g\n    return g\n")
    (package / "high.py").write_text("from lightning_mixedfsdp import low\n\ndef g():\n    return low\n")
    (package / "alone.py").write_text("import lightning_mixedfsdp.low\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = import_graph()
    assert graph["lightning_mixedfsdp.low"] == {"lightning_mixedfsdp.high": 2}
    assert import_cycles(graph) == [["lightning_mixedfsdp.high", "lightning_mixedfsdp.low"]]


def test_every_module_of_the_package_is_named_in_the_architecture_doc():
    """docs/architecture.md keeps up with the package: each room's row names every module of the room (``stem``), a
    top-level module is named as ``name.py`` (a room of its own, or an entry point); a subpackage's ``__init__.py``
    is its room."""
    import re

    doc = (ROOT / "docs" / "architecture.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            rows[cells[1].strip("`")] = set(re.findall(r"`(\w+)`", cells[2]))
    unnamed = []
    for path in sorted((ROOT / "lightning_mixedfsdp").rglob("*.py")):
        relative = path.relative_to(ROOT / "lightning_mixedfsdp")
        if len(relative.parts) == 1:
            named = f"`{relative}`" in doc
        else:
            room = relative.parts[0] + "/"
            named = path.name == "__init__.py" and room in rows or path.stem in rows.get(room, set())
        if not named:
            unnamed.append(str(relative))
    assert rows and not unnamed, unnamed
