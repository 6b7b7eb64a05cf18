"""Manifest, atomic commit, retention, verification and fallback (pure Python, no torch)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from fivefold.checkpoint import manifest as mf
from fivefold.errors import CheckpointError


def fake_checkpoint(root: Path, step: int, payload: bytes = b"abc" * 1000) -> Path:
    """A committed checkpoint with two data files, written the way the checkpointer does."""
    staging = mf.staging_dir(root, step)
    staging.mkdir(parents=True)
    (staging / "__0_0.distcp").write_bytes(payload + bytes([step]))
    (staging / "state.json").write_text(json.dumps({"step": step}))
    files = mf.describe_files(staging, mf.data_files(staging))
    mf.write_manifest(staging, step, files, world_size=1)
    return mf.commit(staging, root / mf.step_dir_name(step))


def test_digest_is_sha256_and_size(tmp_path):
    data = bytes(range(256)) * 40_000  # 10 MB: more than one 8 MiB hashing chunk
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert mf.file_digest(path) == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_staging_is_invisible_until_commit(tmp_path):
    root = tmp_path / "ckpt"
    fake_checkpoint(root, 1)
    staging = mf.staging_dir(root, 2)
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"partial")
    assert [step for step, _ in mf.list_checkpoints(root)] == [1]
    assert mf.list_staging(root) == [staging]
    assert mf.newest_valid(root).path == root / "step_1"
    assert mf.remove_staging(root) == [staging]
    assert not staging.exists()


def test_manifest_lists_every_file_with_total(tmp_path):
    path = fake_checkpoint(tmp_path, 7)
    manifest = mf.read_manifest(path)
    assert manifest["step"] == 7
    assert sorted(manifest["files"]) == ["__0_0.distcp", "state.json"]
    sizes = {p.name: p.stat().st_size for p in path.iterdir() if p.name != mf.MANIFEST_FILE}
    assert manifest["total_bytes"] == sum(sizes.values())
    assert {k: v["bytes"] for k, v in manifest["files"].items()} == sizes


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("flip", "fails its SHA-256 checksum"),
        ("truncate", "has 2 bytes, the manifest says 3001"),
        ("delete", "file __0_0.distcp is missing"),
        ("manifest", "no manifest.json"),
        ("garbled", "is not valid JSON"),
    ],
)
def test_verify_names_the_damage(tmp_path, damage, expected):
    path = fake_checkpoint(tmp_path, 3)
    data = path / "__0_0.distcp"
    if damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0x01
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(b"ab")
    elif damage == "delete":
        data.unlink()
    elif damage == "manifest":
        (path / mf.MANIFEST_FILE).unlink()
    else:
        (path / mf.MANIFEST_FILE).write_text("{not json")
    result = mf.verify_checkpoint(path)
    assert not result.ok
    assert any(expected in p for p in result.problems), result.problems


def test_quick_check_misses_what_only_checksums_catch(tmp_path):
    path = fake_checkpoint(tmp_path, 3)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert mf.verify_checkpoint(path, full=False).ok
    assert not mf.verify_checkpoint(path, full=True).ok


def test_sharded_verification_covers_each_file_once(tmp_path):
    path = fake_checkpoint(tmp_path, 3)
    (path / "state.json").write_text("changed: another size")
    problems = [mf.verify_checkpoint(path, shard=(i, 2)).problems for i in range(2)]
    assert sorted(len(p) for p in problems) == [0, 1]


def test_fallback_to_newest_valid_reports_skipped(tmp_path):
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step)
    (tmp_path / "step_30" / "__0_0.distcp").write_bytes(b"x" * 3001)  # same size, other bytes
    (tmp_path / "step_20" / mf.MANIFEST_FILE).unlink()
    choice = mf.newest_valid(tmp_path)
    assert choice.path == tmp_path / "step_10"
    assert [v.step for v in choice.skipped] == [30, 20]
    assert "step_30: INVALID: file __0_0.distcp fails its SHA-256" in choice.describe_skipped()


def test_prune_keeps_the_newest(tmp_path):
    for step in (1, 2, 3, 4):
        fake_checkpoint(tmp_path, step)
    deleted = mf.prune(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step_1", "step_2"]
    assert [s for s, _ in mf.list_checkpoints(tmp_path)] == [3, 4]
    assert mf.prune(tmp_path, keep=0) == []


def test_commit_replaces_an_existing_step(tmp_path):
    fake_checkpoint(tmp_path, 5, payload=b"old" * 10)
    fake_checkpoint(tmp_path, 5, payload=b"new" * 10)
    assert (tmp_path / "step_5" / "__0_0.distcp").read_bytes().startswith(b"newnew")
    assert mf.verify_checkpoint(tmp_path / "step_5").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_5"]


def test_read_manifest_refuses_other_formats(tmp_path):
    (tmp_path / mf.MANIFEST_FILE).write_text(json.dumps({"format": "other", "files": {}}))
    with pytest.raises(CheckpointError, match="is not a fivefold-ckpt-manifest-v1 manifest"):
        mf.read_manifest(tmp_path)


def test_resolve_root_accepts_run_dir(tmp_path):
    (tmp_path / "ckpt").mkdir()
    assert mf.resolve_root(tmp_path) == tmp_path / "ckpt"
    assert mf.resolve_root(tmp_path / "ckpt") == tmp_path / "ckpt"
