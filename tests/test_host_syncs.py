"""Host syncs: the loop reads values back from the device only at its read-back steps.

On a GPU every `.item()`, `.tolist()`, `.cpu()`, `.to("cpu")`, `np.asarray(tensor)` or
`float(tensor)` waits for the device to finish the work queued so far, so a step that makes one
cannot queue the next while the device works. CI has no GPU: `host_reads.HostReads` counts the
reads at torch's dispatcher and function layer, whoever makes them (fivefold, or a torch helper
such as `clip_grad_norm_(error_if_nonfinite=True)`). On CUDA,
`torch.cuda.set_sync_debug_mode("warn")` reports the same syncs.
Also here: the data loader's document offsets (`Batch.cu_seqlens`) by hand, and the model's
document layout read from them equal to the one read from the doc ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from fivefold.errors import TrainingError
from fivefold.model.document_layout import DocumentLayout
from fivefold.train.data.batching import document_offsets
from fivefold.train.entry import load_run
from fivefold.train.loop import Trainer
from fivefold.train.runtime import LocalRuntime
from fivefold.train.start import train
from host_reads import HostReads

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu.toml"
SRC = str(Path(__file__).resolve().parents[1] / "src" / "fivefold")
READ_BACKS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def test_document_offsets_by_hand() -> None:
    doc_ids = np.array([[0, 0, 1, 1, 1], [3, 3, 3, 3, 3], [0, 1, 2, 2, 2]])
    # Row 0: documents at 0 and 2; row 1 (offset 5): one at 5; row 2 (offset 10): 10, 11, 12.
    assert document_offsets(doc_ids).tolist() == [0, 2, 5, 10, 11, 12, 15]
    assert document_offsets(doc_ids).dtype == np.int32


def test_the_layout_from_host_offsets_equals_the_one_read_from_doc_ids() -> None:
    ids = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [5, 5, 5, 5, 5, 5]])
    from_ids = DocumentLayout(ids, 3, 6)
    from_offsets = DocumentLayout(ids.clone(), 3, 6, document_offsets(ids.numpy()))
    assert from_offsets.row_groups == from_ids.row_groups
    assert from_offsets.row_groups == ((slice(0, 2), (0, 2)), (slice(2, 3), (0,)))
    assert from_offsets.cu_seqlens(torch.device("cpu"))[0].tolist() == [0, 2, 6, 8, 12, 18]
    with pytest.raises(ValueError, match="B\\*T = 12"):
        DocumentLayout(None, 2, 6, np.array([0, 18], dtype=np.int32)).row_groups  # noqa: B018


def tiny_run(tmp_path: Path, *overrides: str):
    base = [
        f"train.runs_dir={str(tmp_path)!r}",
        "train.name='syncs'",
        "train.progress=false",
        "train.tensorboard=false",
        "train.warmup_steps=2",
    ]
    return load_run(TINY, [*base, *overrides], world_size=1)


def test_a_step_between_read_backs_makes_no_host_sync(tmp_path, monkeypatch) -> None:
    """9 steps, log_every 4, memory measured in step 2: steps 1-3 (compile and layout
    reports, the measured step), 4, 8 (log steps) and 9 (the last) read back; 5, 6 and 7
    make no host sync, and a plain log step (8) exactly one: the losses, aux losses and
    gradient norms of steps 5-8 in one copy."""
    run = tiny_run(tmp_path, "train.steps=9", "train.log_every=4", "train.grad_clip=1.0")
    counter = HostReads()
    per_step: dict[int, int] = {}
    device_step = Trainer._device_step

    def step_and_count(trainer, micro_batches, pending, samples):
        if trainer.step > 0:  # the previous iteration ends where this one starts
            per_step[trainer.step] = len(counter.reads) - sum(per_step.values())
        return device_step(trainer, micro_batches, pending, samples)

    monkeypatch.setattr(Trainer, "_device_step", step_and_count)
    runtime = LocalRuntime(run.recipe, run.train)
    with counter:
        summary = train(run, runtime=runtime, console=Console(quiet=True))
    per_step[9] = len(counter.reads) - sum(per_step.values())
    assert summary.end_step == 9 and len(summary.losses) == 9
    assert [per_step[s] for s in (5, 6, 7)] == [0, 0, 0], counter.reads
    assert per_step[8] == 1
    assert all(per_step[s] >= 1 for s in (1, 2, 3, 4, 9))
    lines = (tmp_path / "syncs" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 9  # every step's metrics, written at the read-backs


def test_a_non_finite_loss_between_read_backs_is_named_at_the_next_one(tmp_path) -> None:
    """log_every 4 and a checkpoint every 4 steps: the loss turns NaN in step 5, which reads
    nothing back; step 8 reads steps 5-8 back and names step 5, before step 8's optimizer
    step and before its checkpoint, so the last checkpoint (step 4) is a good one."""
    run = tiny_run(tmp_path, "train.steps=9", "train.log_every=4", "train.ckpt_every=4")
    runtime = LocalRuntime(run.recipe, run.train)
    calls = {"n": 0}

    def poison_from_step_5(module, inputs, output):
        calls["n"] += 1
        return output * float("nan") if calls["n"] > 8 else output  # 2 micro-batches a step

    runtime.model.norm.register_forward_hook(poison_from_step_5)  # the head runs in the loss
    with pytest.raises(TrainingError) as err:
        train(run, runtime=runtime, console=Console(quiet=True))
    message = str(err.value)
    assert message.startswith("step 5: the loss is nan, read back at step 8")
    assert "train.log_every = 4" in message
    assert str(tmp_path / "syncs" / "ckpt" / "step_4") in message
    assert not (tmp_path / "syncs" / "ckpt" / "step_8").exists()
