"""Where the documents of a packed row are, read once per forward: `DocumentLayout` (runs of
equal `doc_ids` [B, T], their host-side starts, cumulative offsets and FlexAttention's
`BlockMask`), and the `Block`s of query and key chunks that attention runs over (per-document
`Span` rectangles, causal on the diagonal).
"""

from __future__ import annotations

import itertools
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask
from torch.utils.weak import WeakTensorKeyDictionary

from fivefold.model.sliding_window import window_span


class Chunk(NamedTuple):
    """`length` tokens held at local index `local` that are global tokens [start, start+length)."""

    local: int
    start: int
    length: int


class Span(NamedTuple):
    """Batch rows `rows`: queries `q` attend keys `k` (slices local to a block), causal or full;
    with `window` > 0 only the keys 0 <= shift + i - j < window (`sliding_window.span_mask`,
    `shift` = global position of the first query less that of the first key)."""

    rows: slice
    q: slice
    k: slice
    causal: bool
    window: int = 0
    shift: int = 0


class Block(NamedTuple):
    """Local query rows `q` against local key rows `k`; `spans` cover disjoint query rows."""

    q: slice
    k: slice
    spans: tuple[Span, ...]


class DocumentLayout:
    """The documents of a batch, computed once per forward and shared by every layer.

    doc_ids: LongTensor [B, T] (documents are runs of equal ids) or None (one document per row).
    `offsets`: the same documents as host-side cumulative offsets in the flattened [B*T] tokens
    (NumPy int32 [N+1], `fivefold.train.data.Batch.cu_seqlens`), or None.
    `row_groups` are (batch rows, document starts) with consecutive rows of equal boundaries
    merged, read from `offsets` when given (no device read-back), else from `doc_ids` on first
    use (one host copy). Under context parallelism `offsets` may be the whole rows' (ending at
    n * B*T): `whole_offsets`, from which the CP core reads the global documents. `cache`
    holds what a context-parallel core derives from it for this forward (global boundaries,
    ring blocks).
    Deliberately not a dataclass: hooks that map over a module's inputs (FSDP2's
    `cast_forward_inputs`, torch's `_apply_to_tensors`) rebuild dataclasses, which would hand
    every block a copy with a cache of its own; a plain object reaches every block as itself.
    """

    def __init__(
        self, doc_ids: torch.Tensor | None, batch: int, seq_len: int, offsets: Any = None
    ) -> None:
        # Offsets ending at a multiple n > 1 of B*T describe the whole rows of which this is a
        # context-parallel 1/n share: kept for the CP core (`whole_offsets`), not read here.
        self.whole_offsets = None
        if offsets is not None and _covers_shards(offsets, batch * seq_len):
            self.whole_offsets, offsets = offsets, None
        self.doc_ids, self.batch, self.seq_len, self.offsets = doc_ids, batch, seq_len, offsets
        self.cache: dict[Any, Any] = {}
        self._groups: tuple[tuple[slice, tuple[int, ...]], ...] | None = None
        self._single: bool | None = None

    def __repr__(self) -> str:
        return f"DocumentLayout(batch={self.batch}, seq_len={self.seq_len})"

    @property
    def row_groups(self) -> tuple[tuple[slice, tuple[int, ...]], ...]:
        if self._groups is None:
            if self.offsets is not None:
                self._groups = _offset_row_groups(self.offsets, self.batch, self.seq_len)
                if self.doc_ids is not None:  # the `document_attention` op reads it there
                    doc_ids_cache(self.doc_ids).setdefault("groups", self._groups)
            elif self.doc_ids is None:
                self._groups = _row_groups(None, self.batch, self.seq_len)
            else:
                cache = doc_ids_cache(self.doc_ids)
                if "groups" not in cache:
                    cache["groups"] = _row_groups(self.doc_ids, self.batch, self.seq_len)
                self._groups = cache["groups"]
        return self._groups

    @property
    def single_document(self) -> bool:
        """Every row is one document (SDPA's plain causal mask is exact); cached, so that once
        read eagerly a compiled block sees a plain bool (`fivefold.parallel.compile`)."""
        if self._single is None:
            self._single = all(len(starts) == 1 for _, starts in self.row_groups)
        return self._single

    def cu_seqlens(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(int32 [N+1] cumulative document offsets in the flattened [B*T] tokens, max length)."""
        key = ("cu_seqlens", str(device))
        if key not in self.cache:
            offsets = []
            for rows, starts in self.row_groups:
                for row in range(*rows.indices(self.batch)):
                    offsets += [row * self.seq_len + s for s in starts]
            offsets.append(self.batch * self.seq_len)
            lengths = [b - a for a, b in itertools.pairwise(offsets)]
            cu = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
            self.cache[key] = (cu, max(lengths))
        return self.cache[key]

    def flex_block_mask(self, device: torch.device, window: int = 0) -> Any:
        """The document-causal FlexAttention `BlockMask` of this batch on `device` (cached),
        within a sliding `window` of keys when > 0: tiles from the host's document starts
        (`flex_tiles`), the mask function a closure over the device's doc ids. Built eagerly,
        before any compiled block runs."""
        key = ("flex", str(device), window)
        if key not in self.cache:
            self.cache[key] = _document_block_mask(self, device, window)
        return self.cache[key]


FLEX_BLOCK = 128  # FlexAttention's default tile on CUDA


def flex_tiles(
    starts: tuple[int, ...], seq_len: int, block: int = FLEX_BLOCK, window: int = 0
) -> tuple:
    """(partial [nb, nb], full [nb, nb]) bool tiles of one row of documents starting at `starts`.

    Query tile i meets key tile j (j <= i) when they share a document: the document of j's last
    token is at least that of i's first. A tile is full (no mask needed) when j < i and both
    lie inside one document; the diagonal and every other meeting tile are partial. With a
    sliding `window`, tile j also needs its last key within the window of i's first query, and
    is full only when i's last query still sees j's first key.
    """
    doc = np.zeros(seq_len, dtype=np.int64)
    doc[list(starts[1:])] = 1
    doc = np.cumsum(doc)
    tiles = -(-seq_len // block)
    first = doc[np.arange(tiles) * block]
    last = doc[np.minimum(np.arange(1, tiles + 1) * block, seq_len) - 1]
    i, j = np.arange(tiles)[:, None], np.arange(tiles)[None, :]
    meet = (j <= i) & (last[None, :] >= first[:, None])
    inside = first == last
    full = (j < i) & inside[:, None] & inside[None, :] & (first[:, None] == first[None, :])
    if window:
        q_first, k_first = i * block, j * block
        q_last, k_last = (
            np.minimum(q_first + block, seq_len) - 1,
            np.minimum(k_first + block, seq_len) - 1,
        )
        meet &= q_first - k_last < window
        full &= q_last - k_first < window
    return meet & ~full, full


def _tile_lists(tiles: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [B, nb, nb] -> (int32 counts [B, 1, nb], int32 ascending indices [B, 1, nb, nb])."""
    counts = tiles.sum(-1, dtype=np.int32)[:, None]
    order = np.argsort(~tiles, axis=-1, kind="stable").astype(np.int32)[:, None]
    return torch.from_numpy(counts), torch.from_numpy(order)


def _document_block_mask(docs: DocumentLayout, device: torch.device, window: int) -> Any:
    partial, full = [], []
    for rows, starts in docs.row_groups:
        p, f = flex_tiles(starts, docs.seq_len, window=window)
        count = len(range(*rows.indices(docs.batch)))
        partial += [p] * count
        full += [f] * count
    kv_num, kv_idx = _tile_lists(np.stack(partial))
    full_num, full_idx = _tile_lists(np.stack(full))
    ids = docs.doc_ids.to(device, non_blocking=True)

    def same_document_causal(b, h, q_idx, kv_idx):
        seen = (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
        return seen & (q_idx - kv_idx < window) if window else seen

    mask = BlockMask.from_kv_blocks(  # on the host, query-side tiles included
        kv_num_blocks=kv_num,
        kv_indices=kv_idx,
        full_kv_num_blocks=full_num,
        full_kv_indices=full_idx,
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=same_document_causal,
        seq_lengths=(docs.seq_len, docs.seq_len),
    )
    return mask.to(device)


def _covers_shards(offsets: Any, tokens: int) -> bool:
    """Whether host offsets end at n * `tokens`, n > 1 (whole rows of a CP shard)."""
    end = int(offsets[-1])
    return end > tokens and end % tokens == 0


def _offset_row_groups(offsets: Any, batch: int, seq_len: int):
    """`_row_groups` from host-side cumulative document offsets [N+1] in the [B*T] tokens."""
    flat = [int(o) for o in offsets]
    if flat[-1] != batch * seq_len:
        raise ValueError(f"document offsets end at {flat[-1]}, not at B*T = {batch * seq_len}")
    per_row: list[list[int]] = [[] for _ in range(batch)]
    for offset in flat[:-1]:
        per_row[offset // seq_len].append(offset % seq_len)
    return _merge_rows(per_row)


def _row_groups(
    doc_ids: torch.Tensor | None, batch: int, seq_len: int
) -> tuple[tuple[slice, tuple[int, ...]], ...]:
    """Per run of rows with the same boundaries: (rows, starts of the documents, from 0)."""
    if doc_ids is None:
        return ((slice(0, batch), (0,)),)
    ids = doc_ids.detach().cpu()
    row, col = (ids[:, 1:] != ids[:, :-1]).nonzero(as_tuple=True)
    per_row: list[list[int]] = [[0] for _ in range(batch)]
    for r, c in zip(row.tolist(), col.tolist(), strict=True):
        per_row[r].append(c + 1)
    return _merge_rows(per_row)


def _merge_rows(per_row: list[list[int]]) -> tuple[tuple[slice, tuple[int, ...]], ...]:
    """(rows, document starts) per run of consecutive rows with the same starts."""
    groups: list[tuple[slice, tuple[int, ...]]] = []
    for r, starts in enumerate(per_row):
        if groups and groups[-1][1] == tuple(starts):
            groups[-1] = (slice(groups[-1][0].start, r + 1), groups[-1][1])
        else:
            groups.append((slice(r, r + 1), tuple(starts)))
    return tuple(groups)


def document_blocks(
    q_chunks: list[Chunk], k_chunks: list[Chunk], layout: DocumentLayout, window: int = 0
) -> list[Block]:
    """The blocks of queries `q_chunks` against keys `k_chunks`, documents from `layout`.

    Chunks are contiguous ranges of the global sequence that never partly overlap; a key chunk
    after a query chunk is skipped, an equal one gives causal spans, an earlier one full spans.
    With a sliding `window` (keys per query, 0 = none) spans are trimmed to the pairs the
    window joins (`sliding_window.window_span`): a chunk pair wholly outside it gives no block.
    """
    blocks = []
    for qc in q_chunks:
        for kc in k_chunks:
            if kc.start >= qc.start + qc.length:
                continue
            diagonal = kc.start == qc.start
            spans = tuple(
                span
                for rows, starts in layout.row_groups
                for span in _chunk_pair_spans(
                    qc, kc, rows, starts, layout.seq_len, diagonal, window
                )
            )
            if spans:
                q = slice(qc.local, qc.local + qc.length)
                blocks.append(Block(q, slice(kc.local, kc.local + kc.length), spans))
    return blocks


def _chunk_pair_spans(
    qc: Chunk, kc: Chunk, rows: slice, starts, seq_len: int, diagonal: bool, window: int
):
    ends = (*starts[1:], seq_len)
    for d0, d1 in zip(starts, ends, strict=True):
        q0, q1 = max(d0, qc.start), min(d1, qc.start + qc.length)
        k0, k1 = max(d0, kc.start), min(d1, kc.start + kc.length)
        if not (q0 < q1 and k0 < k1):
            continue
        masked = False
        if window:
            trimmed = window_span(q0, q1, k0, k1, window)
            if trimmed is None:
                continue
            q0, q1, k0, k1, masked = trimmed
        q = slice(q0 - qc.start, q1 - qc.start)
        band = (window, q0 - k0) if masked else (0, 0)
        yield Span(rows, q, slice(k0 - kc.start, k1 - kc.start), diagonal, *band)


_PER_DOC_IDS = WeakTensorKeyDictionary()


def doc_ids_cache(doc_ids: torch.Tensor) -> dict[str, Any]:
    """What is derived from `doc_ids` on the host, kept while the tensor lives and is unchanged:
    every layer of a forward, its backward and the `document_attention` op share one read."""
    if doc_ids.is_inference():  # no version counter to tell a change
        return {}
    hit = _PER_DOC_IDS.get(doc_ids)
    if hit is None or hit[0] != doc_ids._version:
        hit = (doc_ids._version, {})
        _PER_DOC_IDS[doc_ids] = hit
    return hit[1]
