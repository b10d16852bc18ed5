"""Linear layers whose weights stay compressed; each forward reads the compressed bytes.

Drop-in for nn.Linear in the transformer: [..., in] -> [..., out] in the input's dtype.
On CPU they use cpu_matmul, on CUDA triton_matmul. Compressed tensors are buffers, so
they move with the module and count in its memory.
"""

from __future__ import annotations

import torch
from torch import nn

from kamado.surgery import cpu_matmul, formats


class QuantizedLinear(nn.Module):
    """What every compressed linear shares: shapes, an optional bias, and the flattening of
    leading dimensions around a 2-D matmul."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features))
        return y.view(*x.shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def cuda_matmul(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """The matmul on CUDA (triton_matmul), plain or `gated`."""
        raise NotImplementedError

    def silu_gated(self, x: torch.Tensor) -> torch.Tensor:
        """For a fused gate/up projection (gate's rows, then up's) on CUDA: silu(gate) * up
        of 2-D x, in the GEMV's epilogue where one runs (triton_matmul's `gated`)."""
        return self.cuda_matmul(x, gated=True)

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8Linear(QuantizedLinear):
    """w = q * scale; one scale per row (torch's int8 kernel on CPU) or per group (on CPU,
    two int4 layers: cpu_matmul.pack_int8_groups)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        self.group = q.shape[1] // scales.shape[1]
        self.grouped_cpu = scales.shape[1] > 1 and not q.is_cuda
        if self.grouped_cpu:
            (low, low_scale_zeros), (high, high_scale_zeros) = cpu_matmul.pack_int8_groups(
                q, scales
            )
            self.register_buffer("low", low)
            self.register_buffer("low_scale_zeros", low_scale_zeros)
            self.register_buffer("high", high)
            self.register_buffer("high_scale_zeros", high_scale_zeros)
            return
        self.register_buffer("q", q)
        if not q.is_cuda:  # torch's CPU kernel takes [out] scales in its dtype
            scales = scales[:, 0].to(cpu_matmul.KERNEL_DTYPE)
        self.register_buffer("scales", scales)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.cuda_matmul(x)
        if self.grouped_cpu:
            packs = (self.low, self.low_scale_zeros), (self.high, self.high_scale_zeros)
            y = cpu_matmul.int8_grouped(x, packs, self.group)
            return self._add_bias(y[:, : self.out_features])
        return self._add_bias(cpu_matmul.int8_rowwise(x, self.q, self.scales))

    def cuda_matmul(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        from kamado.surgery.triton_matmul import int8_matmul

        return int8_matmul(x, self.q, self.scales, self.bias, gated)


class Int4Linear(QuantizedLinear):
    """w = q * scale + min per group of `in`, q in 0..15, two values per byte."""

    def __init__(
        self,
        q: torch.Tensor,  # uint8 values 0..15, [out, in]
        scales: torch.Tensor,
        mins: torch.Tensor,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        self.group = q.shape[1] // scales.shape[1]
        if q.is_cuda:  # triton_matmul.int4_matmul's layout
            self.register_buffer("packed", formats.pack_int4(q, self.group))
            self.register_buffer("scale_mins", formats.pack_int4_scale_mins(scales, mins))
        else:
            packed, scale_zeros = cpu_matmul.pack_int4(q, scales, mins)
            self.register_buffer("packed", packed)
            self.register_buffer("scale_zeros", scale_zeros)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return self.cuda_matmul(x)
        y = cpu_matmul.int4_grouped(x, self.packed, self.scale_zeros, self.group)
        return self._add_bias(y[:, : self.out_features])

    def cuda_matmul(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        from kamado.surgery.triton_matmul import int4_matmul

        return int4_matmul(x, self.packed, self.scale_mins, self.bias, gated)


class Fp8Linear(QuantizedLinear):
    """w = q * scale, q in float8 e4m3, one scale per row; CUDA on Ada/Hopper only."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__(q.shape[1], q.shape[0], bias)
        self.register_buffer("q", q)
        self.register_buffer("scales", scales.view(-1, 1))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.cuda_matmul(x)

    def cuda_matmul(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        from kamado.surgery.triton_matmul import fp8_matmul

        return fp8_matmul(x, self.q, self.scales, self.bias, gated)


class RowConcat(nn.Module):
    """Several linears over the same input as one, their outputs side by side: the fusion of
    layers whose stored formats cannot be concatenated (GGUF tensors of different types)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)
