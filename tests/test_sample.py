"""`fivefold sample`: greedy text equals transformers' greedy `generate` on the exported model
(an independent implementation of the same decoding), sampling is reproducible by seed, and the
nucleus filter keeps exactly the hand-derived tokens."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fivefold.cli.main import main
from fivefold.model.generate import top_p_filter
from fivefold.train.data.tokenizer import default_tokenizer

TINY = str(Path(__file__).parent.parent / "configs" / "tiny-cpu.toml")
PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sample") / "run"
    quiet = ["--no-progress", "train.tensorboard=false", "train.eval_every=0"]
    assert main(["train", TINY, "--steps", "30", f"train.run_dir={run}", *quiet]) == 0
    return run


def _sample(capsys, *args: str) -> str:
    assert main(["sample", *args]) == 0
    return capsys.readouterr().out


def test_greedy_matches_transformers_generate(run_dir, tmp_path, capsys) -> None:
    import transformers

    text = _sample(capsys, str(run_dir), "--prompt", PROMPT, "--greedy", "--max-tokens", "20")
    assert text.startswith(PROMPT)
    assert main(["export", "--hf", str(tmp_path / "hf"), "--from", str(run_dir)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf"), local_files_only=True, dtype=torch.float32
    ).eval()
    tok = default_tokenizer()
    prompt = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1] :]
    expected = PROMPT + tok.decode(theirs.tolist(), skip_special_tokens=True)
    assert text == expected + "\n"


def test_top_p_sampling_is_reproducible_by_seed(run_dir, capsys) -> None:
    args = [str(run_dir), "--prompt", PROMPT, "--max-tokens", "30", "--top-p", "0.95"]
    first = _sample(capsys, *args, "--seed", "1")
    again = _sample(capsys, *args, "--seed", "1")
    other = _sample(capsys, *args, "--seed", "2")
    assert first == again and first != other


def test_sample_refuses_bad_settings(run_dir, capsys) -> None:
    assert main(["sample", str(run_dir), "--top-p", "1.5", "--max-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "--top-p 1.5" in err and "--max-tokens 0" in err and "Traceback" not in err
    assert main(["sample", str(run_dir / "nope")]) == 2


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))
    kept = lambda p: torch.isfinite(top_p_filter(logits, p)).nonzero().flatten().tolist()  # noqa: E731
    assert kept(0.5) == [1]  # 0.5 alone reaches 0.5
    assert kept(0.8) == [1, 3]  # 0.5 + 0.3
    assert kept(0.81) == [1, 2, 3]  # + 0.15
    assert kept(1.0) == [0, 1, 2, 3]
    assert math.isclose(float(torch.softmax(top_p_filter(logits, 0.8), -1)[1]), 0.5 / 0.8)
