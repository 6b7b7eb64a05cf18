"""The Llama-style decoder: embeddings, pre-norm blocks (attention + MLP or MoE), norm, LM head.

Parallel code addresses parts by torchtitan-like names: `tok_embeddings`, `layers["i"]`, `norm`,
`output`; any of the three ends may be set to None to make a pipeline stage, and `layers` keeps
its original string keys so parameter names (and thus initial values) stay the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.model import init as model_init
from fivefold.model.attention import Attention
from fivefold.model.attention_variants import attention_variants
from fivefold.model.document_layout import DocumentLayout
from fivefold.model.feed_forward import FeedForward
from fivefold.model.latent_attention import LatentAttention
from fivefold.model.moe import MoE
from fivefold.model.norms import RMSNorm
from fivefold.model.rope import rope_cos_sin
from fivefold.model.rope_scaling import rope_scaling_of
from fivefold.model.routers import router_settings
from fivefold.specs.model import ModelSpec


def build_attention(spec: ModelSpec, layer_id: int) -> nn.Module:
    """One layer's attention: `LatentAttention` for model.attention = "mla", else `Attention`
    with the variants the spec asks for (its window in that layer)."""
    if spec.is_mla:
        return LatentAttention(spec, spec.layer_window(layer_id))
    return Attention(
        spec.hidden,
        spec.heads,
        spec.kv_heads,
        spec.head_dim,
        **attention_variants(spec, layer_id),
    )


class TransformerBlock(nn.Module):
    """h + attention(norm(h)), then + mlp(norm(h)); x [B, T, D] -> [B, T, D].

    Layers with index < spec.dense_layers, and every layer of a dense model, own `.feed_forward`
    (and `.moe` is None); the others own `.moe` (and `.feed_forward` is None).
    """

    def __init__(self, layer_id: int, spec: ModelSpec) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(spec.hidden, spec.norm_eps)
        self.attention = build_attention(spec, layer_id)
        self.ffn_norm = RMSNorm(spec.hidden, spec.norm_eps)
        is_moe = spec.is_moe and layer_id >= spec.dense_layers
        self.feed_forward = None if is_moe else FeedForward(spec.hidden, spec.ffn, spec.mlp)
        self.moe = (
            MoE(
                spec.hidden,
                spec.experts,
                spec.top_k,
                spec.expert_ffn,
                spec.shared_experts,
                spec.router_aux_loss_coef,
                spec.router_norm_topk,
                router_settings(spec),
            )
            if is_moe
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: DocumentLayout | None = None,
    ) -> torch.Tensor:
        """`rope` the (cos, sin) tables and `docs` the documents, both built once per forward."""
        h = x + self.attention(self.attention_norm(x), rope, docs)
        mlp = self.moe if self.moe is not None else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder-only LM: forward(tokens [B, T], positions=None, doc_ids=None, cu_seqlens=None)
    -> fp32 [B, T, V].

    Without `tok_embeddings` the input is hidden states [B, T, D]; without `output` the result is
    hidden states [B, T, D] (after `norm` if present). `positions` default to 0..T-1 per row.
    The RoPE tables and the document layout are computed here, once per forward, and passed to
    every layer (doc ids are read on the host at most once per forward; never when the batch
    brings its host-side document offsets, `cu_seqlens`: NumPy int32 [N+1] in the [B*T]
    tokens, `fivefold.train.data.Batch.cu_seqlens`).
    With tied embeddings `output.weight` is `tok_embeddings.weight` (re-tied after `to_empty`).
    With `head_in_loss` set (the training runtimes set it) the result is the final hidden states
    [B, T, D] even with an `output`: the loss applies the head (`fivefold.model.loss.head_loss`),
    so the [B, T, V] logits are never made.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab, spec.hidden)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, spec) for i in range(spec.layers)})
        self.norm: RMSNorm | None = RMSNorm(spec.hidden, spec.norm_eps)
        self.output: nn.Linear | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.head_in_loss = False
        # whether this forward's routing counts toward DeepSeek's load balancing (a pipeline
        # stage clears it for torch's shape-inference forward on placeholder inputs)
        self.counts_router_loads = True
        self._tie_embeddings()

    def _tie_embeddings(self) -> None:
        if (
            self.spec.tied_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse: bool = True):
        # Moving off the meta device (to_empty) creates new Parameter objects, which unties.
        result = super()._apply(fn, recurse)
        self._tie_embeddings()
        return result

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        cu_seqlens: Any = None,
    ) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            batch, seq = tokens.shape[:2]
            positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
        # The whole sequence's shape: a later pipeline stage under sequence parallelism receives
        # hidden states holding only its 1/tp of the sequence.
        batch, seq = positions.shape
        rope = rope_cos_sin(
            positions, self.spec.rope_dim, self.spec.rope_theta, rope_scaling_of(self.spec)
        )
        docs = None
        if doc_ids is not None or cu_seqlens is not None:  # host offsets: no read-back
            docs = DocumentLayout(doc_ids, batch, seq, cu_seqlens)
        moes = self.moe_layers()
        for moe in moes:
            moe.collects_aux_loss = True
            moe.routing.counts_load = self.counts_router_loads
        for layer in self.layers.values():
            h = layer(h, rope, docs)
        for moe in moes:  # a recompute in the backward keeps this forward's aux losses
            moe.collects_aux_loss = moe.routing.counts_load = False
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None or self.head_in_loss:
            return h
        return self.output(h).float()

    def init_weights(self, seed: int = 0) -> None:
        """Draw each parameter from a generator seeded by (seed, FQN); see `fivefold.model.init`."""
        # A tied head without its embedding (last pipeline stage) draws the embedding's values.
        aliases = init_aliases(self.spec)
        # looked up at call time: `fivefold plan check` replaces it under fake tensors
        model_init.init_module_weights(self, seed, layers=self.spec.layers, aliases=aliases)

    def moe_layers(self) -> list[MoE]:
        return [layer.moe for layer in self.layers.values() if layer.moe is not None]

    def aux_loss(self) -> torch.Tensor:
        """Sum of the MoE layers' load-balancing losses of the last forward (0 for dense models)."""
        losses = [moe.aux_loss for moe in self.moe_layers() if moe.aux_loss is not None]
        if not losses:
            return torch.zeros((), device=self._device())
        return torch.stack([loss.float() for loss in losses]).sum()

    def _device(self) -> torch.device:
        return next(self.parameters()).device


def init_aliases(spec: ModelSpec) -> dict[str, str]:
    """FQN aliases for `init_module_weights`: a tied head draws the embedding's values."""
    return {"output.weight": "tok_embeddings.weight"} if spec.tied_embeddings else {}


def build_model(spec: ModelSpec) -> Transformer:
    """The model for `spec` on the meta device (no memory); call `to_empty` then `init_weights`."""
    problems = spec.problems() or spec.runtime_problems()
    if problems:
        raise ConfigError(problems)
    with torch.device("meta"):
        return Transformer(spec)
