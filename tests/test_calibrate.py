"""`fivefold calibrate`: the alpha-beta fit, what checkpoint really recomputes (HFU), and the
whole command in quick mode over 2 gloo ranks, whose profile `fivefold plan` then uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fivefold.calibration import attention, compute, matmul, timing
from fivefold.calibration.attention import attention_grid
from fivefold.calibration.comm import fit_alpha_beta, sizes_for, steps_count
from fivefold.calibration.matmul import device_grid_shapes
from fivefold.calibration.tables import build_profile, sort_rows
from fivefold.model import build_model
from fivefold.parallel.activation_checkpoint import apply_recompute
from fivefold.specs.flops import (
    attention_score_flops_per_token,
    early_stop_skipped_flops_per_token,
    training_flops_per_token,
)
from fivefold.specs.plan import ParallelPlan
from fivefold.specs.presets import model_preset
from fivefold.specs.profile import (
    BANDWIDTH_KINDS,
    COLLECTIVES,
    Attention,
    Bandwidth,
    DeviceProfile,
    Matmul,
    Overhead,
    available_cores,
    bus_factor,
    parse_profile,
)

ROOT = Path(__file__).resolve().parents[1]


def test_alpha_beta_fit_recovers_a_line():
    sizes = [2.0**i for i in range(10, 24, 2)]
    times = [50e-6 + s / 2e9 for s in sizes]
    alpha, beta = fit_alpha_beta(sizes, times)
    assert alpha == pytest.approx(50e-6, rel=1e-9) and beta == pytest.approx(2e9, rel=1e-9)
    alpha, beta = fit_alpha_beta(sizes, [s / 1e9 - 1e-9 for s in sizes])  # alpha < 0: refit at 0
    assert alpha == 0.0 and beta == pytest.approx(1e9, rel=1e-3)


def test_collective_fits_carry_the_median_dtensor_host_seconds():
    """`fit_collectives`: one row per (op, group, processes, gap), its host seconds the median
    of its samples' (each sample carries its group's one measurement)."""
    from fivefold.calibration.comm import fit_collectives
    from fivefold.specs.profile import CollectiveSample

    def sample(size: int, host: float) -> CollectiveSample:
        t = 1e-4 + size / 1e9
        return CollectiveSample("all_gather", 2, 2, 0.0, size, t, size / t, size / t / 2, host)

    fits = fit_collectives([sample(1024, 2e-3), sample(65536, 1e-3), sample(2**20, 4e-3)])
    assert len(fits) == 1 and fits[0].host_s == 2e-3
    assert fits[0].alpha_s == pytest.approx(1e-4) and fits[0].beta_bytes_per_s == pytest.approx(1e9)


def _matmul_flops(name: str, policy: str, early_stop: bool, **changes) -> tuple[float, object]:
    spec = model_preset(name).with_(**changes)
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(0)
    apply_recompute(model, policy)
    tokens = torch.randint(
        0, spec.vocab, (2, spec.seq_len), generator=torch.Generator().manual_seed(0)
    )
    with (
        torch.utils.checkpoint.set_checkpoint_early_stop(early_stop),
        FlopCounterMode(display=False) as fc,
    ):
        model(tokens).sum().backward()
    return fc.get_total_flops(), spec


def test_full_recompute_flops_are_what_checkpoint_runs():
    """torch's FLOP counter sees only matmuls on CPU (SDPA is not counted), so the recomputed
    matmul FLOPs must equal the formula's recompute FLOPs less the attention scores."""
    base, spec = _matmul_flops("tiny", "none", True)
    early, _ = _matmul_flops("tiny", "full", True)
    everything, _ = _matmul_flops("tiny", "full", False)
    tokens = 2 * spec.seq_len
    recompute = training_flops_per_token(spec, recompute="full", early_stop=True)
    recompute -= training_flops_per_token(spec) + spec.layers * attention_score_flops_per_token(
        spec, spec.seq_len
    )
    assert early - base == pytest.approx(tokens * recompute, rel=1e-12)
    assert everything - early == pytest.approx(tokens * early_stop_skipped_flops_per_token(spec))
    moe_early, moe = _matmul_flops("tiny-moe", "full", True)
    moe_all, _ = _matmul_flops("tiny-moe", "full", False)
    assert moe_all - moe_early == pytest.approx(tokens * early_stop_skipped_flops_per_token(moe))
    assert early_stop_skipped_flops_per_token(moe) > 0


