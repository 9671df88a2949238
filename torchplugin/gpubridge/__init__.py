"""gpubridge: one PyTorch job across NVIDIA and AMD GPUs.

``import gpubridge`` registers the ``gpubridge`` torch.distributed backend
(:mod:`gpubridge._backend`; this first slice runs in simulation on CPU:
allreduce, broadcast, barrier). The data path to ``gbbridge serve`` is
:mod:`gpubridge._feed`, a client of the feed protocol (docs/FEED.md in the
gpubridge repository).
"""

from gpubridge._backend import BACKEND_NAME, GpubridgeProcessGroup, register

__version__ = "0.1.0.dev0"

__all__ = ["BACKEND_NAME", "GpubridgeProcessGroup", "__version__"]

register()
