"""The hardware catalog: today's GPUs with their sources, names as torch reports them, and an
NVLink domain larger than a node (GB200 NVL72)."""

from __future__ import annotations

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.rates.efficiency import EfficiencyModel
from fivefold.planner.search.candidates import tp_choices
from fivefold.planner.step_time.comm import group_link
from fivefold.specs import ParallelPlan, cluster_preset, model_preset
from fivefold.specs.cluster import ClusterSpec
from fivefold.specs.hardware import GPUS, UNKNOWN_GPU, catalog_key_for_device, host
from fivefold.specs.recipe import cluster_from_dict
from fivefold.units import GiB

EFF = EfficiencyModel(nvlink_fraction=0.8, ib_fraction=0.9)
NV_B = 1800e9 / 2 * 0.8  # NVLink 5, one direction, achieved
IB = 50e9 * 0.9


@pytest.mark.parametrize("key", sorted(set(GPUS) - {"cpu", UNKNOWN_GPU}))
def test_every_catalogued_gpu_has_a_source_and_dense_bf16_peak(key):
    spec = GPUS[key]
    assert len(spec.source) > 40 and any(
        word in spec.source
        for word in ("datasheet", "data sheet", "product brief", "specifications", "benchmarks")
    ), spec.source
    assert spec.hbm_bytes > 16 * GiB and spec.hbm_bw_bytes_per_s > 0
    assert spec.peak("bf16") > 100e12 and spec.peak("fp32") < spec.peak("bf16")


def test_todays_gpus_are_catalogued():
    assert {"b200", "gb200", "h200", "h20", "mi300x", "mi325x"} <= set(GPUS)
    # GB200 in NVL72: 360 PFLOPS bf16 sparse per 72 GPUs = 2.5 PFLOPS dense each.
    assert GPUS["gb200"].peak("bf16") == pytest.approx(360e15 / 2 / 72)
    assert GPUS["gb200"].nvlink_domain == 72
    assert GPUS["mi300x"].hbm_bytes == 192e9 and GPUS["mi325x"].hbm_bytes == 256e9
    assert GPUS["h20"].peak("bf16") == pytest.approx(148e12)
    assert host("gb200").ram_bytes == 960e9  # two Graces of 480 GB per tray of 4 GPUs


def test_h200_holds_its_real_memory():
    """141 GB of HBM3e: nvidia-smi reports 143,771 MiB (140.4 GiB), not 131 GiB."""
    hbm = GPUS["h200"].hbm_bytes
    assert hbm == 143_771 * 2**20
    assert 139 * GiB < hbm < 141 * GiB


@pytest.mark.parametrize(
    ("name", "memory_gib", "key"),
    [
        ("NVIDIA GB200", 185, "gb200"),
        ("NVIDIA B200", 179, "b200"),
        ("NVIDIA H200", 139.8, "h200"),
        ("NVIDIA H20", 95, "h20"),
        ("NVIDIA H100 80GB HBM3", 79.2, "h100-sxm"),
        ("NVIDIA H100 PCIe", 79.2, "h100-pcie"),
        ("NVIDIA H100 NVL", 93, "h100-nvl"),
        ("NVIDIA H800", 79.2, "h800"),
        ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", 39.4, "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", 79.2, "a100-80gb"),
        ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"),
        ("NVIDIA L40S", 44.4, "l40s"),
        ("AMD Instinct MI300X", 191.5, "mi300x"),
        ("AMD Instinct MI325X", 255.5, "mi325x"),
        ("Tesla V100-SXM2-32GB", 31.7, None),
        ("NVIDIA GH200 480GB", 94.5, "gh200"),  # 96 GB HBM3 (and 480 GB on the Grace)
        ("NVIDIA GH200 144G HBM3e", 139.5, "gh200-144gb"),
        ("NVIDIA H200 NVL", 139.8, "h200-nvl"),
    ],
)
def test_device_names_map_most_specific_first(name, memory_gib, key):
    assert catalog_key_for_device(name, int(memory_gib * GiB)) == key


