"""Back-of-envelope helpers the worked examples check against (not the planner's model)."""

from __future__ import annotations

import math

from fivefold.errors import ConfigError
from fivefold.planner.memory.activations import SIMPLE_K
from fivefold.planner.memory.model_states import Tenants, local_kv_width, model_state_bytes
from fivefold.specs.hardware import GPUSpec
from fivefold.specs.model import ModelSpec
from fivefold.specs.precision import PrecisionRecipe, recipe

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


# ---- memory of raw counts (the simple k = 12 model) and TP layout -----------------------------
def simple_activation_bytes(
    layers: int, hidden: int, micro_batch: int, seq_len: int, element_bytes: float = 2
) -> float:
    """The DeepSeek-V3 book's activation estimate: 12 * L * B * S * d * bytes."""
    for name, value in (
        ("layers", layers),
        ("hidden", hidden),
        ("micro_batch", micro_batch),
        ("seq_len", seq_len),
    ):
        if value <= 0:
            raise ConfigError(f"{name} = {value}: must be positive.")
    return SIMPLE_K * layers * micro_batch * seq_len * hidden * element_bytes


def training_memory(
    n_params: float,
    *,
    layers: int,
    hidden: int,
    micro_batch: int,
    seq_len: int,
    precision: PrecisionRecipe | str = "bf16-mixed",
    zero: int = 0,
    shard: int = 1,
) -> Tenants:
    """The DeepSeek-V3 book's four tenants (simple k = 12 activations) for raw counts."""
    rec = recipe(precision) if isinstance(precision, str) else precision
    state = model_state_bytes(n_params, rec, zero, shard)
    acts = simple_activation_bytes(layers, hidden, micro_batch, seq_len, rec.activation_bytes)
    return Tenants(state.params, state.grads, state.optimizer, acts)


def min_gpus(total_bytes: float, hbm_bytes: float) -> int:
    """GPUs needed if the bytes could be split perfectly: ceil(total / HBM)."""
    if hbm_bytes <= 0:
        raise ConfigError(f"HBM capacity = {hbm_bytes}: must be positive.")
    return max(1, math.ceil(total_bytes / hbm_bytes - 1e-12))


def max_params_unsharded(hbm_bytes: float, precision: PrecisionRecipe | str) -> float:
    """Largest parameter count whose model state fits one GPU without sharding (no activations)."""
    rec = recipe(precision) if isinstance(precision, str) else precision
    return hbm_bytes / rec.bytes_per_param


def heads_per_rank(model: ModelSpec, tp: int) -> int:
    """Query heads each TP rank holds."""
    if model.heads % tp:
        raise ConfigError(f"plan.tp = {tp} must divide model.heads = {model.heads}.")
    return model.heads // tp


def qkv_params_per_rank(model: ModelSpec, tp: int) -> float:
    """Parameters of the column-parallel Q, K and V projections on one TP rank."""
    return model.hidden * (model.q_width / tp + 2 * local_kv_width(model, tp))
