"""Text generation from a trained decoder: greedy or nucleus (top-p) sampling, one sequence.

Each new token re-runs the model over the whole context (at most `seq_len` tokens, the newest
kept): no KV cache, which fivefold's training model does not have; fine for looking at what a
small model learned, not for serving. Generation stops at the end-of-document token (included
in the output) or after `max_new_tokens`.
"""

from __future__ import annotations

import torch
from torch import nn


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits [V] with every token outside the nucleus set to -inf: the nucleus is the smallest
    set of most likely tokens whose probabilities sum to at least `top_p` (0 < top_p <= 1)."""
    probs = torch.softmax(logits.float(), dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
    drop_sorted = before >= top_p  # a token is kept while the mass before it is short of top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    seq_len: int,
    eod_id: int | None = None,
    top_p: float | None = None,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The tokens generated after `prompt` (not including it). `top_p` None: greedy (argmax);
    else sample from the top-p nucleus of softmax(logits / temperature) with `generator`."""
    device = next(model.parameters()).device
    context = list(prompt)
    out: list[int] = []
    for _ in range(max_new_tokens):
        window = torch.tensor([context[-seq_len:]], dtype=torch.long, device=device)
        logits = model(window)[0, -1].float()  # [V]
        if top_p is None:
            token = int(logits.argmax())
        else:
            filtered = top_p_filter(logits / temperature, top_p)
            probs = torch.softmax(filtered, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        context.append(token)
        if token == eod_id:
            break
    return out
