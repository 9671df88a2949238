"""A small LLaMA-style decoder for gpubridge's training benchmark (issue 4).

Pre-norm blocks of RMSNorm, causal self-attention with rotary position
embeddings (F.scaled_dot_product_attention, which picks flash attention on
Hopper in bf16) and a SwiGLU MLP; the output head shares the embedding's
weight. The default config (dim 768, 12 layers, 12 heads, vocab 32000, SwiGLU
hidden 2048) has 109.5M parameters. The data are synthetic: batches of random
token ids drawn once from a seeded generator, so every run sees the same
tokens.

``python bench/gpu/llama.py`` prints the parameter count of the default config
and runs one forward/backward of a short sequence on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Config", "Llama", "count_parameters", "synthetic_batches"]


@dataclass(frozen=True)
class Config:
    vocab: int = 32000
    dim: int = 768
    layers: int = 12
    heads: int = 12
    hidden: int = 2048  # SwiGLU width: 2/3 of 4*dim, rounded to a multiple of 256
    seq: int = 1024
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    @staticmethod
    def tiny() -> Config:
        """A config for CPU smoke tests (about 0.14M parameters)."""
        return Config(vocab=512, dim=64, layers=2, heads=4, hidden=192, seq=64)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the parameters' dtype, as LLaMA does.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, seq: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, shape (seq, head_dim/2), float32."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (even, odd) of the last dimension of x (batch, heads, seq, head_dim)."""
    t = x.shape[-2]
    c = cos[:t].to(x.dtype)
    s = sin[:t].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.dim // cfg.heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return out


class SwiGLU(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class Llama(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
            raise ValueError(f"dim {cfg.dim} must split into {cfg.heads} heads of even width")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        cos, sin = rope_tables(cfg.dim // cfg.heads, cfg.seq, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay 1
            # Scale the residual branches' output projections down with depth (GPT-2 style).
            scale = (
                1.0 / math.sqrt(2 * self.cfg.layers) if name.endswith(("out.weight", "down.weight")) else 1.0
            )
            nn.init.normal_(p, mean=0.0, std=std * scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (batch, seq, vocab) for token ids (batch, seq)."""
        x = self.embed(tokens)
        cos, sin = self.rope_cos, self.rope_sin
        assert isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (the tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


def synthetic_batches(
    cfg: Config, batch: int, n: int, seed: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (inputs, targets) pairs of shape (batch, seq): random token ids from a
    seeded CPU generator (the same on every machine), moved to device once."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, cfg.vocab, (batch, cfg.seq + 1), generator=g)
        out.append((t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device)))
    return out


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _main() -> None:
    cfg = Config()
    model = Llama(cfg)
    print(f"default config {cfg}: {count_parameters(model) / 1e6:.1f}M parameters")
    small = Config(seq=32)
    model = Llama(small).to(torch.bfloat16)
    (inputs, targets) = synthetic_batches(small, 2, 1, 0, torch.device("cpu"))[0]
    loss = loss_of(model, inputs, targets)
    torch.autograd.backward(loss)
    ln_vocab = math.log(small.vocab)
    print(f"seq 32 forward/backward on cpu in bf16: loss {loss.item():.3f} (ln vocab = {ln_vocab:.3f})")


if __name__ == "__main__":
    _main()
