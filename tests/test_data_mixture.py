"""Weighted mixtures of sources (`[data] sources`): proportions, resume, per-source counts.

Three sources are made here from generated text (words of three disjoint alphabets, so a
sample's source can be told from its tokens), tokenised with one small tokenizer.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from rich.console import Console

from fivefold.errors import ConfigError, DataError
from fivefold.train.data import batch_iterator, prepare_shards, train_tokenizer
from fivefold.train.data.mixture import (
    BLOCK,
    MAX_DEVIATION,
    Interleave,
    MixtureSampler,
)
from fivefold.train.entry import load_run
from fivefold.train.inputs import TrainData, load_train_data
from fivefold.train.runtime import LocalRuntime
from fivefold.train.spikes import SKIP_FILE, SkipList
from fivefold.train.start import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = CONFIGS / "tiny-cpu.toml"
QUIET = ["train.progress=false", "train.tensorboard=false"]
ALPHABETS = {"web": "abcdefgh", "books": "ijklmnop", "code": "qrstuvwx"}
WEIGHTS = {"web": 0.6, "books": 0.3, "code": 0.1}


def generated_text(letters: str, docs: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(
            "".join(rng.choice(letters) for _ in range(rng.randint(2, 6)))
            for _ in range(rng.randint(20, 80))
        )
        for _ in range(docs)
    ]


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FIVEFOLD_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory):
    """(tokenizer path, {name: shard directory}) for web, books and code."""
    root = tmp_path_factory.mktemp("mix")
    files = {}
    for i, (name, letters) in enumerate(ALPHABETS.items()):
        path = root / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in generated_text(letters, 150, i))
        )
        files[name] = path
    tok = train_tokenizer(list(files.values()), vocab_size=300, out=root / "tok.json")
    shards = {n: prepare_shards([p], root / n, tok) for n, p in files.items()}
    return root / "tok.json", shards


def sources_override(shards: dict[str, Path], weights: dict[str, float]) -> str:
    tables = ", ".join(
        f'{{ name = "{n}", shards = "{shards[n]}", weight = {w} }}' for n, w in weights.items()
    )
    return f"data.sources=[{tables}]"


def mixture_run(tmp_path, three_sources, name, *overrides, weights=WEIGHTS, world=1):
    tok, shards = three_sources
    base = [f"train.runs_dir={str(tmp_path)!r}", f"train.name={name!r}", *QUIET]
    data = [f"data.tokenizer={str(tok)!r}", sources_override(shards, weights)]
    return load_run(TINY, [*base, *data, *overrides], world_size=world)


# ---- proportions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "weights", [[0.6, 0.15, 0.25], [0.6, 0.15, 0.1, 0.1, 0.05], [1, 1, 1], [0.999, 0.001]]
)
def test_realised_proportions_match_the_weights_at_every_count(weights):
    interleave = Interleave(weights)
    w = np.asarray(weights) / sum(weights)
    n = 3 * BLOCK + 1234  # crosses block boundaries
    src = interleave.sources(0, n)
    counts = np.stack([np.cumsum(src == s) for s in range(len(w))], axis=1)  # [n, k]
    ideal = np.arange(1, n + 1)[:, None] * w[None, :]
    assert np.abs(counts - ideal).max() <= MAX_DEVIATION
    for position in (0, 1, 17, BLOCK, 2 * BLOCK + 7, n):
        assert (
            interleave.drawn(position).tolist() == counts[position - 1].tolist()
            if position
            else [0] * len(w)
        )
    far = 123_456_789_012  # 10^11 positions without replaying them
    assert np.abs(interleave.drawn(far) - far * w).max() <= MAX_DEVIATION
    assert interleave.drawn(far).sum() == far


def test_each_source_draws_its_own_epochs_in_a_seeded_order():
    sampler = MixtureSampler(["a", "b"], [10, 7], [0.5, 0.5], seed=4)
    taken = sampler.take(140)  # 70 of each: 7 epochs of a, 10 of b
    a, b = taken[taken < 10], taken[taken >= 10] - 10
    for epoch in range(7):
        assert sorted(a[epoch * 10 : (epoch + 1) * 10].tolist()) == list(range(10))
    for epoch in range(10):
        assert sorted(b[epoch * 7 : (epoch + 1) * 7].tolist()) == list(range(7))
    assert a[:10].tolist() != list(range(10))  # shuffled
    again = MixtureSampler(["a", "b"], [10, 7], [0.5, 0.5], seed=4).take(140)
    other = MixtureSampler(["a", "b"], [10, 7], [0.5, 0.5], seed=5).take(140)
    assert taken.tolist() == again.tolist() != other.tolist()


# ---- exact resume on 1 and 4 data-parallel ranks -------------------------------------------


def _global_batches(data, sampler_state, dp_size, steps, micro=1):
    samplers = []
    for _ in range(dp_size):
        s = MixtureSampler(data.sampler.names, data.sampler.sizes, data.sampler.weights, 0)
        s.load_state_dict(sampler_state)
        samplers.append(s)
    iters = [
        batch_iterator(data.train, samplers[r], 8, micro, r, dp_size, steps=steps)
        for r in range(dp_size)
    ]
    out = [
        torch.cat([b.tokens for rank in step for b in rank]) for step in zip(*iters, strict=True)
    ]
    return out, samplers[0].state_dict()


def test_mixture_resumes_exactly_on_one_and_four_ranks(three_sources, tmp_path):
    data = load_train_data(mixture_run(tmp_path, three_sources, "dp"))
    start = data.sampler.state_dict()
    reference, _ = _global_batches(data, start, 1, 6)
    first, state = _global_batches(data, start, 4, 3)
    state = json.loads(json.dumps(state))  # what a checkpoint's state.json keeps
    assert state["consumed"] == 24
    rest, _ = _global_batches(data, state, 1, 3, micro=2)
    for got, want in zip(first + rest, reference, strict=True):
        assert torch.equal(got, want)
    # every row is one source's text: the source of each sample, by its letters
    tok_sources = data.train.source_of(np.arange(len(data.train)))
    assert set(tok_sources.tolist()) == {0, 1, 2}
    with pytest.raises(DataError, match=r"same data\.sources"):
        MixtureSampler(["web", "books", "code"], data.sampler.sizes, [1, 1, 1]).load_state_dict(
            state
        )


def test_step_sources_name_each_batch_and_sum_to_the_tokens_drawn(three_sources, tmp_path):
    data = load_train_data(mixture_run(tmp_path, three_sources, "names"))
    per_step = [data.batch_sources((step - 1) * 8, step * 8) for step in range(1, 11)]
    assert all(sum(s.values()) == 8 for s in per_step)
    totals = {n: sum(s[n] for s in per_step) for n in WEIGHTS}
    assert {n: t * 128 for n, t in totals.items()} == data.tokens_drawn(80)
    for name, weight in WEIGHTS.items():  # 80 samples: 48, 24, 8 within the bound
        assert abs(totals[name] - 80 * weight) <= MAX_DEVIATION
    # the batch the loop draws holds exactly those sources (told apart by their letters)
    batch = next(data.batches(micro_batch=8))[0]
    found = data.train.source_of(batch.sample_ids.numpy())
    names = list(WEIGHTS)
    assert {n: int((found == i).sum()) for i, n in enumerate(names)} == per_step[0]


# ---- training -------------------------------------------------------------------------------


def _train(run):
    runtime = LocalRuntime(run.recipe, run.train)
    return train(run, runtime=runtime, console=Console(quiet=True))


def test_tokens_by_source_count_exactly_the_batches_drawn_past_a_skipped_one(
    three_sources, tmp_path, monkeypatch
):
    # Step 3's batch (samples [16, 24)) is on the skip list, as after a rollback: the run draws
    # [0, 8), [8, 16), [24, 32); its counts are those batches' sources, told by their letters.
    (tmp_path / "skipping").mkdir()
    SkipList(tmp_path / "skipping" / SKIP_FILE).add(16, 24, 3, write=True)
    drawn: list[np.ndarray] = []
    clean = TrainData.batches

    def batches(self, micro_batch):
        for micro_batches in clean(self, micro_batch):
            ids = np.concatenate([b.sample_ids.numpy() for b in micro_batches])
            drawn.append(self.train.source_of(ids))
            yield micro_batches

    monkeypatch.setattr(TrainData, "batches", batches)
    summary = _train(
        mixture_run(tmp_path, three_sources, "skipping", "train.steps=3", "train.warmup_steps=1")
    )
    found = np.concatenate(drawn)
    exact = {n: int((found == i).sum()) * 128 for i, n in enumerate(WEIGHTS)}
    assert sum(exact.values()) == 3 * 8 * 128
    records = (tmp_path / "skipping" / "metrics.jsonl").read_text().splitlines()
    assert summary.tokens_by_source == exact == json.loads(records[-1])["tokens_by_source"]
    data = load_train_data(mixture_run(tmp_path, three_sources, "plain"))
    assert exact != data.tokens_drawn(24)  # [16, 24) holds other sources than [24, 32)


def test_mixture_trains_counts_tokens_and_resumes_bit_identically(three_sources, tmp_path):
    steps = ["train.steps=3", "train.warmup_steps=1", "train.eval_every=2", "train.eval_batches=1"]
    straight = _train(mixture_run(tmp_path, three_sources, "straight", *steps))
    _train(mixture_run(tmp_path, three_sources, "split", *steps, "train.stop_at=1"))
    second = _train(mixture_run(tmp_path, three_sources, "split", *steps, "train.resume=true"))
    assert second.start_step == 1
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["loss"] for r in records] == straight.losses  # exact float equality
    assert straight.tokens_by_source == records[-1]["tokens_by_source"]
    assert sum(straight.tokens_by_source.values()) == 3 * 8 * 128
    for name, weight in WEIGHTS.items():
        assert abs(straight.tokens_by_source[name] / 128 - 24 * weight) <= MAX_DEVIATION
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2, 3]  # every 2 steps, and where a run stops
    by_source = evals[-1]["eval_loss_by_source"]
    assert set(by_source) == set(WEIGHTS)
    weighted = sum(WEIGHTS[n] * loss for n, loss in by_source.items())
    assert evals[-1]["eval_loss"] == pytest.approx(weighted, rel=1e-12)
    assert all(0 < loss < math.log(4096) + 1 for loss in by_source.values())


def test_run_start_prints_tokens_and_epochs_per_source(three_sources, tmp_path, capsys):
    from fivefold.cli.main import main

    tok, shards = three_sources
    code = main(
        [
            "train",
            str(TINY),
            f"train.run_dir={str(tmp_path / 'r')!r}",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.save_final=false",
            *QUIET,
            f"data.tokenizer={str(tok)!r}",
            sources_override(shards, {"web": 6, "books": 3, "code": 1}),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    data = load_train_data(mixture_run(tmp_path, three_sources, "x"))
    for d in data.plan_draws(1):
        assert f"{d.name}: weight {d.weight:.3f}, {d.tokens:,.0f} tokens" in out
    # 6:3:1 -> 0.6, 0.3, 0.1; one step of 8 samples x 128 tokens: 5, 2, 1 samples drawn
    assert "web: weight 0.600, 640 tokens" in out and "code: weight 0.100, 128 tokens" in out
    code_draw = next(d for d in data.plan_draws(1) if d.name == "code")
    assert code_draw.epochs == pytest.approx(code_draw.tokens / (len(data.sources[2].train) * 128))
    assert "tokens drawn per source by step 1:" in out


# ---- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ({"web": -1, "books": 1, "code": 1}, "data.sources[0] ('web'): weight = -1"),
        ({"web": "nan", "books": 1, "code": 1}, "data.sources[0] ('web'): weight = nan"),
        ({"web": 0, "books": 0, "code": 0}, "every weight is 0"),
    ],
)
def test_bad_weights_are_config_errors_naming_the_source(three_sources, tmp_path, weights, needle):
    with pytest.raises(ConfigError) as err:
        mixture_run(tmp_path, three_sources, "bad", weights=weights)
    assert needle in str(err.value)


def test_a_source_with_another_tokenizer_is_named(three_sources, tmp_path):
    tok, shards = three_sources
    other_tok = train_tokenizer([tok.parent / "code.jsonl"], vocab_size=280)
    odd = prepare_shards([tok.parent / "code.jsonl"], tmp_path / "odd", other_tok)
    run = mixture_run(tmp_path, (tok, {**shards, "code": odd}), "odd")
    with pytest.raises(DataError, match=r"data.sources\[2\] \('code'\): shards in .* made with"):
        load_train_data(run)


def test_sources_and_shards_together_or_without_weight_are_refused(three_sources, tmp_path):
    _, shards = three_sources
    with pytest.raises(ConfigError, match=r"data\.sources and data\.shards"):
        mixture_run(tmp_path, three_sources, "both", f"data.shards={str(shards['web'])!r}")
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: no weight"):
        load_run(TINY, [f'data.sources=[{{ shards = "{shards["web"]}" }}]'], world_size=1)


@pytest.mark.slow
def test_mixture_on_four_processes_matches_one_and_resumes_bit_identically(three_sources, tmp_path):
    """`fivefold train --nproc 4` (ZeRO-3 over 4 data-parallel ranks) on the mixture: the same
    tokens per source as one process, losses within float round-off of it, and a run stopped
    at step 2 and resumed on 4 processes equal to an uninterrupted one, bit for bit."""
    from fivefold.cli.main import main

    tok, shards = three_sources
    common = [
        *QUIET, "train.steps=4", "train.warmup_steps=1", "plan.micro_batch=2",
        "plan.grad_accum=1", f"data.tokenizer={str(tok)!r}", sources_override(shards, WEIGHTS),
    ]  # fmt: skip
    four = ["--nproc", "4", str(TINY), "plan.dp_shard=4", "plan.zero=3", *common]

    def records(name: str) -> list[dict]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines]

    one = ["train", str(TINY), *common, "plan.micro_batch=8"]
    assert main([*one, f"train.run_dir={str(tmp_path / 'one')!r}"]) == 0
    assert main(["train", *four, f"train.run_dir={str(tmp_path / 'four')!r}"]) == 0
    split = f"train.run_dir={str(tmp_path / 'split')!r}"
    assert main(["train", *four, split, "train.stop_at=2"]) == 0
    assert main(["train", *four, split, "train.resume=true"]) == 0
    straight, single, resumed = records("four"), records("one"), records("split")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["tokens_by_source"] for r in straight] == [r["tokens_by_source"] for r in single]
    for a, b in zip(straight, single, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_a_source_of_parquet_inputs_reads_data_text_field(three_sources, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok, shards = three_sources
    texts = generated_text(ALPHABETS["code"], 150, 2)  # what code.jsonl holds
    pq.write_table(pa.table({"body": texts}), tmp_path / "code.parquet")
    tables = (
        f'{{ name = "web", shards = "{shards["web"]}", weight = 1 }}, '
        f'{{ name = "code", inputs = ["{tmp_path / "code.parquet"}"], weight = 1 }}'
    )
    base = [f"train.runs_dir={str(tmp_path)!r}", *QUIET, f"data.tokenizer={str(tok)!r}"]
    run = load_run(TINY, [*base, f"data.sources=[{tables}]", "data.text_field='body'"], 1)
    data = load_train_data(run)
    got = data.sources[1].shards
    want = load_train_data(mixture_run(tmp_path, three_sources, "x")).sources[2].shards
    assert got.tokens(0, got.num_tokens).tolist() == want.tokens(0, want.num_tokens).tolist()
    with pytest.raises(DataError, match=r"data.sources\[1\] \('code'\): input file .* no column"):
        load_train_data(load_run(TINY, [*base, f"data.sources=[{tables}]"], 1))


def test_a_weight_too_small_to_interleave_is_named():
    with pytest.raises(DataError, match="'rare' has a weight below 1/65536"):
        MixtureSampler(["common", "rare"], [10, 10], [1.0, 1e-6])


def test_trackers_log_each_source_under_its_name():
    from fivefold.train.metrics import StepMetrics, scalars

    m = StepMetrics(3, 2.5, 1.0, 1e-3, 1024, 0.1, 1e4, None, None, 0, 1.0)
    m.tokens_by_source, m.eval_loss_by_source = {"web": 640, "code": 128}, {"web": 2.0}
    values = scalars(m)
    assert values["train/tokens_by_source/web"] == 640
    assert values["train/tokens_by_source/code"] == 128
    assert values["train/eval_loss_by_source/web"] == 2.0
    assert values["train/loss"] == 2.5
