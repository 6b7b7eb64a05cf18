"""Single-process checkpoints: exact resume, crashes while saving, corruption, safety, async."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fivefold.checkpoint import Checkpointer, TrainingState
from fivefold.checkpoint import manifest as mf
from fivefold.checkpoint.dcp_io import read_full_tensors
from fivefold.errors import CheckpointError
from fivefold.model import build_model, cross_entropy_loss
from fivefold.specs.model import ModelSpec
from fivefold.train.config import TrainConfig
from fivefold.train.data.sampler import GlobalSampler
from fivefold.train.lr_schedule import build_scheduler
from fivefold.train.optim import build_optimizer

SPEC = ModelSpec(
    "ckpt-test",
    layers=2,
    hidden=32,
    heads=4,
    kv_heads=2,
    ffn=64,
    vocab=128,
    seq_len=16,
    rope_theta=10_000.0,
)
CFG = TrainConfig(steps=8, warmup_steps=2, lr=3e-3, min_lr=3e-4)


class Run:
    """Model, AdamW, LR schedule and sampler as the training loop holds them."""

    def __init__(self, spec: ModelSpec = SPEC, seed: int = 0):
        self.spec = spec
        torch.manual_seed(seed)  # as the runtimes do; the checkpoint restores the RNG after this
        self.model = build_model(spec)
        self.model.to_empty(device="cpu")
        self.model.init_weights(seed=seed)
        self.optimizer = build_optimizer([self.model], CFG)
        self.scheduler = build_scheduler(self.optimizer, CFG)
        self.sampler = GlobalSampler(1000, seed=0)
        self.step = 0

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            ids = torch.as_tensor(self.sampler.take(4))
            g = torch.Generator().manual_seed(int(ids.sum()))
            noise = torch.randint(0, 8, (4, self.spec.seq_len + 1), generator=g)
            stream = (ids[:, None] * 7 + noise) % self.spec.vocab
            loss = cross_entropy_loss(self.model(stream[:, :-1]), stream[:, 1:])
            loss = loss + 1e-3 * torch.rand(())  # the global RNG feeds the loss: RNG must resume
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            self.step += 1
            losses.append(float(loss.detach()))
        return losses

    def save(self, ckpt: Checkpointer, **extra) -> Path:
        return ckpt.save(
            self.step,
            [self.model],
            self.optimizer,
            model_spec=self.spec.to_dict(),
            plan={"tp": 1},
            scheduler=self.scheduler,
            sampler=self.sampler,
            extra=extra,
        )

    def load(self, ckpt: Checkpointer, path: Path) -> TrainingState:
        state = ckpt.load(
            path,
            [self.model],
            self.optimizer,
            model_spec=self.spec.to_dict(),
            scheduler=self.scheduler,
            sampler=self.sampler,
        )
        self.step = state.step
        return state


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"


def test_resume_continues_bit_identically(tmp_path):
    straight = Run()
    reference = straight.train(6)

    first = Run()
    first.train(3)
    ckpt = Checkpointer(tmp_path / "ckpt")
    path = first.save(ckpt, loss=1.5)
    second = Run(seed=123)  # other initial weights: everything must come from the checkpoint
    state = second.load(ckpt, ckpt.select().path)
    assert path == tmp_path / "ckpt" / "step_3"
    assert (state.step, state.extra, second.sampler.consumed) == (3, {"loss": 1.5}, 12)
    assert second.scheduler.last_epoch == 3
    assert second.optimizer.param_groups[0]["lr"] == first.optimizer.param_groups[0]["lr"]
    assert second.optimizer.param_groups[0]["betas"] == (0.9, 0.95)  # a tuple again
    resumed = reference[:3] + second.train(3)
    assert resumed == reference
    assert_same(params(second.model), params(straight.model))
    assert_same(
        second.optimizer.state_dict()["state"][0], straight.optimizer.state_dict()["state"][0]
    )


def test_checkpoint_files_and_state_json(tmp_path):
    run = Run()
    run.train(2)
    path = run.save(Checkpointer(tmp_path))
    names = sorted(p.name for p in path.iterdir())
    assert names == [".metadata", "__0_0.distcp", "manifest.json", "state.json"]
    state = json.loads((path / "state.json").read_text())
    assert state["model_spec"]["hidden"] == 32 and state["sampler"]["consumed"] == 8
    assert state["world_size"] == 1 and len(state["rng"]) == 1
    tensors = read_full_tensors(path, prefix="")
    n_params = len(list(run.model.parameters()))
    assert len([k for k in tensors if k.startswith("model.")]) == n_params
    assert len([k for k in tensors if k.startswith("optim.state.")]) == 3 * n_params
    assert torch.equal(tensors["model.norm.weight"], run.model.norm.weight.detach())
    groups = state["optimizer_hparams"]
    assert sorted(g["hparams"]["weight_decay"] for g in groups) == [0.0, 0.1]


def test_model_spec_mismatch_names_the_fields(tmp_path):
    run = Run()
    path = run.save(Checkpointer(tmp_path))
    other = Run(SPEC.with_(hidden=64, layers=3))
    with pytest.raises(CheckpointError) as err:
        other.load(Checkpointer(tmp_path), path)
    message = str(err.value)
    assert "model.hidden = 64 (checkpoint: 32)" in message
    assert "model.layers = 3 (checkpoint: 2)" in message
    assert "model.ffn" not in message


@pytest.mark.parametrize("phase", ["written", "manifest"])
def test_failure_between_write_and_rename_keeps_previous(tmp_path, phase):
    run = Run()
    run.train(1)
    good = run.save(Checkpointer(tmp_path))
    before = read_full_tensors(good, prefix="")
    run.train(1)

    def crash(at: str) -> None:
        if at == phase:
            raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        run.save(Checkpointer(tmp_path, fault_hook=crash))
    assert [s for s, _ in mf.list_checkpoints(tmp_path)] == [1]
    assert mf.list_staging(tmp_path) == [tmp_path / ".staging_step_2"]
    ckpt = Checkpointer(tmp_path)
    choice = ckpt.select()
    assert choice.path == good and not mf.list_staging(tmp_path)  # stale staging removed
    fresh = Run(seed=5)
    fresh.load(ckpt, choice.path)
    after = read_full_tensors(good, prefix="")
    assert_same(before, after)
    assert_same(
        {f"model.{k}": v for k, v in params(fresh.model).items()},
        {k: v for k, v in after.items() if k.startswith("model.")},
    )


KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {test_dir!r})
    from test_checkpointer import Run
    from fivefold.checkpoint import Checkpointer
    run = Run()
    run.train(1)
    run.save(Checkpointer({root!r}))
    run.train(1)
    def die(phase):
        if phase == {phase!r}:
            os.kill(os.getpid(), signal.SIGKILL)
    run.save(Checkpointer({root!r}, fault_hook=die))
    print("not reached")
    """
)


