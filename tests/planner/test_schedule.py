"""Pipeline schedules: completeness, deadlock-freedom, closed forms, in-flight peaks."""

import itertools
import random

import pytest

from fivefold.errors import ConfigError
from fivefold.planner.schedule import actions as sched_mod
from fivefold.planner.schedule import simulation as sim_mod
from fivefold.planner.schedule.actions import build_schedule
from fivefold.planner.schedule.simulation import StageCosts, closed_form_bubble, simulate
from fivefold.specs.geometry import SCHEDULES, least_microbatches

VPP = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}


def _valid_cases():
    for name, pp, m in itertools.product(SCHEDULES, (1, 2, 3, 4, 8), (1, 2, 4, 8, 12, 16)):
        for vpp in (VPP[name], 3) if name == "interleaved-1f1b" else (VPP[name],):
            if name == "interleaved-1f1b" and m % pp:
                continue
            if m < least_microbatches(name, pp):
                continue
            yield name, pp, vpp, m


CASES = list(_valid_cases())


@pytest.mark.parametrize(("name", "pp", "vpp", "m"), CASES)
def test_every_action_list_is_complete_and_runs(name, pp, vpp, m):
    s = build_schedule(name, pp, vpp, m)
    chunks = pp * vpp
    seen = {}
    for rank, actions in enumerate(s.actions):
        for a in actions:
            assert s.rank_of(a.chunk) == rank, f"{a} is on rank {rank}"
            key = (a.kind, a.microbatch, a.chunk)
            seen[key] = seen.get(key, 0) + 1
    kinds = ("F", "B", "W") if s.split_backward else ("F", "B")
    expected = {(k, mb, c): 1 for k in kinds for mb in range(m) for c in range(chunks)}
    assert seen == expected
    sim = simulate(s, StageCosts.uniform(chunks, 1.0, 1.5, 0.5, p2p_s=0.1))  # no deadlock
    assert len(sim.events) == pp
    # every dependency is honoured in the timeline
    done = {(e.kind, e.microbatch, e.chunk): e for row in sim.events for e in row}
    for e in done.values():
        if e.kind == "F" and e.chunk > 0:
            assert e.start_s >= done[("F", e.microbatch, e.chunk - 1)].end_s - 1e-12
        if e.kind == "B":
            assert e.start_s >= done[("F", e.microbatch, e.chunk)].end_s - 1e-12
            if e.chunk < chunks - 1:
                assert e.start_s >= done[("B", e.microbatch, e.chunk + 1)].end_s - 1e-12
        if e.kind == "W":
            assert e.start_s >= done[("B", e.microbatch, e.chunk)].end_s - 1e-12
    for row in sim.events:  # a rank runs one action at a time
        for prev, nxt in itertools.pairwise(row):
            assert nxt.start_s >= prev.end_s - 1e-12


@pytest.mark.parametrize(
    ("pp", "vpp", "m"), [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 3, 12), (8, 4, 16), (4, 2, 4)]
)
def test_interleaved_bubble_relative_to_ideal(pp, vpp, m):
    # Each chunk is 1/v of a stage: forward 1/v, backward 2/v.
    costs = StageCosts.uniform(pp * vpp, 1.0 / vpp, 2.0 / vpp)
    sim = simulate(build_schedule("interleaved-1f1b", pp, vpp, m), costs)
    assert sim.bubble_over_ideal == pytest.approx((pp - 1) / (vpp * m), rel=1e-9)
    assert sim.bubble_fraction == pytest.approx(closed_form_bubble(pp, m, vpp), rel=1e-9)
    plain = simulate(build_schedule("1f1b", pp, 1, m), StageCosts.uniform(pp, 1.0, 2.0))
    assert sim.step_time_s < plain.step_time_s


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
def test_v_schedules_beat_1f1b(name, pp, m):
    # Same work per micro-batch and stage: F = 1, B (input) = 1, W = 1 (Qi et al.'s setting).
    one = simulate(build_schedule("1f1b", pp, 1, m), StageCosts.uniform(pp, 1.0, 1.0, 1.0))
    v = simulate(build_schedule(name, pp, 2, m), StageCosts.uniform(2 * pp, 0.5, 0.5, 0.5))
    assert v.bubble_fraction < one.bubble_fraction / 3
    assert v.step_time_s < one.step_time_s
    # the only idle time left is the first micro-batch's way down the V: (pp - 1) half-chunks
    assert v.step_time_s == pytest.approx(3.0 * m + 0.5 * (pp - 1))


