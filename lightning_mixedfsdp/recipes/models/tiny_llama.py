"""Small reference models built from config: tests, examples, benchmarks and the recipe share them."""

from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class TinyLlamaConfig:
    vocab_size: int = 256
    """Byte-level vocabulary."""
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 128
    """SwiGLU inner width."""
    mixer_layers: List[int] = field(default_factory=list)
    """Layers whose attention is replaced by a Mamba-style mixer with a bare fp32 ``A_log`` beside ``dt_bias``."""
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """Llama's RMSNorm: statistics in fp32, the result in the input dtype times the weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        batch, seq, dim = x.shape
        heads = lambda t: t.view(batch, seq, self.n_heads, dim // self.n_heads).transpose(1, 2)  # noqa: E731
        q, k = _rope(heads(self.wq(x)), positions), _rope(heads(self.wk(x)), positions)
        if positions is not None and positions.dim() == 2:  # packed rows: each document attends only to itself
            mask = _same_document(positions)[:, None] & torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
            out = F.scaled_dot_product_attention(q, k, heads(self.wv(x)), attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q, k, heads(self.wv(x)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, dim))


def _documents(positions: Tensor) -> Tensor:
    """Each token's document within its packed row (``batch x sequence`` positions restart at 0 at each)."""
    return torch.cumsum((positions == 0).to(torch.int64), dim=-1)


def _same_document(positions: Tensor) -> Tensor:
    documents = _documents(positions)
    return documents[:, :, None] == documents[:, None, :]


def _rope(x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
    """Rotary embedding computed on the fly in fp32 (no buffers to cast), at ``positions``: 0, 1, 2, ... by default;
    one row of a sequence's global positions shared by every row (a rank holding part of a sequence under context
    parallelism rotates its tokens by where they are in the whole sequence); or one row per sequence (packed rows,
    restarting at each document)."""
    seq, head_dim = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=x.device, dtype=torch.float32) / head_dim))
    where = torch.arange(seq, device=x.device) if positions is None else positions.to(x.device)
    angles = where.to(torch.float32)[..., None] * inv_freq
    if angles.dim() == 3:  # per row: broadcast over the heads
        angles = angles[:, None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Mixer(nn.Module):
    """A Mamba/GatedDeltaNet-style token mixer: ``A_log`` and ``dt_bias`` are bare params of the module that holds the
    projections, so no module boundary separates them (fp32 under the default rules) from the bf16 projections, nor
    an fp32 ``A_log`` from a bf16 ``dt_bias`` (``keep_fp32_params=[r"A_log$"]``)."""

    # declared the way HF models declare it, so the default rules (honor_hf_keep_in_fp32) keep A_log fp32
    _keep_in_fp32_modules = ["A_log"]

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(dim))
        self.dt_bias = nn.Parameter(torch.empty(dim))
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.A_log.copy_(torch.log(torch.linspace(1.0, 16.0, self.A_log.numel())))
            self.dt_bias.fill_(-1.0)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``positions``: one row per sequence restarting at 0 at each packed document, whose running mean then
        restarts there too; None: one document per row."""
        h = self.in_proj(x)
        dt = F.softplus(h + self.dt_bias)
        decay = torch.exp(-torch.exp(self.A_log.float()) * dt.float())  # fp32 like HF Mamba
        # causal running mean of decayed features: cheap, differentiable, uses both bare params
        summed = torch.cumsum(decay * h.float(), dim=1)
        if positions is None or positions.dim() != 2:
            mixed = summed / torch.arange(1, x.shape[1] + 1, device=x.device)[:, None]
        else:  # per document: minus the sum before the document's first token
            index = torch.arange(x.shape[1], device=x.device) - positions.to(x.device)  # each token's document start
            before = F.pad(summed, (0, 0, 1, 0)).gather(1, index[..., None].expand(-1, -1, summed.shape[-1]))
            mixed = (summed - before) / (positions.to(x.device) + 1)[..., None]
        return self.out_proj(mixed.to(h.dtype))


class Block(nn.Module):
    def __init__(self, config: TinyLlamaConfig, use_mixer: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Mixer(config.dim) if use_mixer else Attention(config.dim, config.n_heads)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config.dim, config.hidden_dim)

    def forward(self, x: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        normed = self.attention_norm(x)
        if positions is None and not isinstance(self.attention, Attention):
            mixed = self.attention(normed)  # a mixer, or a wrapper of one, needs no positions for whole rows
        else:
            mixed = self.attention(normed, positions)
        x = x + mixed
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """A byte-level Llama-style causal LM: embeddings, blocks in an ``nn.ModuleList``, final RMSNorm, head."""

    pipeline_blocks = "layers"
    """Pipeline parallelism splits it at its blocks: its forward runs the modules before them, the blocks (each
    taking ``positions``), and the modules after, in registration order."""

    def __init__(self, config: TinyLlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i in config.mixer_layers) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, tokens: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """Logits of ``tokens`` (batch x sequence). ``positions``: one row, the tokens' positions in the sequences
        they are part of (context parallelism); or ``batch x sequence``, restarting at 0 at each document packed
        into a row (attention and the mixer's running mean stay within each document)."""
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, positions)
        return self.output(self.norm(x))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)


def causal_lm_loss(logits: Tensor, tokens: Tensor) -> Tensor:
    """Next-token cross entropy in fp32; the targets follow the logits to their device."""
    targets = tokens[:, 1:].reshape(-1).to(logits.device)
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets)


class Issue156784Model(nn.Module):
    """pytorch/pytorch#156784: fp32 Linear layers and one bf16 Linear, no mixed-precision policy. The model's own
    forward casts around the bf16 layer, as it must to run at all without FSDP."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.hidden = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.relu(self.inp(x))
        x = torch.relu(self.hidden(x.to(torch.bfloat16))).float()
        return self.out(x)


class MoEBlock(nn.Module):
    """Top-1 routed experts beside an fp32-able router bias: when a rank routes no token to an expert, that expert
    is never called there and its params get no grad on that rank."""

    def __init__(self, dim: int, n_experts: int) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, 4 * dim, bias=False)
        self.proj_out = nn.Linear(4 * dim, dim, bias=False)
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(n_experts))
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_experts))

    def forward(self, x: Tensor, route: Optional[Tensor] = None) -> Tensor:
        h = self.proj_out(F.silu(self.proj_in(x)))
        scores = self.router(h).float() + self.e_score_correction_bias
        choice = scores.argmax(-1) if route is None else route
        weight = torch.softmax(scores, -1).gather(-1, choice[..., None]).to(h.dtype)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            mask = choice == index
            if mask.any():
                out[mask] = expert(h[mask]).to(out.dtype)
        return out * weight


class TinyMoE(nn.Module):
    def __init__(self, dim: int = 16, n_experts: int = 2, n_layers: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock(dim, n_experts) for _ in range(n_layers))
        self.head = nn.Linear(dim, 1, bias=False)

    def forward(self, x: Tensor, route: Optional[Tensor] = None) -> Tensor:
        for layer in self.layers:
            x = x + layer(x, route)
        return self.head(x).squeeze(-1)


__all__ = [
    "Issue156784Model",
    "RMSNorm",
    "TinyLlama",
    "TinyLlamaConfig",
    "TinyMoE",
    "causal_lm_loss",
]
