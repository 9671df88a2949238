"""gpubridge: one PyTorch job across NVIDIA and AMD GPUs.

This package will register the ``gpubridge`` torch.distributed backend; that
registration comes with issue 4 and is not here yet. What is here is the data
path to ``gbbridge serve``: :mod:`gpubridge._feed`, a client of the feed
protocol (docs/FEED.md in the gpubridge repository).
"""

__version__ = "0.1.0.dev0"

__all__ = ["__version__"]
