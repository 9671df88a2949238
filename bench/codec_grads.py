"""Gradient dumps for the codec benchmarks: a small LLaMA-style decoder
(bench/gpu/llama.py: dim 256, 4 layers, vocab 8192, 5.3M parameters) trained
on CPU with AdamW on sequences of a fixed random Markov chain
(bench/codec_accuracy.py's data), its gradients saved as one flat buffer in
parameter order (what DDP puts in its buckets) at steps 1, 10 and 40, as
float32 and as bfloat16 (rounded to nearest even by gpubridge._codec, saved
as numpy's 2-byte void, as ml_dtypes does).

    python bench/codec_grads.py OUTDIR

About a minute on two cores; seeded, so the dumps are the same every run on
one torch version."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "torchplugin"), str(REPO / "bench" / "gpu"), str(REPO / "bench")]

from codec_accuracy import lm_batch, markov  # noqa: E402
from llama import Config, Llama, loss_of  # noqa: E402

from gpubridge import _codec  # noqa: E402

STEPS = (1, 10, 40)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = Config(vocab=8192, dim=256, layers=4, heads=4, hidden=768, seq=64)
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    chain = markov(cfg.vocab, 1)
    g = torch.Generator().manual_seed(7)
    n = sum(p.numel() for p in model.parameters())
    print(f"{n / 1e6:.1f}M parameters", file=sys.stderr)
    for step in range(1, max(STEPS) + 1):
        inputs, targets = lm_batch(chain, 8, cfg.seq, g)
        loss = loss_of(model, inputs, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if step in STEPS:
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
            np.save(out / f"grads-step{step}-f32.npy", flat.numpy())
            bf = _codec.bf16_encode(flat).numpy().view("V2")
            np.save(out / f"grads-step{step}-bf16.npy", bf)
            print(f"step {step}: loss {loss.item():.3f}, {flat.numel()} gradients saved", file=sys.stderr)
        opt.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
