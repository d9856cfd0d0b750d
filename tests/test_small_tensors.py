"""Small tensors cost their bytes (issue 42, item 5): a rank's small-items file frames each
tensor in torch's legacy ``torch.save`` format (about 0.3 KiB around its bytes) instead of a
``torch.save`` zip (about 1.5 KiB). Measured on a tiny PEFT LoRA of a transformers Llama as
the growth of the root between two consecutive saves; plain ``dcp.load`` and the verified
restore (its fast path) read the new items, and items in the zip framing still restore."""

from __future__ import annotations

import copy
import io
import os
import pickle
import struct
import zipfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.restore import onepass
from dist_ckpt.restore.records import parse_tensor_record
from dist_ckpt.save import shardio
from tests.helpers.local_jobs import load_with_plain_dcp

GENERATIONS = ("gen-000000000001", "gen-000000000002", "gen-000000000003")
VOCAB = 64
# the legacy framing's bytes around a tensor: the magic number, protocol version and system
# information pickles, the tensor's pickle, its storage key and element count (a tensor of
# up to 2 dimensions; measured 303 to 316 bytes)
LEGACY_HEADER_MAX = 320
ZIP_FRAMING_MIN = 1500  # a torch.save zip around a tensor of this model: 1577 to 1617 bytes


def lora_state(seed: int = 0) -> TrainState:
    import peft
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                      tie_word_embeddings=True)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return TrainState(model, optimizer, contract={"job": "tiny-lora"})


def root_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(base, name))
               for base, _, names in os.walk(root) for name in names)


def trainable_bytes(state: TrainState) -> int:
    """What must change per save: the trainable parameters and their optimizer state."""
    params = sum(p.numel() * p.element_size() for p in state.model.parameters() if p.requires_grad)
    moments = sum(v.numel() * v.element_size() for s in state.optimizer.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor))
    return params + moments


