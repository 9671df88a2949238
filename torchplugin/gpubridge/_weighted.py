"""Sample-weighted gradient averaging, for ranks with unequal shares of the
global batch (gpubridge.RebalancingSampler; docs/REBALANCING.md).

With shares m_r of a global batch of B samples and each rank's gradient
g_r the mean over its own m_r samples, the gradient of the global batch is
sum_r (m_r / B) g_r: each rank's gradient weighted by its share before the
sum, which plain averaging (sum_r g_r / n) gets right only when the shares
are equal.

- DDP: :func:`weighted_comm_hook` with a :class:`SampleWeights` as its
  state multiplies the bucket by n * m_r / B and hands it to an averaging
  hook (``gpubridge.ddp_comm_hook`` on a gpubridge group, torch's
  allreduce hook otherwise, or one given): the weights are applied before
  whatever that hook does, quantization and error feedback included.
- FSDP2: :func:`weighted_fsdp` makes fully_shard's reduce-scatter sum (no
  division: ``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)``, torch 2.8 and later) and the
  trainer scales its loss by ``weights.loss_scale()`` (m_r / B), so each
  rank's gradient enters the reduce-scatter already weighted.

No ``from __future__ import annotations``: DDP checks the hook's
annotations at registration and needs the real types.
"""

from typing import Any

import torch
import torch.distributed as dist

from gpubridge._hook import ddp_comm_hook

__all__ = ["SampleWeights", "weighted_comm_hook", "weighted_fsdp"]

Hook = Any  # (state, GradBucket) -> Future[Tensor]


class SampleWeights:
    """The state of :func:`weighted_comm_hook`: this rank's samples and the
    global batch's, set every step (``weights.set(len(batch),
    sampler.global_batch_size)``) before the backward that synchronises.
    group: the DDP group (None: the default group); hook and hook_state:
    the averaging hook the weighted bucket goes to (default: gpubridge's
    on a gpubridge group, else torch's allreduce hook, each with the
    group)."""

    def __init__(self, group: Any = None, hook: Hook | None = None, hook_state: Any = None) -> None:
        self.group = group
        self.hook = hook
        self.hook_state = hook_state if hook_state is not None else group
        self.local: int | None = None
        self.total: int | None = None

    def set(self, local_samples: int, global_samples: int) -> None:
        """This rank's samples in the step and the step's global batch."""
        if not 0 <= local_samples <= global_samples or global_samples < 1:
            raise ValueError(
                f"gpubridge.SampleWeights.set: {local_samples} local of {global_samples} global samples"
            )
        self.local, self.total = local_samples, global_samples

    @property
    def weight(self) -> float:
        """m_r / B."""
        if self.local is None or self.total is None:
            raise RuntimeError(
                "gpubridge.SampleWeights: set(local_samples, global_samples) was not called before the "
                "backward (call it every step, with len(batch) and the sampler's global_batch_size)"
            )
        return self.local / self.total

    def loss_scale(self, samples: int | None = None) -> float:
        """FSDP (with :func:`weighted_fsdp`), or one micro-batch of a step
        with gradient accumulation: the factor for a loss that is the mean
        over samples (default: all of this rank's samples in the step):
        samples / B."""
        w = self.weight
        if samples is None:
            return w
        assert self.total is not None  # weight checked it
        return samples / self.total

    def _inner(self) -> Hook:
        if self.hook is not None:
            return self.hook
        pg = self.group if self.group is not None else dist.group.WORLD
        if dist.get_backend(pg) == "gpubridge":
            return ddp_comm_hook
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: PLC0415

        return allreduce_hook


def weighted_comm_hook(state: SampleWeights, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # type: ignore[name-defined]
    """A DDP communication hook that averages the ranks' gradients weighted
    by their samples: ``model.register_comm_hook(weights,
    gpubridge.weighted_comm_hook)``. The bucket is multiplied by n * m_r / B
    here, then averaged over the n ranks by the state's inner hook: the sum
    of (m_r / B) g_r, the global batch's gradient."""
    if not isinstance(state, SampleWeights):
        raise TypeError("gpubridge.weighted_comm_hook: its state must be a gpubridge.SampleWeights")
    pg = state.group if state.group is not None else dist.group.WORLD
    scale = state.weight * dist.get_world_size(pg)
    if scale != 1.0:
        bucket.buffer().mul_(scale)
    fut: torch.futures.Future[torch.Tensor] = state._inner()(state.hook_state, bucket)
    return fut


def weighted_fsdp(module: torch.nn.Module) -> int:
    """Makes every fully_shard (FSDP2) module under module (itself
    included) reduce-scatter its gradients as a plain sum, so that losses
    scaled by ``SampleWeights.loss_scale()`` add up to the global batch's
    gradient. Returns how many modules it set."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    n = 0
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
            n += 1
    if n == 0:
        raise ValueError("gpubridge.weighted_fsdp: no fully_shard module in this module")
    return n
