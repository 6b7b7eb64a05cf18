"""`fivefold presets`: every preset listed with exact parameter counts."""

from __future__ import annotations

import json

from fivefold.cli.cmd_presets import format_count
from fivefold.cli.main import main
from fivefold.specs.cluster import CLUSTER_PRESETS
from fivefold.specs.presets import MODEL_PRESETS


def presets_json(capsys) -> dict:
    assert main(["presets", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_tiny_count_by_hand(capsys):
    # embedding + LM head 2 * 4096 * 64; per layer: wq, wo 64x64, wk, wv 64x32, SwiGLU 3 x 64 x 176,
    # two norms of 64; final norm 64.
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64
    expected = 2 * 4096 * 64 + 2 * per_layer + 64
    assert expected == 616_768
    rows = {r["name"]: r for r in presets_json(capsys)["models"]}
    assert rows["tiny"]["params"] == expected
    assert rows["tiny"]["active_params"] == expected


def test_moe_active_count_by_hand(capsys):
    # tiny-moe: 4 routed experts of width 64 (top-2) + 1 shared, router 64 x 4; a token uses
    # 2 routed + 1 shared expert, so 2 of the 4 routed experts per layer are inactive.
    rows = {r["name"]: r for r in presets_json(capsys)["models"]}
    expert = 3 * 64 * 64
    assert rows["tiny-moe"]["params"] - rows["tiny-moe"]["active_params"] == 2 * 2 * expert
    assert rows["mixtral-8x7b"]["ffn"] == "8x14336 top2"


def test_every_preset_listed(capsys):
    data = presets_json(capsys)
    assert [r["name"] for r in data["models"]] == list(MODEL_PRESETS)
    assert [r["name"] for r in data["clusters"]] == list(CLUSTER_PRESETS)
    h100 = next(r for r in data["clusters"] if r["name"] == "dgx-h100")
    assert h100["bf16_peak_tflops"] == 989.4 and h100["nvlink_gb_per_s"] == 900


def test_table_shows_published_sizes(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for text in ("llama3-8b", "8.03B", "70.55B", "671.03B", "37.56B", "616.77K", "6.45M"):
        assert text in out
    assert "dgx-b200" in out and "2250" in out


def test_format_count():
    assert format_count(8_030_261_248) == "8.03B"
    assert format_count(616_768) == "616.77K"
    assert format_count(999) == "999"