def test_layer_overhead_measures_each_layer_kind():
    """The tiny stand-in keeps the model's op structure; every fixed cost (plain, TP, FSDP2,
    replicate, shard, EP and MoE layers) is measured positive, and the one-rank group used for
    them is gone afterwards. Which costs more is timing, so a loaded machine may reorder them:
    not asserted here."""
    import torch.distributed as dist

    from fivefold.calibration.overhead import measure_overhead, tiny_like
    from fivefold.calibration.timing import Budget

    moe = model_preset("tiny-moe")
    tiny = tiny_like(moe, 3)
    assert (tiny.layers, tiny.hidden, tiny.seq_len) == (3, 16, 8)
    assert (tiny.experts, tiny.top_k, tiny.shared_experts) == (4, 2, 1)
    torch.set_num_threads(1)
    row = measure_overhead(model_preset("tiny"), 1, Budget(min_repeats=7), moe)
    assert not dist.is_initialized()
    assert row.layer_forward_s > 0 and row.layer_backward_s > 0
    assert row.tp_forward_s > 0 and row.tp_backward_s > 0
    assert row.fsdp_forward_s + row.fsdp_backward_s > 0
    assert row.replicate_forward_s + row.replicate_backward_s > 0
    assert row.shard_forward_s + row.shard_backward_s > 0
    assert row.ep_forward_s + row.ep_backward_s > 0
    assert row.moe_forward_s > 0 and row.moe_backward_s > 0


def test_a_dense_calibration_still_measures_a_moe_layer(monkeypatch):
    """A profile calibrated on a dense model priced every MoE layer's fixed cost as a dense
    layer's (router, dispatch and load-balancing loss unmeasured, EP extra 0): the MoE row is
    now a MoE layer's (`moe_like`: tiny-moe's routing on the model's layer) and the EP extra
    is measured on it. The measured specs are recorded, the timings replaced."""
    from fivefold.calibration import overhead
    from fivefold.calibration.timing import Budget

    measured = []

    def per_layer(build, spec, budget, batch=1):
        measured.append(spec)
        return (2e-3, 4e-3) if spec.is_moe else (1e-3, 2e-3)

    def paired(base, variant, spec, budget, batch=1):
        measured.append(spec)
        return (5e-4, 5e-4)

    monkeypatch.setattr(overhead, "per_layer_s", per_layer)
    monkeypatch.setattr(overhead, "paired_extra_s", paired)
    monkeypatch.setattr(overhead, "tp_extra_s", lambda *a: (0.0, 0.0))
    small = model_preset("small")
    assert overhead.moe_like(small).experts == 4 and overhead.moe_like(small).top_k == 2
    assert overhead.moe_like(model_preset("tiny-moe")) == model_preset("tiny-moe")
    row = overhead.measure_overhead(small, 1, Budget())
    assert (row.layer_forward_s, row.moe_forward_s, row.moe_backward_s) == (1e-3, 2e-3, 4e-3)
    assert (row.ep_forward_s, row.ep_backward_s) == (5e-4, 5e-4)
    moe_specs = [m for m in measured if m.is_moe]
    assert moe_specs and all(m.hidden == 16 and m.experts == 4 for m in moe_specs)


def test_grouped_matmul_passes_compute_what_autograd_does():
    """The three timed `_grouped_mm` passes give, group by group, the forward of the experts
    and the two gradients autograd computes for it, and their rows count 2 rows n k FLOPs."""
    from fivefold.calibration.matmul import _grouped_operands, measure_grouped
    from fivefold.calibration.timing import Budget

    groups, tokens, n, k = 2, 16, 8, 4
    fwd, dgrad, wgrad = (
        _grouped_operands(groups, tokens, n, k, layout, torch.float32)()
        for layout in ("nt", "nn", "tn")
    )
    gen = torch.Generator().manual_seed(0)
    x, g = torch.randn(tokens, k, generator=gen), torch.randn(tokens, n, generator=gen)
    w = torch.randn(groups, n, k, generator=gen)
    for e in range(groups):
        rows = slice(e * 8, (e + 1) * 8)
        torch.testing.assert_close(fwd[rows], x[rows] @ w[e].T)
        torch.testing.assert_close(dgrad[rows], g[rows] @ w[e])
        torch.testing.assert_close(wgrad[e], g[rows].T @ x[rows])
    rows = measure_grouped((groups, tokens, n, k), "fp32", 1, Budget(1, 1, 0.0))
    assert [r.layout for r in rows] == ["nt", "nn", "tn"]
    assert all(r.tokens == tokens and r.flops_per_s > 0 for r in rows)