def test_h200_nvl_and_gh200_carry_their_datasheet_figures():
    """H200 NVL: 1,671 TFLOPS bf16 with sparsity (835.5 dense), 4.8 TB/s, 600 W card; GH200: the
    H100 SXM's compute with 96 GB HBM3 at 4 TB/s or 144 GB HBM3e at 4.9 TB/s, its Grace's
    LPDDR5X behind NVLink-C2C (900 GB/s both ways) as host memory."""
    nvl, gh, gh144 = GPUS["h200-nvl"], GPUS["gh200"], GPUS["gh200-144gb"]
    assert nvl.peak("bf16") == pytest.approx(1671e12 / 2, rel=1e-3)
    assert nvl.peak("fp8") == pytest.approx(3341e12 / 2, rel=1e-3)
    assert nvl.hbm_bytes == GPUS["h200"].hbm_bytes and nvl.hbm_bw_bytes_per_s == 4.8e12
    assert gh.peak("bf16") == gh144.peak("bf16") == GPUS["h100-sxm"].peak("bf16")
    assert (gh.hbm_bytes, gh144.hbm_bytes) == (96e9, 144e9)
    assert gh.pcie_bw_bytes_per_s == 450e9 and host("gh200").ram_bytes == 480e9
    assert catalog_key_for_device("NVIDIA GH200 480GB") == "gh200"  # no memory given
    from fivefold.planner.estimate import estimate
    from fivefold.specs.cluster import cluster_for_gpu

    for key in ("h200-nvl", "gh200", "gh200-144gb"):  # planned: a step time and an MFU
        cluster = cluster_for_gpu(key, 1, 1, key)
        est = estimate(model_preset("small"), cluster, ParallelPlan(precision="bf16-mixed"))
        assert est.step_time_s > 0 and 0 < est.mfu < 1


def test_an_a100_without_its_memory_is_read_from_its_name_or_not_guessed():
    assert catalog_key_for_device("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert catalog_key_for_device("NVIDIA A100-SXM4") is None


def test_nvl72_keeps_groups_of_up_to_72_on_nvlink():
    nvl72 = cluster_preset("gb200-nvl72", 144)  # two racks of 18 trays of 4
    assert (nvl72.gpus_per_node, nvl72.nodes, nvl72.nvlink_gpus) == (4, 36, 72)
    for size in (8, 16, 72):  # a TP or EP group spanning trays stays on NVLink 5
        link = group_link(nvl72, size, 1, EFF)
        assert (link.kind, link.bandwidth) == ("nvlink", pytest.approx(NV_B))
    across = group_link(nvl72, 144, 1, EFF)  # two racks: each rack's 72 NICs carry the ring
    assert across.kind == "ib" and across.bandwidth == pytest.approx(min(NV_B, 72 * IB))
    dgx = cluster_preset("dgx-b200", 144)  # the same GPUs in 8-GPU nodes: 16 leaves the node
    assert group_link(dgx, 16, 1, EFF).kind == "ib"
    assert group_link(dgx, 16, 1, EFF).bandwidth == pytest.approx(8 * IB)


def test_tensor_parallelism_may_span_the_nvlink_domain():
    model = model_preset("llama3-405b")  # 128 heads, 8 KV heads
    nvl72 = cluster_preset("gb200-nvl72", 64)  # 16 trays of one rack
    dgx = cluster_preset("dgx-b200", 64)
    assert max(tp_choices(model, dgx)) == 8
    assert {16, 32, 64} <= set(tp_choices(model, nvl72))
    plan = ParallelPlan(tp=16, dp_shard=4, zero=3)
    assert not [p for p in plan.problems(model, nvl72) if "plan.tp" in p]
    refused = [p for p in plan.problems(model, dgx) if "plan.tp" in p]
    assert refused and "must divide the 8 GPUs of a node" in refused[0]


def test_an_nvlink_domain_must_hold_whole_nodes():
    with pytest.raises(ConfigError, match=r"cluster.nvlink_domain = 6: .* multiple of"):
        cluster_from_dict({"gpu": "gb200", "gpus": 8, "gpus_per_node": 4, "nvlink_domain": 6})
    assert ClusterSpec(gpu="gb200", nodes=2, gpus_per_node=4, nvlink_domain=72).problems() == []
    assert ClusterSpec().nvlink_gpus == 8  # 0: one node


def test_plan_takes_an_nvlink_domain_from_the_command_line(capsys):
    from fivefold.cli.main import main

    args = ["plan", "--model", "llama3-405b", "--gpu", "b200", "--gpus", "64", "--tp", "16"]
    assert main([*args, "--nvlink-domain", "64"]) == 0
    assert "best layout: TP16+SP" in capsys.readouterr().out
    assert main(args) == 2  # eight GPUs per node, one node per NVLink domain: TP16 cannot stay