def test_zbv_zero_bubble_steady_state_by_hand():
    # pp = 2, m = 4, F = B = W = 1 per chunk: rank 0 never idles; rank 1 waits 1 for the first F.
    s = build_schedule("zbv", 2, 2, 4)
    sim = simulate(s, StageCosts.uniform(4, 1.0, 1.0, 1.0))
    assert sim.busy_s == (24.0, 24.0)
    assert sim.step_time_s == 25.0
    assert [(a.kind, a.microbatch, a.chunk) for a in s.actions[0][:5]] == [
        ("F", 0, 0),
        ("F", 1, 0),
        ("F", 2, 0),
        ("F", 0, 3),
        ("B", 0, 3),
    ]


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 4), (8, 32), (16, 64)])
def test_peak_inflight_closed_forms(pp, m):
    one = build_schedule("1f1b", pp, 1, m)
    assert one.peak_inflight == [min(pp - i, m) for i in range(pp)]
    assert build_schedule("gpipe", pp, 1, m).peak_inflight == [m] * pp
    if m % pp == 0:
        v = 2
        inter = build_schedule("interleaved-1f1b", pp, v, m)
        # Narayanan: warm-up (v-1)*p + 2(p-1-i) chunk forwards, plus the one in flight
        expected = [min((v - 1) * pp + 2 * (pp - 1 - i) + 1, m * v) for i in range(pp)]
        assert inter.peak_inflight == expected
    if m >= 2 * pp:
        # ZBV keeps 1F1B's memory: 2p half-size chunks on every rank = p stage activations
        assert build_schedule("zbv", pp, 2, m).peak_inflight == [2 * pp] * pp


def test_peak_inflight_closed_forms_match_the_action_lists():
    checked = 0
    extra = [
        ("1f1b", 9, 1, 40),
        ("interleaved-1f1b", 5, 3, 45),
        ("zbv", 7, 2, 33),
        ("dualpipev", 6, 2, 49),
    ]
    for name, pp, vpp, m in [*CASES, *extra]:
        s = build_schedule(name, pp, vpp, m)
        assert tuple(s.peak_inflight) == sched_mod.peak_inflight_from_actions(s), (name, pp, m)
        checked += 1
    assert checked > 100


def test_point_to_point_time_adds_to_the_critical_path():
    # GPipe, uniform: the first micro-batch crosses p-1 links going down, the last p-1 coming back.
    pp, m, c = 4, 8, 0.25
    costs = StageCosts.uniform(pp, 1.0, 2.0, p2p_s=c)
    sim = simulate(build_schedule("gpipe", pp, 1, m), costs)
    assert sim.step_time_s == pytest.approx((m + pp - 1) * 3.0 + 2 * (pp - 1) * c)
    # 1F1B has no slack in its steady state, so each transfer also delays later micro-batches:
    # with one micro-batch it is the same round trip, with more it costs more than GPipe's.
    one = simulate(build_schedule("1f1b", pp, 1, 1), costs)
    assert one.step_time_s == pytest.approx(pp * 3.0 + 2 * (pp - 1) * c)
    assert simulate(build_schedule("1f1b", pp, 1, m), costs).step_time_s > sim.step_time_s
    # chunks pp-1 and pp of a V share a rank: no transfer at the bottom of the V
    s = build_schedule("zbv", 2, 2, 4)
    e = {
        (x.kind, x.microbatch, x.chunk): x
        for row in simulate(s, StageCosts.uniform(4, 1, 1, 1, p2p_s=0.5)).events
        for x in row
    }
    assert e[("F", 0, 2)].start_s == e[("F", 0, 1)].end_s
    assert e[("F", 0, 1)].start_s == e[("F", 0, 0)].end_s + 0.5


