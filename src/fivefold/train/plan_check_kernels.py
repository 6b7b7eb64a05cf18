"""`fivefold plan check` on a GPU cluster: attention runs the CUDA kernels a GPU run calls, as
their fake (meta) implementations, so the tensors the check counts are those a GPU saves.

A fake world holds no device, but torch registers fake kernels for the CUDA attention ops, and a
fake tensor runs them whatever device it names: a whole sequence goes through
`aten._scaled_dot_product_flash_attention` (what SDPA picks on a GPU for fp16/bf16, GQA
native), and context parallelism's blocks through the varlen `aten._flash_attention_forward` /
`_flash_attention_backward` (`fivefold.model.attention_blocks`, as on CUDA). Everything else
(matmuls, norms, FSDP2, DTensor, collectives) runs as fake CPU tensors of the same shapes and
dtypes. Each rank reports how many calls went down each path (flash, flash_blocks, and cpu,
cpu_blocks for the calls in other dtypes).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import fivefold.model.attention_blocks as attention_blocks
from fivefold.model.attention import AttentionCore
from fivefold.parallel.mixed_precision import resolve_precision

GPU_DTYPES = (torch.float16, torch.bfloat16)  # the dtypes the CUDA flash kernels take


def gpu_kernels(recipe: Any) -> bool:
    """Whether `recipe` runs on GPUs in a dtype the CUDA flash kernels take."""
    dtype = resolve_precision(recipe.plan.precision, torch.device("cpu")).dtype
    return recipe.cluster.gpu != "cpu" and dtype in GPU_DTYPES


def patch_gpu_attention(patch, tally: Counter) -> None:
    """Attention through the CUDA kernels' fake implementations (module docstring); `tally`
    counts the calls of each path."""
    whole_sequence = AttentionCore.forward

    def forward(self, q, k, v, docs):
        if q.dtype in GPU_DTYPES and (docs is None or docs.single_document):
            tally["flash"] += 1
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
        tally["cpu"] += 1
        return whole_sequence(self, q, k, v, docs)

    def flash_blocks(q: torch.Tensor) -> bool:
        on = q.dtype in GPU_DTYPES
        tally["flash_blocks" if on else "cpu_blocks"] += 1
        return on

    patch(AttentionCore, "forward", forward)
    patch(attention_blocks, "uses_flash_blocks", flash_blocks)