def test_sigkill_during_save_leaves_previous_usable(tmp_path):
    root = tmp_path / "ckpt"
    script = KILLED_SAVE.format(
        test_dir=str(Path(__file__).parent), root=str(root), phase="manifest"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
    staging = mf.staging_dir(root, 2)
    assert (staging / "manifest.json").is_file()  # killed after the manifest, before the rename
    choice = Checkpointer(root).select()
    assert choice.path == root / "step_1"
    state = Run(seed=9).load(Checkpointer(root), choice.path)
    assert state.step == 1


def test_corrupt_newest_falls_back_with_reason(tmp_path):
    run = Run()
    ckpt = Checkpointer(tmp_path, keep=3)
    run.train(1)
    first = run.save(ckpt)
    expected = params(run.model)
    run.train(1)
    second = run.save(ckpt)
    data = second / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    choice = ckpt.select()
    assert choice.path == first
    assert (
        "step_2: INVALID: file __0_0.distcp fails its SHA-256 checksum" in choice.describe_skipped()
    )
    fresh = Run(seed=7)
    fresh.load(ckpt, choice.path)
    assert_same(params(fresh.model), expected)


def test_keep_last_k(tmp_path):
    run = Run()
    ckpt = Checkpointer(tmp_path, keep=2)
    for _ in range(4):
        run.train(1)
        run.save(ckpt)
    assert [s for s, _ in mf.list_checkpoints(tmp_path)] == [3, 4]


def test_async_save_writes_the_values_of_its_step(tmp_path):
    run = Run()
    run.train(2)
    at_save = params(run.model)
    ckpt = Checkpointer(tmp_path, async_save=True)
    path = run.save(ckpt)
    run.train(2)  # overlaps the background write; must not leak into it
    assert ckpt.wait() == path
    assert mf.verify_checkpoint(path).ok
    fresh = Run(seed=4)
    fresh.load(ckpt, path)
    assert_same(params(fresh.model), at_save)
    assert not any(
        torch.equal(at_save[k], v) for k, v in params(run.model).items() if k.endswith("wq.weight")
    )


def test_weights_only_checkpoint_keeps_fresh_optimizer(tmp_path):
    trained = Run()
    trained.train(2)
    path = Checkpointer(tmp_path).save(0, [trained.model], None, model_spec=SPEC.to_dict(), plan={})
    fresh = Run(seed=3)
    state = fresh.load(Checkpointer(tmp_path), path)
    assert state.contents == ["model"] and state.step == 0
    assert_same(params(fresh.model), params(trained.model))
    assert fresh.optimizer.state_dict()["state"] == {}
    assert fresh.sampler.consumed == 0


class _Exploit:
    """Unpickling this would create a marker file: the safe reader must refuse it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_tampered_metadata_is_refused_without_running_it(tmp_path):
    run = Run()
    path = run.save(Checkpointer(tmp_path))
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Exploit(str(marker))))
    with pytest.raises(CheckpointError, match="refusing to load it"):
        Run(seed=1).load(Checkpointer(tmp_path), path)
    assert not marker.exists()


def test_pickled_values_in_dcp_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fivefold.checkpoint.dcp_io import translate_dcp_errors
    from fivefold.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner

    dcp.save({"x": torch.ones(2), "meta": {"lr": 0.1}}, checkpoint_id=str(tmp_path), no_dist=True)
    target = {"x": torch.zeros(2), "meta": {"lr": 0.0}}
    with (
        pytest.raises(CheckpointError, match="refusing to unpickle it"),
        translate_dcp_errors("loading"),
    ):
        dcp.load(
            target,
            storage_reader=SafeFileSystemReader(str(tmp_path)),
            planner=SafeLoadPlanner(),
            no_dist=True,
        )


def test_state_json_round_trip_and_rng():
    from fivefold.checkpoint.state import capture_rng, restore_rng

    rng = capture_rng()
    expected = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    state = TrainingState(step=4, rng=[rng], scheduler={"last_epoch": 4}, extra={"loss": 2.0})
    again = TrainingState.from_json(state.to_json())
    assert again == state
    restore_rng(again.rng[0])
    got = (torch.rand(3), __import__("random").random(), __import__("numpy").random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_state_json_refuses_other_formats():
    with pytest.raises(CheckpointError, match="expected 'fivefold-state-v1'"):
        TrainingState.from_json(json.dumps({"format": "pickle-v0"}))
