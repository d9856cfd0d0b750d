"""The one-pass reader's fast path: plain tensor items are copied once, straight from the
verified mapping into the tensors they load into; anything else goes through torch's
``read_data``; a shard that fails anywhere still stops the load before any item is read."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from dist_ckpt import CheckpointConfig, CheckpointManager
from dist_ckpt.format.manifest import MANIFEST_NAME
from dist_ckpt.restore import onepass
from dist_ckpt.restore.records import copy_pair, narrowed, parse_tensor_record
from dist_ckpt.save import shardio
from dist_ckpt.testing import run_ranks
from tests.helpers import workers
from tests.helpers.local_jobs import make_state, two_generations
from tests.helpers.workers import check_restart

GEN1, GEN2 = "gen-000000000001", "gen-000000000002"


def count_reads(monkeypatch: Any) -> list[dict[str, Any]]:
    """Each one-pass reader's counters and generation, recorded when it closes; and every
    generation whose items were read (``_load_items``: after every rank's verdict)."""
    seen: list[dict[str, Any]] = []
    close, load = onepass.OnePassReader.close, onepass.OnePassReader._load_items

    def spy_close(self: onepass.OnePassReader) -> None:
        seen.append({"generation": self.generation, "fast": self.fast_items,
                     "fallback": self.fallback_items, "hashed": self.hashed_bytes,
                     "loaded": getattr(self, "_loaded", False)})
        close(self)

    def spy_load(self: onepass.OnePassReader, plan: Any, planner: Any) -> Any:
        self._loaded = True  # type: ignore[attr-defined]
        return load(self, plan, planner)

    monkeypatch.setattr(onepass.OnePassReader, "close", spy_close)
    monkeypatch.setattr(onepass.OnePassReader, "_load_items", spy_load)
    return seen


def item_counts(root: str, generation: str) -> tuple[int, int]:
    """(tensor chunks, byte items) DCP saved in ``generation`` (one process: one item each)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(os.path.join(root, generation, "dcp")).read_metadata()
    tensors = sum(len(m.chunks) for m in metadata.state_dict_metadata.values()
                  if isinstance(m, TensorStorageMetadata))
    return tensors, sum(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values())


def test_fast_path_restores_model_and_optimizer_bitwise(tmp_path, monkeypatch) -> None:
    root = str(tmp_path)
    saved = two_generations(root)
    seen = count_reads(monkeypatch)
    state = make_state()
    with torch.no_grad():
        for param in state.model.parameters():
            param.zero_()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        assert mgr.restore().generation == GEN2
    tensors, byte_items = item_counts(root, GEN2)
    assert [(s["fast"], s["fallback"]) for s in seen] == [(tensors, byte_items)]
    for name, value in saved.model.state_dict().items():
        assert torch.equal(state.model.state_dict()[name], value), name
    mine, theirs = state.optimizer.state_dict(), saved.optimizer.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for key, moments in theirs["state"].items():
        for field, value in moments.items():
            assert torch.equal(mine["state"][key][field], value), (key, field)


def test_unrecognised_items_fall_back_to_torch(tmp_path, monkeypatch) -> None:
    """An item the record parser does not know loads through torch.load, bit for bit."""
    root = str(tmp_path)
    saved = two_generations(root)
    seen = count_reads(monkeypatch)
    monkeypatch.setattr(onepass, "parse_tensor_record", lambda item: None)
    state = make_state()
    with CheckpointManager(CheckpointConfig(root=root), state) as mgr:
        assert mgr.restore().generation == GEN2
    tensors, byte_items = item_counts(root, GEN2)
    assert [(s["fast"], s["fallback"]) for s in seen] == [(0, tensors + byte_items)]
    for name, value in saved.model.state_dict().items():
        assert torch.equal(state.model.state_dict()[name], value), name


class _NoPlanner:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the planner was asked for {name}")


def test_transformed_and_byte_items_are_left_to_torch() -> None:
    """Nothing is resolved or written for an item the fast path does not take."""
    reader = onepass.OnePassReader.__new__(onepass.OnePassReader)
    index = MetadataIndex("w", (0,), 0)
    reader.storage_data = {index: _StorageInfo("f.distcp", 0, 8, ["zstd"])}
    reader.mapped = {"f.distcp": memoryview(bytes(8))}
    tensor = ReadItem(LoadItemType.TENSOR, index, torch.Size([0]), index, torch.Size([0]), torch.Size([2]))
    assert not reader._copy_item(tensor, _NoPlanner())  # type: ignore[arg-type]
    reader.storage_data[index] = _StorageInfo("f.distcp", 0, 8)
    as_bytes = ReadItem(LoadItemType.BYTE_IO, index, torch.Size([0]), index, torch.Size([0]), torch.Size([0]))
    assert not reader._copy_item(as_bytes, _NoPlanner())  # type: ignore[arg-type]
    assert not reader._copy_item(tensor, _NoPlanner())  # type: ignore[arg-type]  # not a zip


def saved_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_the_record_parser_returns_none_for_unusual_archives() -> None:
    plain = saved_bytes(torch.arange(6, dtype=torch.float32))
    assert parse_tensor_record(memoryview(plain)) is not None
    assert parse_tensor_record(memoryview(saved_bytes(torch.randn(3, dtype=torch.complex64).conj()))) is None
    assert parse_tensor_record(memoryview(saved_bytes(torch.nn.Parameter(torch.ones(2))))) is None
    assert parse_tensor_record(memoryview(saved_bytes({"a": torch.ones(2)}))) is None
    assert parse_tensor_record(memoryview(plain.replace(b"little", b"bigend", 1))) is None
    assert parse_tensor_record(memoryview(plain[:-30])) is None  # truncated: no central directory
    with zipfile.ZipFile(io.BytesIO(plain)) as source:
        deflated = io.BytesIO()
        with zipfile.ZipFile(deflated, "w", compression=zipfile.ZIP_DEFLATED) as target:
            for info in source.infolist():
                target.writestr(info.filename, source.read(info.filename))
    assert parse_tensor_record(memoryview(deflated.getvalue())) is None


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shift", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_copy_pair_matches_torch_load(transposed: bool, shift: int, dtype: torch.dtype) -> None:
    """Every branch (byte copy, aligned typed view, misaligned strided copy, dtype change)
    writes what torch.load + narrow + copy_ writes; ``shift`` misaligns the item."""
    saved = (torch.arange(48) % 7).to(dtype).reshape(6, 8)[1:]  # a view into a larger storage
    saved = saved.t() if transposed else saved
    mapping = memoryview(bytearray(b"\0" * shift + saved_bytes(saved)))
    record = parse_tensor_record(mapping[shift:])
    assert record is not None
    rows, cols = saved.shape
    for offsets, lengths, target_dtype in [((0, 0), (rows, cols), dtype), ((1, 0), (2, cols), dtype),
                                           ((1, 2), (2, 3), dtype), ((0, 0), (rows, cols), torch.float64)]:
        part = narrowed(record, offsets, lengths)
        assert part is not None
        expected = saved[offsets[0]:offsets[0] + lengths[0], offsets[1]:offsets[1] + lengths[1]]
        for target in (torch.zeros(lengths, dtype=target_dtype),
                       torch.zeros(lengths[1], lengths[0], dtype=target_dtype).t()):
            destination, source = copy_pair(mapping, shift + record.data_offset, record, part, target)
            destination.copy_(source)
            assert torch.equal(target, expected.to(target_dtype)), (offsets, lengths, target.stride())


def test_a_request_outside_the_stored_bytes_is_not_served() -> None:
    record = parse_tensor_record(memoryview(saved_bytes(torch.ones(4, 4))))
    assert record is not None
    assert narrowed(record, (2, 0), (3, 4)) is None  # rows 2..4 of 4
    oversized = dataclasses.replace(record, size=(5, 4))  # a layout past the stored bytes
    assert narrowed(oversized, (0, 0), (5, 4)) is None
    assert narrowed(dataclasses.replace(record, storage_offset=1), (0, 0), (4, 4)) is None


# ---- multi-rank -------------------------------------------------------------------------
def load_counting(rank: int, world: int, kind: str, root: str) -> dict:
    seen = count_reads(pytest.MonkeyPatch())
    out = workers.load_resharded(rank, world, kind, root)
    out["reads"] = seen
    return out


@pytest.mark.processes
def test_resharded_loads_take_the_fast_path_bitwise(tmp_path) -> None:
    root = str(tmp_path / "run")
    saved = run_ranks(2, workers.save_for_reshard, "fsdp", root, 4)
    for new_world in (3, 1):
        loaded = run_ranks(new_world, load_counting, "fsdp", root)
        check_restart(saved[0], loaded, old_world=2, steps=4)
        for result in loaded:
            assert [r["fast"] > 0 for r in result["reads"]] == [True], result["reads"]


def save_two(rank: int, world: int, root: str) -> None:
    job = workers.build("fsdp", rank, world)
    mgr = workers.manager(job, root)
    for update in (1, 2):
        workers.train_step(job)
        mgr.save(update)
    mgr.close()


def restore_counting(rank: int, world: int, root: str) -> dict:
    seen = count_reads(pytest.MonkeyPatch())
    job = workers.build("fsdp", rank, world, seed=5)
    mgr = workers.manager(job, root)
    result = mgr.restore()
    mgr.close()
    return {"generation": result.generation, "rejected": [p.generation for p in result.rejected],
            "reads": seen}


@pytest.mark.processes
def test_a_shard_failing_on_one_rank_stops_every_rank_before_any_item_is_read(tmp_path) -> None:
    root = str(tmp_path / "run")
    run_ranks(2, save_two, root)
    shard = os.path.join(root, GEN2, "dcp", "__1_0.distcp")
    with open(shard, "r+b") as handle:
        handle.seek(os.path.getsize(shard) // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    results = run_ranks(2, restore_counting, root)
    for result in results:  # every rank hashed its files; no rank read an item of generation 2
        assert result["generation"] == GEN1 and result["rejected"] == [GEN2]
        assert [(r["generation"], r["loaded"]) for r in result["reads"]] == [(GEN2, False), (GEN1, True)]


def warm_restore_of_damaged_generations(rank: int, world: int, root: str) -> dict:
    """A trained job restores from a root whose every generation fails on rank 1: the
    optimizer state was copied early (into scratch tensors), yet nothing the job holds moved."""
    from dist_ckpt.errors import NoValidGeneration

    job = workers.build("fsdp", rank, world, seed=5)
    workers.train_step(job)  # warm: the optimizer holds state the restore must not touch
    before = workers.full_state(job)
    early: list[int] = []
    close = onepass.OnePassReader.close

    def spy(self: onepass.OnePassReader) -> None:
        early.append(len(self._early))
        close(self)

    patch = pytest.MonkeyPatch()
    patch.setattr(onepass.OnePassReader, "close", spy)
    mgr = workers.manager(job, root)
    try:
        with pytest.raises(NoValidGeneration):
            mgr.restore()
    finally:
        mgr.close()
        patch.undo()
    after = workers.full_state(job)
    same = None if before is None or after is None else \
        before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return {"early": early, "same": same}


@pytest.mark.processes
def test_early_copies_never_touch_a_warm_jobs_state_when_the_verdict_fails(tmp_path) -> None:
    root = str(tmp_path / "run")
    run_ranks(2, save_two, root)
    for generation in (GEN1, GEN2):
        shard = os.path.join(root, generation, "dcp", "__1_0.distcp")
        with open(shard, "r+b") as handle:
            handle.seek(os.path.getsize(shard) - 64)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0x10]))
    results = run_ranks(2, warm_restore_of_damaged_generations, root)
    assert results[0]["same"] is True  # rank 0 gathers the full state: bitwise unchanged
    # the early copies ran on the rank whose files were good (the verdict failed elsewhere)
    assert any(sum(r["early"]) > 0 for r in results), results


def save_with_small_bound(rank: int, world: int, root: str) -> None:
    shardio.SMALL_ITEM_BYTES = 1024  # this model's tensors are small: keep a tensor file too
    save_two(rank, world, root)


@pytest.mark.processes
def test_no_rank_hashes_another_ranks_tensor_file(tmp_path) -> None:
    """FSDP saves each replicated step count once, in one rank's file; the other rank reads it
    from that rank's small-items file, so a verified restore hashes its own shard and small
    files only (with one file per rank it hashed the other rank's whole shard too)."""
    root = str(tmp_path / "run")
    run_ranks(2, save_with_small_bound, root)
    manifest = json.load(open(os.path.join(root, GEN2, MANIFEST_NAME)))
    shards = {f["path"]: (f["rank"], f["size"]) for f in manifest["files"] if f["path"].endswith(".distcp")}
    tensor_files = {rank: size for path, (rank, size) in shards.items() if path.endswith("_0.distcp")}
    assert sorted(tensor_files) == [0, 1], shards
    assert any(path.endswith("_1.distcp") for path in shards), shards  # a small-items file
    results = run_ranks(2, restore_counting, root)
    for rank, result in enumerate(results):
        assert result["generation"] == GEN2
        (read,) = result["reads"]
        own = sum(size for r, size in shards.values() if r == rank)
        others_small = sum(size for path, (r, size) in shards.items()
                           if r != rank and not path.endswith("_0.distcp"))
        assert tensor_files[rank] <= read["hashed"] <= own + others_small, (rank, read, shards)
