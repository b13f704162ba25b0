"""RMSNorm with an optional fused residual add (the Llama pre-norm pattern)."""

from __future__ import annotations

import torch
from torch import nn

from loraplex.kernels.backends import get_backend
from loraplex.kernels.lora import PendingExpand


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalized in fp32 like HF.

    `forward(x, residual)` first adds `residual` to `x` and returns the sum as the
    new residual stream, so decoder layers never materialize the add twice (the Triton
    kernels do both in one pass).
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        kernels: str = "torch",
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.kernels = get_backend(kernels)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        pending: PendingExpand | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [T, hidden] -> (normed [T, hidden], new residual [T, hidden]).
        `pending`: the LoRA expand x's projection left undone (`forward_deferred`),
        added first, inside the norm's kernel on the Triton backend."""
        return self.kernels.rms_norm(x, residual, self.weight, self.eps, pending)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
