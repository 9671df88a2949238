"""gpubridge: one PyTorch job across NVIDIA and AMD GPUs.

``import gpubridge`` registers the torch.distributed backend ``gpubridge``
(:mod:`gpubridge._backend`; the group is :mod:`gpubridge._group`): vendor
islands on their native library (NCCL, RCCL under the "nccl" name; Gloo in
simulation and CPU-only runs), island leaders joined by ``gbbridge serve``. Use it with
``dist.init_process_group(backend="gpubridge")``, or through the native API
here (:func:`init`, :func:`all_reduce`, …); one or the other per process.
:func:`in_flight` says which collective each thread is inside, without
blocking; :mod:`gpubridge.observe` hands each collective's record to
observers, and every rank keeps its last ones in a flight recorder
(:func:`dump_trace`; docs/TRACING.md). On ranks of unequal speed,
:class:`RebalancingSampler` gives the faster ones more of each global
batch and :func:`weighted_comm_hook` (:class:`SampleWeights`; FSDP:
:func:`weighted_fsdp`) weights each rank's gradient by its share
(docs/REBALANCING.md). ``GPUBRIDGE_COMPRESSION`` compresses the bridged
steps, and :func:`compressed_hook` with a :class:`CompressionState` all-
reduces DDP's gradients compressed with error feedback
(docs/COMPRESSION.md). The data path to gbbridge is
:mod:`gpubridge._feed` (docs/FEED.md).
"""

from gpubridge import observe
from gpubridge._backend import register
from gpubridge._compressed import CompressionState, compressed_hook
from gpubridge._group import BACKEND_NAME, GpubridgeProcessGroup
from gpubridge._hook import ddp_comm_hook
from gpubridge._inflight import in_flight
from gpubridge._native import (
    all_gather_into_tensor,
    all_reduce,
    barrier,
    broadcast,
    destroy,
    get_topology,
    init,
    is_initialized,
    probe,
    reduce_scatter_tensor,
)
from gpubridge._rebalance import RebalancingSampler
from gpubridge._weighted import SampleWeights, weighted_comm_hook, weighted_fsdp
from gpubridge.observe import CollectiveObserver, add_observer, dump_trace, remove_observer

__version__ = "0.1.0.dev0"

__all__ = [
    "BACKEND_NAME",
    "CollectiveObserver",
    "CompressionState",
    "GpubridgeProcessGroup",
    "RebalancingSampler",
    "SampleWeights",
    "__version__",
    "add_observer",
    "all_gather_into_tensor",
    "all_reduce",
    "barrier",
    "broadcast",
    "compressed_hook",
    "ddp_comm_hook",
    "destroy",
    "dump_trace",
    "get_topology",
    "in_flight",
    "init",
    "is_initialized",
    "observe",
    "probe",
    "reduce_scatter_tensor",
    "remove_observer",
    "weighted_comm_hook",
    "weighted_fsdp",
]

register()
