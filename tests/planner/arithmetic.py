"""Back-of-envelope helpers the worked examples check against (not the planner's model)."""

from __future__ import annotations

from fivefold.spec.hardware import GPUSpec

SECONDS_PER_YEAR = 365.25 * 86400


def training_flops(n_params: float, tokens: float) -> float:
    """The 6 N D rule: forward (2N) plus backward (4N) FLOPs per token, times D tokens."""
    return 6.0 * n_params * tokens


def time_to_train_s(flops: float, gpus: int, peak_flops: float, mfu: float = 1.0) -> float:
    """Seconds to do `flops` on `gpus` devices of `peak_flops` each at utilisation `mfu`."""
    return flops / (gpus * peak_flops * mfu)


def gemm_intensity(
    m: float, n: float, k: float, element_bytes: float = 2, include_output: bool = True
) -> float:
    """FLOP per byte of an (m x k) @ (k x n) matmul: 2mnk over the bytes of its operands (and
    of its output unless `include_output` is False)."""
    moved = m * k + k * n + (m * n if include_output else 0)
    return 2.0 * m * n * k / (element_bytes * moved)


def ridge_point(device: GPUSpec, dtype: str = "bf16") -> float:
    """FLOP per byte where the roofline turns: peak FLOP/s over HBM bytes/s."""
    return device.peak(dtype) / device.hbm_bw_bytes_per_s