def run_job(root: str) -> dict[str, Any]:
    """Three consecutive saves, one update apart; the root's size after each."""
    state = lora_state()
    generator = torch.Generator().manual_seed(1)
    sizes = []
    with CheckpointManager(CheckpointConfig(root=root, async_save=False), state) as mgr:
        for update in range(1, len(GENERATIONS) + 1):
            ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
            state.model(input_ids=ids, labels=ids).loss.backward()
            state.optimizer.step()
            state.optimizer.zero_grad(set_to_none=True)
            mgr.save(update)
            sizes.append(root_bytes(root))
    return {"root": root, "sizes": sizes, "trainable": trainable_bytes(state),
            "model": {k: v.clone() for k, v in state.model.state_dict().items()},
            "optimizer": copy.deepcopy(state.optimizer.state_dict())}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The same job twice: small tensors in the legacy framing, and (as every item was
    before) in torch.save zips."""
    base = tmp_path_factory.mktemp("small-tensors")
    legacy = run_job(str(base / "legacy"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shardio.SmallItemsApartWriter, "_legacy_framing", lambda self: False)
        zipped = run_job(str(base / "zip"))
    return {"legacy": legacy, "zip": zipped}


def metadata_of(root: str, generation: str) -> Metadata:
    with open(os.path.join(root, generation, "dcp", ".metadata"), "rb") as handle:
        return pickle.load(handle)


def items(root: str, generation: str) -> Iterator[tuple[str, Any, _StorageInfo, bytes]]:
    """(fqn, its metadata, its storage info, its stored bytes) of every DCP item."""
    metadata = metadata_of(root, generation)
    for index, info in metadata.storage_data.items():
        with open(os.path.join(root, generation, "dcp", info.relative_path), "rb") as handle:
            handle.seek(info.offset)
            yield index.fqn, metadata.state_dict_metadata[index.fqn], info, handle.read(info.length)


def tensor_nbytes(meta: TensorStorageMetadata) -> int:
    return meta.size.numel() * meta.properties.dtype.itemsize


def test_a_small_tensor_costs_its_bytes_and_a_fixed_header(roots) -> None:
    """Every tensor of this model is a small item: legacy framing, header under 0.32 KiB
    (the zip framing of the same item: over 1.5 KiB)."""
    for kind, bound in (("legacy", lambda extra: extra <= LEGACY_HEADER_MAX),
                        ("zip", lambda extra: extra >= ZIP_FRAMING_MIN)):
        tensors = [(fqn, meta, raw) for fqn, meta, _, raw in items(roots[kind]["root"], GENERATIONS[-1])
                   if isinstance(meta, TensorStorageMetadata)]
        # 21 base (lm_head apart from the embedding it is tied to), 8 adapters, 8 x 3 AdamW tensors
        assert len(tensors) == 53
        for fqn, meta, raw in tensors:
            assert raw.startswith(b"\x80\x02" if kind == "legacy" else b"PK\x03\x04"), (kind, fqn)
            assert bound(len(raw) - tensor_nbytes(meta)), (kind, fqn, len(raw) - tensor_nbytes(meta))


def test_the_root_grows_by_what_a_save_writes(roots, record_property) -> None:
    """The growth of the root between two consecutive saves, accounted for: the tensors' bytes,
    a header each, the non-tensor items, and the per-save files (.metadata, state, manifest)."""
    growth = {kind: job["sizes"][2] - job["sizes"][1] for kind, job in roots.items()}
    legacy = roots["legacy"]
    root, generation = legacy["root"], GENERATIONS[-1]
    tensors = [meta for _, meta, _, _ in items(root, generation) if isinstance(meta, TensorStorageMetadata)]
    objects = [info.length for _, meta, info, _ in items(root, generation)
               if isinstance(meta, BytesStorageMetadata)]
    folder = os.path.join(root, generation)
    per_save = root_bytes(folder) - sum(os.path.getsize(os.path.join(folder, "dcp", name))
                                        for name in os.listdir(os.path.join(folder, "dcp"))
                                        if name.endswith(".distcp"))
    written = sum(tensor_nbytes(meta) for meta in tensors)
    # nothing else grows: the base is under the shared-object threshold (written in full), and
    # the small-items file packs its items with no padding between them
    assert growth["legacy"] == root_bytes(folder)
    assert growth["legacy"] <= written + LEGACY_HEADER_MAX * len(tensors) + sum(objects) + per_save
    # each of the 53 tensor items saves at least (1500 - 320) bytes against the zip framing
    assert growth["zip"] - growth["legacy"] >= (ZIP_FRAMING_MIN - LEGACY_HEADER_MAX) * len(tensors)
    for kind in growth:
        record_property(f"growth_{kind}_bytes", growth[kind])
        record_property(f"growth_{kind}_per_trainable_byte", round(growth[kind] / legacy["trainable"], 2))
    record_property("trainable_bytes", legacy["trainable"])
    record_property("tensor_bytes_written", written)
    record_property("per_save_files_bytes", per_save)


def assert_restored(state: TrainState, saved: dict[str, Any]) -> None:
    for name, value in saved["model"].items():
        assert torch.equal(state.model.state_dict()[name], value), name
    mine, theirs = state.optimizer.state_dict(), saved["optimizer"]
    assert mine["param_groups"] == theirs["param_groups"]
    for key, moments in theirs["state"].items():
        for field, value in moments.items():
            assert torch.equal(mine["state"][key][field], value), (key, field)


def test_plain_dcp_load_reads_the_legacy_framing(roots) -> None:
    fresh = lora_state(seed=5)
    load_with_plain_dcp(os.path.join(roots["legacy"]["root"], GENERATIONS[-1], "dcp"), fresh)
    assert_restored(fresh, roots["legacy"])


@pytest.mark.parametrize("kind", ["legacy", "zip"])
def test_restore_copies_either_framing_on_the_fast_path(roots, monkeypatch, kind: str) -> None:
    """The verified restore parses both framings itself (no torch.load per tensor); the zip
    framing is what every generation written before the change holds."""
    seen: list[tuple[int, int]] = []
    close = onepass.OnePassReader.close

    def spy_close(self: onepass.OnePassReader) -> None:
        seen.append((self.fast_items, self.fallback_items))
        close(self)

    monkeypatch.setattr(onepass.OnePassReader, "close", spy_close)
    fresh = lora_state(seed=5)
    with CheckpointManager(CheckpointConfig(root=roots[kind]["root"]), fresh) as mgr:
        assert mgr.restore().generation == GENERATIONS[-1]
    metadata = metadata_of(roots[kind]["root"], GENERATIONS[-1])
    byte_items = sum(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values())
    assert seen == [(53, byte_items)]
    assert_restored(fresh, roots[kind])


def without_key(raw: bytes, key: str) -> bytes:
    """``raw`` with its pickled storage key (a BINUNICODE string) replaced by ``"0"``."""
    def pickled(text: str) -> bytes:
        return b"X" + struct.pack("<I", len(text)) + text.encode()
    return raw.replace(pickled(key), pickled("0"))


@pytest.mark.parametrize("dtype", sorted(shardio.LEGACY_DTYPES, key=str))
def test_the_framing_is_torchs_legacy_save(dtype: torch.dtype) -> None:
    """Header and bytes are what ``torch.save(..., _use_new_zipfile_serialization=False)``
    writes, but for the storage key (an address there, "0" here); torch.load and the restore's
    parser read it."""
    for shape in [(), (0,), (3, 5), (2, 0, 3)]:
        tensor = (torch.rand(shape) * 10).to(dtype)
        theirs = io.BytesIO()
        torch.save(tensor, theirs, _use_new_zipfile_serialization=False)
        mine = shardio.legacy_header(dtype, tuple(tensor.size()), tuple(tensor.stride())) \
            + tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert mine == without_key(theirs.getvalue(), str(tensor.untyped_storage()._cdata)), shape
        assert torch.equal(torch.load(io.BytesIO(mine), weights_only=True), tensor), shape
        record = parse_tensor_record(memoryview(mine))
        assert record is not None and (record.dtype, record.size) == (dtype, tuple(shape))
        assert mine[record.data_offset:] == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_other_tensors_keep_the_zip_framing(tmp_path) -> None:
    """Beside a tensor file (a 96 KiB buffer), the small-items file is written on a thread of
    its own: a dtype without a legacy storage class (uint16) stays a torch.save zip there, the
    non-tensor items' zips are the caller's (no CRC32: ``without_zip_crc32`` reaches the
    thread), and every item loads back with plain dcp.load and restore."""
    def make() -> TrainState:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        model.register_buffer("codes", torch.arange(6, dtype=torch.int32).reshape(2, 3).to(torch.uint16))
        model.register_buffer("table", torch.zeros(24 << 10))
        return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))

    saved = make()
    with torch.no_grad():
        saved.model.weight.add_(1.0)
        saved.model.codes.copy_((saved.model.codes.to(torch.int32) + 7).to(torch.uint16))
        saved.model.table.normal_()
    root = str(tmp_path / "root")
    with CheckpointManager(CheckpointConfig(root=root), saved) as mgr:
        mgr.save(1)
    found = list(items(root, GENERATIONS[0]))
    framing = {fqn: raw[:2] for fqn, meta, _, raw in found if isinstance(meta, TensorStorageMetadata)}
    assert framing == {"model.weight": b"\x80\x02", "model.bias": b"\x80\x02", "model.codes": b"PK",
                       "model.table": b"PK"}
    small_file = {info.relative_path for fqn, _, info, _ in found if fqn != "model.table"}
    tensor_file = {info.relative_path for fqn, _, info, _ in found if fqn == "model.table"}
    assert len(small_file) == 1 and small_file != tensor_file
    objects = [raw for _, meta, _, raw in found if isinstance(meta, BytesStorageMetadata)]
    assert objects and all(record.CRC == 0 for raw in objects
                           for record in zipfile.ZipFile(io.BytesIO(raw)).infolist())
    for load in ("dcp", "restore"):
        fresh = make()
        if load == "dcp":
            load_with_plain_dcp(os.path.join(root, GENERATIONS[0], "dcp"), fresh)
        else:
            with CheckpointManager(CheckpointConfig(root=root), fresh) as mgr:
                mgr.restore()
        for name, value in saved.model.state_dict().items():  # bitwise: uint16 has no torch.equal
            found = fresh.model.state_dict()[name]
            assert found.dtype == value.dtype, (load, name)
            assert torch.equal(found.reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)), \
                (load, name)