def test_unbalanced_stages_slowest_sets_the_pace():
    # Stage 2 is 1.5x slower. GPipe by hand: its forwards end at 2 + 16 * 1.5 = 26, stage 3's
    # at 27; stage 3's backwards end at 27 + 2(k+1), so stage 2's start at 29 and run back to
    # back (3 each) to 77; stages 1 and 0 add 2 each: 81 = sum of stages + (m - 1) * slowest.
    f = [1.0, 1.0, 1.5, 1.0]
    costs = StageCosts(f, [2 * x for x in f], [0.0] * 4)
    m = 16
    gpipe = simulate(build_schedule("gpipe", 4, 1, m), costs)
    assert gpipe.step_time_s == pytest.approx(81.0)
    # 1F1B can do no better than the slow stage's work (72) plus the forwards before it (2) and
    # the backwards after it (4), and does no worse than GPipe here.
    one = simulate(build_schedule("1f1b", 4, 1, m), costs)
    assert 78.0 <= one.step_time_s <= 81.0
    assert one.busy_s == pytest.approx((48.0, 48.0, 72.0, 48.0))


@pytest.mark.parametrize("name", SCHEDULES)
def test_long_schedules_extrapolate_to_the_full_run(name, monkeypatch):
    rng = random.Random(7)
    pp = 4
    vpp = VPP[name]
    m = 96
    chunks = pp * vpp
    f = [1.0] * chunks
    f[0], f[-1] = 1.1, 1.4  # embedding on the first chunk, head on the last
    costs = StageCosts(f, [2 * x for x in f], [0.6 * x for x in f], p2p_s=0.03)
    s = build_schedule(name, pp, vpp, m)
    monkeypatch.setattr(sim_mod, "EXACT_ACTION_LIMIT", 10**9)
    exact = sim_mod._simulate_cached.__wrapped__(s, costs)
    monkeypatch.setattr(sim_mod, "EXACT_ACTION_LIMIT", 200 + rng.randint(0, 50))
    approx = sim_mod._simulate_cached.__wrapped__(s, costs)
    assert approx.extrapolated and not exact.extrapolated
    assert approx.step_time_s == pytest.approx(exact.step_time_s, rel=1e-3)
    assert approx.busy_s == pytest.approx(exact.busy_s)
    assert approx.peak_inflight == exact.peak_inflight


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("pipedream", 4, 1, 8), "choose one of gpipe"),
        (("1f1b", 0, 1, 8), "pp = 0"),
        (("1f1b", 4, 1, 0), "microbatches (grad_accum) = 0"),
        (("1f1b", 4, 2, 8), "set plan.vpp = 1"),
        (("interleaved-1f1b", 4, 1, 8), "needs plan.vpp >= 2"),
        (("interleaved-1f1b", 4, 2, 6), "multiple of plan.pp = 4"),
        (("zbv", 4, 3, 8), "set plan.vpp = 2"),
        (("zbv", 4, 2, 6), "needs at least 7"),
        (("dualpipev", 4, 2, 7), "needs at least 8"),
    ],
)
def test_bad_schedule_arguments(args, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        build_schedule(*args)
    assert fragment in str(err.value)


def test_stage_costs_must_match_the_chunks():
    with pytest.raises(ConfigError, match="pp \\* vpp = 4 chunks"):
        simulate(build_schedule("1f1b", 4, 1, 4), StageCosts.uniform(3, 1.0, 2.0))
    with pytest.raises(ConfigError, match="one entry per"):
        StageCosts([1.0, 1.0], [2.0], [0.0, 0.0])
    with pytest.raises(ConfigError, match=">= 0"):
        StageCosts.uniform(2, -1.0, 2.0)
