"""``dist-ckpt diff`` and ``dist_ckpt.diff`` over real generations written by 2-rank FSDP jobs."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from dist_ckpt.cli.app import main as dist_ckpt_main
from dist_ckpt.diff import COMPONENTS, compare_tensors, diff
from dist_ckpt.restart.state import ALL_COMPONENTS
from dist_ckpt.testing import run_ranks
from tests.helpers.workers import BATCH, build, manager, train_step

GEN3, GEN4 = "gen-000000000003", "gen-000000000004"
ROOTS = ("full", "no_rng", "extra_batch")


def _fresh_and_save(rank: int, world: int, root: str) -> None:
    job = build("fsdp", rank, world)
    mgr = manager(job, root)
    for _ in range(3):
        train_step(job)
    mgr.save(3, tokens_seen=3 * BATCH * world)
    mgr.close()


def _resume_one_step(rank: int, world: int, root: str, variant: str) -> None:
    job = build("fsdp", rank, world)
    mgr = manager(job, root)
    skip = {"rng"} if variant == "no_rng" else set()
    mgr.restore(components=[c for c in ALL_COMPONENTS if c not in skip])
    if variant == "extra_batch":
        job.sampler.next_batch()  # a batch drawn and never trained on: only the data position moves
    train_step(job)
    mgr.save(4, tokens_seen=4 * BATCH * world)
    mgr.close()


def scenario(rank: int, world: int, base: str) -> None:
    """Per root: three identical fresh updates and a save (gen 3, from independent runs), then a
    restore, one update and a save (gen 4) that differ only as the root's name says."""
    for name in ROOTS:
        _fresh_and_save(rank, world, os.path.join(base, name))
    for name in ROOTS:
        _resume_one_step(rank, world, os.path.join(base, name), name)


