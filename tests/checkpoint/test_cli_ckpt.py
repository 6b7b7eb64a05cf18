"""`fivefold ckpt ls` and `fivefold ckpt verify` through the real CLI entry."""

from __future__ import annotations

import pytest
import torch

from fivefold.checkpoint import Checkpointer
from fivefold.cli.main import main
from fivefold.model import build_model
from fivefold.specs.presets import model_preset


@pytest.fixture
def run_dir(tmp_path):
    spec = model_preset("tiny")
    model = build_model(spec)
    model.to_empty(device="cpu")
    model.init_weights(0)
    optimizer = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(tmp_path / "ckpt", keep=3)
    for step in (5, 10, 15):
        ckpt.save(step, [model], optimizer, model_spec=spec.to_dict(), plan={"tp": 1, "pp": 1})
    (tmp_path / "ckpt" / ".staging_step_20").mkdir()
    return tmp_path


def corrupt(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x10
    path.write_bytes(bytes(raw))


def test_ls_lists_steps_sizes_and_staging(run_dir, capsys):
    assert main(["ckpt", "ls", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[1:4]]
    assert [row[0] for row in rows] == ["5", "10", "15"]
    assert all(row[3] == "ok" for row in rows)
    size_mib = float(rows[0][1])
    # tiny: 616,768 parameters; fp32 weights + AdamW m and v = 12 bytes each
    assert abs(size_mib - 616_768 * 12 / 2**20) < 0.2
    assert "1 rank(s), single, model+optimizer" in lines[1]
    assert ".staging_step_20: unfinished save" in lines[-2]
    assert lines[0].split()[3] == "sizes"  # says what ls checked (not the hashes)
    assert "`fivefold ckpt verify` also checks the SHA-256" in lines[-1]


def test_verify_ok_then_corrupt(run_dir, capsys):
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == 3 and "newest valid checkpoint:" in out
    corrupt(run_dir / "ckpt" / "step_15" / "__0_0.distcp")
    assert main(["ckpt", "verify", str(run_dir / "ckpt")]) == 1
    out = capsys.readouterr().out
    assert "step_15: INVALID: file __0_0.distcp fails its SHA-256 checksum (corrupt)" in out
    assert out.strip().endswith("step_10")
    assert main(["ckpt", "verify", "--quick", str(run_dir / "ckpt" / "step_15")]) == 0


def test_verify_missing_dir_is_a_user_error(tmp_path, capsys):
    assert main(["ckpt", "verify", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err
    assert main(["ckpt", "ls", str(tmp_path)]) == 2
    assert "holds no checkpoints" in capsys.readouterr().err


def test_top_level_help_names_the_ckpt_verbs(run_dir, capsys):
    """`fivefold --help` said "list and verify checkpoints" while the verb is `ls`."""
    with pytest.raises(SystemExit):
        main(["--help"])
    ckpt_line = next(line for line in capsys.readouterr().out.splitlines() if "ckpt " in line)
    assert "`ckpt ls DIR`" in ckpt_line and "`ckpt verify DIR`" in ckpt_line
    assert main(["ckpt", "list", str(run_dir)]) == 0  # the word the old help suggested works too
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "5"
