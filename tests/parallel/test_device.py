"""Where a run executes, without a GPU: `torch.cuda` made to report an H200, H100, V100, GB200
or an unknown GPU, and the cluster, precision and checks a recipe without [cluster] resolves to."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from fivefold.errors import ConfigError
from fivefold.parallel import device as device_module
from fivefold.parallel.device import local_cluster_table, local_gpu, real_bf16, uses_cuda
from fivefold.parallel.mixed_precision import resolve_precision
from fivefold.parallel.report import predictions_for
from fivefold.planner.estimate import estimate
from fivefold.planner.options import PlannerOptions
from fivefold.specs.cluster import cluster_for_gpu
from fivefold.specs.hardware import GPUS, UNKNOWN_GPU
from fivefold.train.entry import check_layout, load_run
from fivefold.units import GiB

TINY = ["model.preset='tiny'", "train.progress=false"]


def fake_gpu(monkeypatch, name: str, memory_gib: float, capability=(9, 0), count: int = 1):
    """Make torch.cuda report `count` GPUs named `name` (bf16 emulated below sm80, as torch
    reports a V100)."""
    cuda = torch.cuda
    props = SimpleNamespace(total_memory=int(memory_gib * GiB), major=capability[0])
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: count)
    monkeypatch.setattr(cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(
        cuda,
        "is_bf16_supported",
        lambda including_emulation=True: capability >= (8, 0) or including_emulation,
    )
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)  # torch, not nvidia-smi, asked
    monkeypatch.setattr(cuda, "device_memory_used", lambda device=None: 0, raising=False)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)


def test_h200_alone_is_one_h200_with_its_links(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200", 139.8)
    gpu = local_gpu()
    assert (gpu.catalog_key, gpu.bf16) == ("h200", True)
    run = load_run(None, TINY, world_size=1)
    cluster = run.recipe.cluster
    assert (cluster.gpu, cluster.nodes, cluster.gpus_per_node) == ("h200", 1, 1)
    assert (cluster.intra_node_bw, cluster.inter_node_bw) == (900e9, 50e9)  # dgx-h200's links
    assert cluster.name == "NVIDIA H200"
    assert run.recipe.plan.precision == "bf16-mixed"  # not the CPU's fp32 default
    assert cluster.device.hbm_bytes == 143_771 * 2**20


def test_a_gpu_run_predicts_step_time_for_the_gpu_not_the_cpu(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200", 139.8)
    run = load_run(None, [*TINY, "model.seq_len=128"], world_size=1)
    memory, step_s, note = predictions_for(run.recipe, cuda=True, fsdp_wrapped=False)
    assert memory and note == "planner estimate for h200"
    # the step priced on the catalog's H200 (one GPU), as the runtime's planner runs it; an
    # H100, whose price differs by ~1.6 % here, would not pass
    priced = {
        gpu: estimate(
            run.recipe.model,
            cluster,
            run.recipe.plan,
            options=replace(PlannerOptions.for_device(cluster.device), runtime="fivefold-eager"),
        ).step_time_s
        for gpu, cluster in ((g, cluster_for_gpu(g, 1, 1)) for g in ("h200", "h100-sxm"))
    }
    assert step_s == pytest.approx(priced["h200"], rel=1e-9)
    assert abs(priced["h100-sxm"] / priced["h200"] - 1) > 0.01


def test_fp8_is_accepted_on_an_h200_without_a_cluster_section(monkeypatch):
    """On 2026-11-26 an H200 run without [cluster] refused plan.fp8 'on cpu'."""
    fake_gpu(monkeypatch, "NVIDIA H200", 139.8)
    run = check_layout(None, [*TINY, "plan.fp8='tensorwise'"], 1)
    assert run.recipe.cluster.gpu == "h200" and run.recipe.plan.fp8 == "tensorwise"


def test_h100_nodes_come_from_the_torchrun_world(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 79.2, count=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    table = local_cluster_table(16)
    assert (table["gpu"], table["nodes"], table["gpus_per_node"]) == ("h100-sxm", 2, 8)
    monkeypatch.setenv("WORLD_SIZE", "16")
    run = load_run(None, [*TINY, "plan.dp_shard=16", "plan.zero=3"])
    assert run.recipe.cluster.world_size == 16 and run.recipe.cluster.nodes == 2


def test_v100_is_unknown_and_has_no_native_bf16(monkeypatch):
    fake_gpu(monkeypatch, "Tesla V100-SXM2-32GB", 31.7, capability=(7, 0))
    assert torch.cuda.is_bf16_supported()  # torch's default counts emulation
    assert not real_bf16()
    run = load_run(None, TINY, world_size=1)
    assert run.recipe.cluster.gpu == UNKNOWN_GPU
    assert run.recipe.plan.precision == "fp32"  # the CPU's default, not emulated bf16
    with pytest.raises(ConfigError, match=r"bf16-mixed.*only emulates"):
        resolve_precision("bf16-mixed", torch.device("cuda", 0))


def test_gb200_is_not_a_b200_and_spans_its_nvlink_domain(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA GB200", 184.0, capability=(10, 0), count=4)
    table = local_cluster_table(8, local_world=4)  # two trays of one NVL72 rack
    assert (table["gpu"], table["nodes"], table["gpus_per_node"]) == ("gb200", 2, 4)
    assert table["nvlink_domain"] == 72 and table["intra_node_bw"] == 1800e9


def test_an_unknown_gpu_says_so_and_predicts_no_time(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA Imaginary X1", 64.0)
    run = check_layout(None, [*TINY, "model.seq_len=128", "plan.fp8='tensorwise'"], 1)
    assert run.recipe.cluster.gpu == UNKNOWN_GPU
    memory, step_s, note = predictions_for(run.recipe, cuda=True, fsdp_wrapped=False)
    assert memory and step_s is None
    assert note.startswith("no step-time prediction: NVIDIA Imaginary X1 is not in the GPU catalog")
    assert GPUS[UNKNOWN_GPU].peak_flops == {}


def test_the_cpu_path_is_unchanged(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(tmp_path / "none.toml"))
    run = load_run(None, TINY, world_size=1)
    assert (run.recipe.cluster.name, run.recipe.cluster.gpu) == ("local-cpu", "cpu")
    assert run.recipe.plan.precision == "fp32"
    assert not uses_cuda("auto") and not uses_cuda("cpu")
    with pytest.raises(ConfigError, match=r"train\.device = 'cuda' but no CUDA device"):
        uses_cuda("cuda")


def test_train_device_cpu_on_a_gpu_machine_stays_on_the_cpu(monkeypatch, tmp_path):
    fake_gpu(monkeypatch, "NVIDIA H200", 139.8)
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(tmp_path / "none.toml"))
    run = load_run(None, [*TINY, "train.device='cpu'"], world_size=1)
    assert (run.recipe.cluster.gpu, run.recipe.plan.precision) == ("cpu", "fp32")


def test_a_launcher_reads_the_gpu_with_nvidia_smi_and_creates_no_cuda_context(monkeypatch):
    fake_gpu(monkeypatch, "unused", 1.0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-5a1b,GPU-77c0")

    def no_context(*args, **kwargs):
        raise AssertionError("torch would create a CUDA context in the launcher")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_context)
    calls = []

    def smi(command, **kwargs):
        calls.append(command)
        return SimpleNamespace(stdout="NVIDIA A100-SXM4-80GB, 81920, 8.0\n")

    monkeypatch.setattr(device_module.subprocess, "run", smi)
    gpu = local_gpu(1)
    assert (gpu.name, gpu.catalog_key, gpu.bf16) == ("NVIDIA A100-SXM4-80GB", "a100-80gb", True)
    assert gpu.total_memory_bytes == 81920 * 2**20
    assert calls[0][1] == "--id=GPU-77c0"  # CUDA's index 1 of the visible GPUs

    monkeypatch.setattr(device_module.subprocess, "run", lambda *a, **k: SimpleNamespace(
        stdout="Tesla T4, 15360, 7.5\n"))  # fmt: skip
    assert local_gpu(0).bf16 is False  # sm75 emulates bf16