def test_cp_attention_blocks_are_rank_zeros_share_of_causal_attention():
    """The CP block attention calibrate times is rank 0's share of the whole causal attention:
    its load-balanced query chunks against every rank's keys give exactly those rows of
    single-process causal SDPA; and its rate counts the planner's FLOPs."""
    import torch.nn.functional as F

    from fivefold.calibration.attention import cp_attention_passes, cp_rank_blocks
    from fivefold.calibration.timing import Budget
    from fivefold.model.attention_blocks import block_attention
    from fivefold.parallel.context_parallel import load_balanced_indices

    batch, heads, seq, cp, d = 2, 4, 32, 2, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, d, generator=gen) for _ in range(3))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    order = torch.cat([load_balanced_indices(seq, r, cp) for r in range(cp)])
    mine = load_balanced_indices(seq, 0, cp)
    out = block_attention(q[:, :, mine], k[:, :, order], v[:, :, order], cp_rank_blocks(2, seq, cp))
    torch.testing.assert_close(out, ref[:, :, mine])
    fwd, bwd = cp_attention_passes(batch, heads, 2, seq, cp, d, Budget(1, 1, 0.0))
    assert fwd > 0 and bwd > 0


def test_paired_extra_recovers_a_known_per_layer_cost():
    """A variant whose every block burns 30 ms of this thread's CPU in its forward: the paired
    measurement finds 30 ms per layer forward and nothing backward (thread CPU clock; the
    tolerance, 3 ms, covers what a loaded machine adds to the unburnt rest: +1.5 ms seen in CI
    under load with a 10 ms burn)."""
    import time

    from fivefold.calibration.overhead import paired_extra_s, tiny_like
    from fivefold.calibration.timing import Budget
    from fivefold.model.transformer import Transformer

    def burn(*_) -> None:
        start = time.thread_time()
        while time.thread_time() - start < 30e-3:
            pass

    def slow(spec):
        net = Transformer(spec)
        for block in net.layers.values():
            block.register_forward_hook(burn)
        return net

    torch.set_num_threads(1)
    fwd, bwd = paired_extra_s(Transformer, slow, tiny_like(model_preset("tiny"), 1), Budget())
    assert fwd == pytest.approx(30e-3, abs=3e-3)
    assert bwd == pytest.approx(0.0, abs=3e-3)