def one_rank(rank: int, world: int, root: str) -> None:
    _fresh_and_save(rank, world, root)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("diff")
    run_ranks(2, scenario, str(path))
    run_ranks(1, one_rank, str(path / "world1"))
    return path


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = dist_ckpt_main(["diff", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.processes
def test_identical_runs_exit_0(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, str(base / "full" / GEN3), str(base / "no_rng" / GEN3))
    assert code == 0, out
    assert "identical" in out.splitlines()[2]
    report = diff(str(base / "full" / GEN3), str(base / "extra_batch" / GEN3))
    assert report.identical
    assert report.compared["model"] == 7 and report.compared["optimizer"] > 7
    assert report.compared["rng"] == 2 * 4  # 2 ranks x python, numpy global, noise, torch cpu


def test_missing_rng_restore_named_first(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = diff(str(base / "full"), str(base / "no_rng"))  # ROOT: its newest committed (gen 4)
    assert report.a.endswith(GEN4)
    assert report.first is not None and report.first.component == "rng"
    for component in ("contract", "counters", "data", "scheduler"):
        assert not report.differing(component), component
    assert report.differing("model"), "other dropout masks must change the weights"
    weights = [d for d in report.differing("model") if d.key == "model.inp.weight"]
    assert weights and weights[0].max_abs and weights[0].max_abs > 0 and 0 < weights[0].max_rel <= 2
    code, out, _ = run_cli(capsys, str(base / "full"), str(base / "no_rng"))
    assert code == 1
    assert out.splitlines()[2].startswith("first difference: rng (rank 0: python)")


def test_data_position_named_first(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--json", str(base / "full"), str(base / "extra_batch"))
    assert code == 1
    record = json.loads(out)
    assert record["identical"] is False
    assert record["first_difference"]["component"] == "data"
    assert record["first_difference"]["key"] == "cursor"
    assert record["first_difference"]["a"] + 2 * BATCH == record["first_difference"]["b"]
    assert record["components"]["rng"] == {"compared": 8, "differing": 0}
    assert record["components"]["model"]["differing"] > 0
    assert list(record["components"]) == list(COMPONENTS)


def test_different_world_sizes(base: Path) -> None:
    report = diff(str(base / "world1"), str(base / "full" / GEN3))
    assert report.world_sizes == (1, 2)
    assert report.extra_ranks == {"a": [], "b": [1]}
    assert report.compared["rng"] == 4  # rank 0 only
    assert report.first is not None and report.first.component == "counters"  # tokens_seen
    assert report.compared["model"] == 7  # resharded tensors load by key


def test_usage_errors_exit_2(base: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = str(base / "full")
    assert run_cli(capsys, good, str(tmp_path / "nope"))[0] == 2
    code, _, err = run_cli(capsys, good, str(base / "full" / "gen-000000000099"))
    assert code == 2 and "no generation" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, str(tmp_path / "empty"), good)
    assert code == 2 and "no committed generation" in err
    assert run_cli(capsys, good)[0] == 2  # B missing: argparse


@pytest.mark.parametrize("path", ["state/rank-00001.json", "dcp/.metadata", "dcp/__1_0.distcp"])
def test_tampered_file_refused(base: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path,
                               path: str) -> None:
    copy = tmp_path / GEN3
    shutil.copytree(base / "full" / GEN3, copy)
    target = copy / path
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size: only the digest can tell
    target.write_bytes(bytes(raw))
    code, _, err = run_cli(capsys, str(base / "full" / GEN3), str(copy))
    assert code == 1 and path in err, err


def test_compare_tensors_bitwise_and_magnitudes() -> None:
    a = torch.tensor([1.0, -2.0, 0.0, 4.0])
    assert compare_tensors("model", "w", a, a.clone()) is None
    assert compare_tensors("model", "w", torch.tensor([0.0]), torch.tensor([-0.0])) is not None
    nan = torch.tensor([float("nan")])
    assert compare_tensors("model", "w", nan, nan.clone()) is None  # same bits
    found = compare_tensors("model", "w", a, torch.tensor([1.0, -2.5, 0.0, 4.0]))
    assert found is not None and found.max_abs == pytest.approx(0.5) and found.max_rel == pytest.approx(0.2)
    shape = compare_tensors("model", "w", a, a.reshape(2, 2))
    assert shape is not None and shape.note == "dtype or shape differs"


def test_wired_into_dist_ckpt_cli(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dist_ckpt import cli

    assert cli.main(["diff", str(base / "full"), str(base / "extra_batch")]) == 1
    assert "first difference: data (cursor)" in capsys.readouterr().out


def _upload(local_gen: Path, backend: object, name: str) -> None:
    for path in sorted(p for p in local_gen.rglob("*") if p.is_file()):
        backend.put_bytes(f"{name}/{path.relative_to(local_gen).as_posix()}", path.read_bytes())  # type: ignore[attr-defined]


def test_object_store_against_local(base: Path, s3_root: str, capsys: pytest.CaptureFixture[str]) -> None:
    from dist_ckpt.storage.base import open_store

    backend = open_store(s3_root)
    _upload(base / "extra_batch" / GEN4, backend, GEN4)
    report = diff(str(base / "full"), s3_root)  # through the verified object reader
    assert report.first is not None and report.first.component == "data"
    assert report.compared["model"] == 7 and report.differing("model")
    shard = f"{GEN4}/dcp/__0_0.distcp"
    raw = bytearray(backend.read_bytes(shard))
    raw[len(raw) // 2] ^= 0xFF
    backend.put_bytes(shard, bytes(raw))
    code, _, err = run_cli(capsys, str(base / "full"), f"{s3_root}/{GEN4}")
    assert code == 1 and "dcp/__0_0.distcp" in err, err


@pytest.mark.processes
def test_short_generation_names_in_a_path(base: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40 item 11: ROOT/gen-3 names gen-000000000003, as GEN does everywhere else."""
    code, out, err = run_cli(capsys, str(base / "full" / "gen-3"), str(base / "no_rng" / "gen-3"))
    assert code == 0, out + err
    assert GEN3 in out and "identical" in out.splitlines()[2]
    assert diff(str(base / "full" / "gen-3"), str(base / "full" / GEN3)).identical
