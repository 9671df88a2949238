"""Error feedback: the residuals a compressing member keeps between steps.

Quantizing a gradient loses a little of it every step; error feedback adds
what was lost to the next step's buffer before quantizing, so that nothing
is lost for good, only late (docs/COMPRESSION.md, "Error feedback"). One
residual is kept per buffer identity (a DDP bucket's index, a parameter's
name), size and dtype: a buffer whose size changed (DDP rebuilds its
buckets after the first iteration), or whose dtype did, starts again from
zero, as gbbridge's residuals do. The residuals cost 4 bytes a
value, on the buffer's device, whatever its dtype; ``clear`` frees them
(the group does it when it is destroyed).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from gpubridge import _codec

__all__ = ["ErrorFeedback"]

_ENCODERS = {"fp8": _codec.mxfp8_encode_feedback, "bf16": _codec.bf16_encode_feedback}
_DECODERS: dict[str, _codec.Decoder] = {"fp8": _codec.mxfp8_decode, "bf16": _codec.bf16_decode}


class ErrorFeedback:
    """The residuals of one group for one codec ("fp8" or "bf16")."""

    def __init__(self, codec: str) -> None:
        if codec not in _ENCODERS:
            raise ValueError(f"error feedback is for the lossy codecs fp8 and bf16, not {codec!r}")
        self.codec = codec
        self._residuals: dict[Hashable, torch.Tensor] = {}
        self._dtypes: dict[Hashable, torch.dtype] = {}  # each residual's buffer's dtype
        self._lock = threading.Lock()
        self.dropped = 0  # residuals dropped because their buffer changed size, dtype or device

    def residual(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """The residual of buffer key for a buffer like x: the kept one, or
        zeros when there is none or x's size, dtype or device differs from
        the kept one's (which is dropped)."""
        with self._lock:
            r = self._residuals.get(key)
            if r is not None and (
                r.numel() != x.numel() or r.device != x.device or self._dtypes[key] != x.dtype
            ):
                self.dropped += 1
                r = None
            if r is None:
                r = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
                self._residuals[key] = r
                self._dtypes[key] = x.dtype
            return r

    def encode(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """Pack x with the codec and error feedback: x plus buffer key's
        residual is quantized, and the residual becomes what that lost."""
        return _ENCODERS[self.codec](x, self.residual(key, x))

    def quantize(self, key: Hashable, x: torch.Tensor) -> torch.Tensor:
        """x as the bridge would carry it with error feedback: encoded, then
        decoded (float32, flat), for a comm hook that simulates the codec."""
        return _DECODERS[self.codec](self.encode(key, x), x.numel())

    def drop(self, key: Hashable) -> None:
        """Forget buffer key's residual."""
        with self._lock:
            self._residuals.pop(key, None)
            self._dtypes.pop(key, None)

    def clear(self) -> None:
        """Forget every residual (and free its memory)."""
        with self._lock:
            self._residuals.clear()
            self._dtypes.clear()

    def __len__(self) -> int:
        return len(self._residuals)

    @property
    def nbytes(self) -> int:
        """The memory the residuals hold: 4 bytes a value."""
        with self._lock:
            return sum(r.numel() * r.element_size() for r in self._residuals.values())