def test_calibrate_quick_two_ranks_writes_a_profile_plan_uses(tmp_path):
    out = tmp_path / "profile.toml"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "fivefold.cli.main"]
    done = subprocess.run(
        [*cli, "calibrate", str(ROOT / "configs/tiny-cpu.toml"), "--quick", "--nproc", "2",
         "--also", "tiny-moe", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "busbw" in done.stdout and f"wrote {out}" in done.stdout
    # The estimate comes before anything is measured, with the count it rests on.
    assert done.stdout.startswith("calibrate: ") or "\ncalibrate: " in done.stdout
    assert f"collective ones over up to 2 rank(s) on {available_cores()} core(s)" in done.stdout
    profile = parse_profile(tomllib.loads(out.read_text()))
    assert profile.ranks == 2 and profile.backend == "gloo" and profile.model == "tiny"
    assert {c.op for c in profile.collective} == set(COLLECTIVES)
    # the memory-bound work measured alone and on both processes at once, every kind
    shared = {(b.kind, b.processes) for b in profile.bandwidth}
    assert {(k, n) for k, _ in shared for n in (1, 2)} == shared and len(shared) == 10
    # issued back to back, after tiny's MLP GEMM (tiny-moe's has the same shape) and a longer one
    gaps = sorted({c.gap_s for c in profile.collective})
    assert len(gaps) == 3 and gaps[0] == 0.0 and 0.0 < gaps[1] < gaps[2]
    assert len(profile.collective_sample) == steps_count(2, quick=True, gemms=3)
    # TP's DTensor all-gather and reduce-scatter cost the rank CPU beyond the raw call
    host = {c.op: c.host_s for c in profile.collective}
    assert host["all_gather"] > 0 and host["reduce_scatter"] > 0 and host["all_reduce"] == 0
    for s in profile.collective_sample:
        assert s.algbw_bytes_per_s == pytest.approx(s.size_bytes / s.time_s)
        assert s.busbw_bytes_per_s == pytest.approx(s.algbw_bytes_per_s * bus_factor(s.op, 2))
    # tiny at micro-batch 4: 512 tokens; wq forward is (512 x 64) @ (64 x 64)^T, at TP 1 and 2.
    shapes = {(m.m, m.n, m.k, m.layout) for m in profile.matmul}
    assert {(512, 64, 64, "nt"), (512, 32, 64, "nt"), (64, 64, 512, "tn")} <= shapes
    assert {m.threads for m in profile.matmul} == {1, available_cores()}
    # and the model-independent grids every other model is interpolated over
    assert set(device_grid_shapes("cpu", quick=True)) <= shapes
    attention = {(a.batch, a.heads, a.kv_heads, a.seq, a.head_dim) for a in profile.attention}
    assert set(attention_grid("cpu", quick=True)) <= attention
    # --also tiny-moe: its experts as grouped matmuls, 512 x 2 routed rows over 4 experts (2
    # under EP 2) on (64 x 64) weights, every pass.
    grouped = {(g.groups, g.tokens, g.n, g.k, g.layout) for g in profile.grouped_matmul}
    assert {(e, 1024, 64, 64, lay) for e in (4, 2) for lay in ("nt", "nn", "tn")} == grouped
    plan = subprocess.run(
        [*cli, "plan", "estimate", str(ROOT / "configs/tiny-cpu.toml"), "--cluster", str(out),
         "--gpus", "2", "--dp", "2", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stderr
    est = json.loads(plan.stdout)
    assert est["step_time_s"] > 0 and est["mfu"] > 0
    assert est["cluster"]["profile"] == str(out)
    bad = subprocess.run(
        [*cli, "calibrate", "--nproc", "0", "--out", str(out)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--nproc 0" in bad.stderr


def test_collectives_are_issued_after_each_models_mlp_gemm():
    """Back to back, then after each calibrated model's first MLP projection at the micro-batch:
    small at micro-batch 2 is (512 tokens, ffn 688, hidden 256); tiny-moe (2 x 128 tokens, ffn
    176, hidden 64); a repeated shape is measured once; then a layer-scale GEMM (512 x 1024 x
    1024), unless a model's is as large (llama3-8b's: 8192 tokens x 14336 x 4096)."""
    from fivefold.calibration.comm import DEFAULT_GEMM, LAYER_GAP_GEMM, gaps

    small, moe = model_preset("small"), model_preset("tiny-moe")
    assert LAYER_GAP_GEMM == (512, 1024, 1024)
    assert gaps([small, moe, small], 2) == [None, (512, 688, 256), (256, 176, 64), LAYER_GAP_GEMM]
    assert gaps([], 2) == [None, DEFAULT_GEMM, LAYER_GAP_GEMM]
    assert gaps([model_preset("llama3-8b")], 1) == [None, (8192, 14336, 4096)]


def test_calibrate_time_estimate_up_front():
    """The help said about 25 s; a small recipe on 4 ranks took 3 min 22 s on a loaded 2-core
    machine. The estimate counts the measurements: the defaults (246 kernels, 80 collective
    rows on 2 ranks) about 25 s idle; small on 4 ranks (366, 224; 4 ranks share 2 cores)."""
    from fivefold.calibration.session import COLLECTIVE_S, KERNEL_S, LOADED, estimate_s
    from fivefold.cli.cmd_calibrate import duration

    assert estimate_s(246, 80, 2, 2) == pytest.approx(246 * KERNEL_S + 80 * COLLECTIVE_S)
    assert 20 <= estimate_s(246, 80, 2, 2) <= 30
    small4 = estimate_s(366, 224, 4, 2)
    assert small4 == pytest.approx(366 * KERNEL_S + 224 * COLLECTIVE_S * 2)
    assert small4 * LOADED == pytest.approx(202, rel=0.15)  # the 3 min 22 s seen under load
    assert [duration(s) for s in (12.4, 202, 3900)] == ["12 s", "3 min 22 s", "1 h 05 min"]


def test_quick_and_full_calibration_fit_their_time_targets(monkeypatch):
    """On an idle 2-core CPU `calibrate --quick` must take under a minute and the full form
    under five (issue targets): the defaults' measurement counts (small preset, micro-batch
    1, 2 ranks; bf16 native or not) through the up-front estimate, even at the loaded
    machine's factor for the quick one's minute."""
    from fivefold.calibration import compute as calibration_compute
    from fivefold.calibration.comm import gaps
    from fivefold.calibration.session import LOADED, estimate_s

    monkeypatch.setattr(calibration_compute, "available_cores", lambda: 2)
    small, plan = model_preset("small"), ParallelPlan(micro_batch=1)
    for bf16 in ("native", "emulated"):
        for quick, limit in ((True, 60 / LOADED), (False, 300)):
            kernels = len(calibration_compute.compute_steps(small, plan, 2, quick, bf16))
            collectives = steps_count(2, quick, len(gaps([small], 1)))
            assert estimate_s(kernels, collectives, 2, 2) < limit, (bf16, quick)


def test_calibrate_writes_out_by_default_and_the_default_location_only_when_asked(
    tmp_path, monkeypatch, capsys
):
    """It wrote ~/.cache/fivefold/device-profile.toml, which every later CPU run picked up."""
    from fivefold.cli import cmd_calibrate
    from fivefold.cli.main import main

    monkeypatch.syspath_prepend(str(ROOT / "tests" / "planner"))
    from test_profile import synthetic

    fake = parse_profile(synthetic())
    monkeypatch.setattr(cmd_calibrate, "run_calibration", lambda *a, **k: fake)
    installed = tmp_path / "cache" / "device-profile.toml"
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(installed))
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--no-progress"]) == 0
    assert (tmp_path / "device-profile.toml").is_file() and not installed.exists()
    assert "CPU runs use no profile unless named" in capsys.readouterr().out
    assert main(["calibrate", "--no-progress", "--out", "mine.toml"]) == 0
    assert (tmp_path / "mine.toml").is_file() and not installed.exists()
    capsys.readouterr()
    assert main(["calibrate", "--no-progress", "--install"]) == 0
    assert installed.is_file()
    assert "every CPU run without a [cluster] now uses it" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # one place or the other
        main(["calibrate", "--install", "--out", "x.toml"])


# ---- the CUDA path, without a GPU: torch.cuda monkeypatched, nothing launched ----------------
class _FakeEvent:
    """A CUDA event whose elapsed time is 2.5 ms between any two."""

    def __init__(self, enable_timing: bool = False):
        assert enable_timing

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: _FakeEvent) -> float:
        return 2.5


@pytest.fixture
def on_fake_gpu(monkeypatch):
    """Kernels "on" an H200: the measured device is cuda, torch.cuda answers as one."""
    monkeypatch.setattr(timing, "_device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))

    class Props:
        total_memory = 150_000_000_000

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *_: Props())


def test_kernels_on_a_gpu_are_timed_by_cuda_events(on_fake_gpu):
    ran = []
    assert timing.timed_s(lambda: ran.append(1)) == pytest.approx(2.5e-3)  # ms -> s
    assert ran == [1]
    assert matmul.fp8_supported() == hasattr(torch, "_scaled_mm")  # capability 9.0


def test_the_gpu_steps_measure_bf16_and_fp8_gemms_attention_bandwidth_and_launches(on_fake_gpu):
    model = model_preset("small")
    plan = ParallelPlan(micro_batch=2, precision="bf16-mixed")
    labels = [label for label, _ in compute.compute_steps(model, plan, 1, True, "native")]
    grid = device_grid_shapes("cuda", quick=True)
    for m, n, k, layout in grid:
        assert f"matmul bf16 {m}x{n}x{k} {layout}" in labels
        if matmul.fp8_supported():
            assert f"matmul fp8 {m}x{n}x{k} {layout}" in labels
    # small at micro-batch 2: 512 tokens; its wk forward (512 x 128 x 256) is measured too,
    # the LM head's 512 x 4096 x 256 as well; nothing per thread count (a GPU has none)
    assert "matmul bf16 512x128x256 nt" in labels and "matmul bf16 512x4096x256 nt" in labels
    assert not any(label.endswith("t") and ", " in label for label in labels)
    assert labels[-3:] == ["attention small", "bandwidth", "overhead"]
    assert "attention grid" in labels and "packed attention grid" in labels
    assert len(grid) == 3 * 3 * 3 * 3  # 3 m x 3 n x 3 k x 3 layouts


def test_a_gpu_profile_names_the_gpu_its_memory_and_nccl(on_fake_gpu):
    tables = sort_rows([])
    profile = build_profile(model_preset("small"), 1, "native", tables, "none", [], [])
    assert (profile.kind, profile.name, profile.backend) == ("cuda", "NVIDIA H200", "nccl")
    assert profile.memory_bytes == 150_000_000_000


def test_calibrate_measures_the_gpu_when_torch_sees_one(monkeypatch):
    from fivefold.calibration import session

    chosen = []
    monkeypatch.setattr(timing, "use_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert session.measuring_device(timing) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert session.measuring_device(timing) is False
    assert chosen == ["cuda", "cpu"]


def test_nccl_collectives_reach_one_gib():
    assert max(sizes_for(quick=False, cuda=True)) == 2**30
    assert max(sizes_for(quick=True, cuda=True)) == 2**30
    assert max(sizes_for(quick=False)) == 16 * 2**20  # gloo: as before
    assert steps_count(2, True, 2, cuda=True) == 5 * 3 * 2  # five ops, three sizes, two gaps


def test_a_cpu_run_leaves_a_gpu_profile_at_the_default_location_alone(tmp_path, monkeypatch):
    from fivefold.train.entry import with_default_profile

    profile = DeviceProfile(
        name="NVIDIA H200", kind="cuda", cores=16, memory_bytes=150 * 10**9, backend="nccl",
        ranks=1, matmul=(Matmul("bf16", 1, 512, 512, 512, "nt", 1e14),),
        attention=(Attention("bf16", 1, 1, 8, 8, 1024, 128, 1, 1e14, 1e14),),
        bandwidth=tuple(Bandwidth(k, 1, 1, 1e12) for k in BANDWIDTH_KINDS),
        overhead=(Overhead(1, *([0.0] * 14)),),
    )  # fmt: skip
    path = tmp_path / "device-profile.toml"
    path.write_text(profile.to_toml())
    monkeypatch.setenv("FIVEFOLD_PROFILE", str(path))
    data = {"train": {"device": "cpu"}}
    assert with_default_profile(data) == data  # measured on a GPU: not this CPU's
    path.write_text(profile.to_toml().replace('kind = "cuda"', 'kind = "cpu"'))
    assert with_default_profile(data)["cluster"] == {"profile": str(path)}


NEEDS_A_GPU = ("overhead", "packed attention grid")


def test_every_gpu_measurement_keeps_its_tensors_on_the_measured_device(monkeypatch):
    """The GPU steps run on the meta device (no GPU here): a tensor made on the host among
    them would fail as it would beside CUDA tensors (a device mismatch). Rows come back for
    every step: grid and model GEMMs, the grouped experts, attention, bandwidth, overhead."""
    monkeypatch.setattr(timing, "_device", torch.device("meta"))
    monkeypatch.setitem(timing.FLUSH_BYTES, "meta", 1024)
    monkeypatch.setitem(matmul.DEVICE_GRID, ("cuda", True), ((64,), (64,)))
    monkeypatch.setitem(attention.ATTENTION_GRID, ("cuda", True), ((4, 2), (1,), (128,), (32,)))
    plan = ParallelPlan(micro_batch=2, precision="bf16-mixed")
    steps = compute.cuda_steps(model_preset("tiny"), plan, 2, True, (model_preset("tiny-moe"),))
    # (the MoE layer's launch cost needs a real device: its routing counts tokens, bincount;
    # so do the packed kernels, varlen_attn and compiled FlexAttention)
    rows = [row for label, thunk in steps if label not in NEEDS_A_GPU for row in thunk()]
    assert {type(r).__name__ for r in rows} == {
        "Matmul", "GroupedMatmul", "Attention", "Bandwidth"
    }  # fmt: skip
    assert all(r.dtype == "bf16" for r in rows if hasattr(r, "dtype"))


def test_fp8_gemms_accumulate_as_torchao_runs_them(monkeypatch):
    """torchao's Float8Linear runs its forward GEMM with fast accumulation
    (`Float8LinearConfig.gemm_config_output`) and both gradient GEMMs without it: each pass of
    the profile's fp8 rows is timed that way."""
    torchao_config = pytest.importorskip("torchao.float8.config")
    for recipe in ("tensorwise", "rowwise"):
        config = torchao_config.Float8LinearConfig.from_recipe_name(recipe)
        assert config.gemm_config_output.use_fast_accum
        assert not config.gemm_config_grad_input.use_fast_accum
        assert not config.gemm_config_grad_weight.use_fast_accum
    calls = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: calls.append(kw), raising=False)
    monkeypatch.setattr(timing, "_device", torch.device("meta"))
    for layout in ("nt", "nn", "tn"):
        matmul._fp8_operands(32, 48, 64, layout)()
    assert [kw["use_fast_accum"] for kw in calls] == [True, False, False]
    assert all(kw["out_dtype"] == torch.bfloat16 for kw in calls)


def test_the_packed_kernels_are_measured_per_document(monkeypatch):
    """The grid's shapes again as rows of four documents through the kernel a run uses there
    (on a CPU the `document_attention` op; on a GPU varlen eager, FlexAttention compiled), each
    counted per document: a 64-token row of 4 x 16-token documents at 8 heads of 16 is
    4 x 4 x 16 x 8 x 16 x 8 FLOPs forward per row, here timed as 1 s forward and 2 s backward."""
    monkeypatch.setitem(attention.ATTENTION_GRID, ("cpu", True), ((8, 4), (1, 2), (64,), (16,)))
    monkeypatch.setattr(attention, "typical_time_s", lambda fn, budget: (fn(), 1.0)[1])
    monkeypatch.setattr(attention, "backward_time_s", lambda fn, g, budget: 2.0)
    rows = list(attention.measure_packed_attention_grid("cpu", 1, timing.QUICK, quick=True))
    assert [(r.kernel, r.batch, r.seq) for r in rows] == [
        ("document_attention", 4, 16), ("document_attention", 8, 16)
    ]  # fmt: skip
    per_row = 4 * 4 * 16 * 8 * 16 * 8  # documents x 4 x length x (length / 2) x dim x heads
    assert [r.forward_flops_per_s for r in rows] == [per_row, 2 * per_row]
    assert [r.backward_flops_per_s for r in rows] == [per_row, 2 * per_row]  # 2 x FLOPs / 2 s
    assert attention.packed_kernels("cuda", torch.bfloat16) == sorted(
        {"flex", "varlen" if hasattr(torch.nn.attention, "varlen") else "document_attention"}
    )
    assert attention.packed_kernels("cpu", torch.float32) == ["document_attention"]


def test_compiled_flex_is_measured_where_calibrate_has_time_for_its_compiles(monkeypatch):
    """Each FlexAttention shape is a compile: one-row shapes only (both head widths in the full
    grid), `--quick` one of them."""
    monkeypatch.setattr(attention, "packed_kernels", lambda kind, dtype: ["flex", "varlen"])
    monkeypatch.setattr(attention, "packed_attention_passes", lambda *a: (1.0, 2.0))
    shapes = {
        quick: [(r.kernel, r.batch, r.seq) for r in attention.measure_packed_attention_grid(
            "cuda", 1, timing.QUICK, quick, "bf16")]
        for quick in (True, False)
    }  # fmt: skip
    grid = attention_grid("cuda", True)
    assert [s for s in shapes[True] if s[0] == "flex"] == [("flex", 4, 2048)]
    assert len([s for s in shapes[True] if s[0] == "varlen"]) == len(grid) == 5
    flex_full = [s for s in shapes[False] if s[0] == "flex"]
    assert flex_full == [("flex", 4, s // 4) for s in (1024, 4096, 16384, 65536) for _ in "dd"]


def test_calibrate_ranks_take_their_device_from_the_runtimes_rule(monkeypatch):
    """One GPU per spawned rank or none: cuda:RANK made current, else cpu (`parallel/device.py`,
    the rule training uses; checked on CPU with a monkeypatched torch.cuda)."""
    import torch

    from fivefold.parallel.device import device_setting_for, pick_device

    current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    for gpus, world, expected in ((8, 4, "cuda:3"), (2, 4, "cpu"), (0, 1, "cpu")):
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=gpus: n)
        assert str(pick_device(device_setting_for(world), rank=world - 1)) == expected
    assert [str(d) for d in current] == ["cuda:3"]
