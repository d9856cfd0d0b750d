"""Small tensors cost their bytes (issue 42, item 5). A rank's small-items file frames each
tensor in torch's legacy ``torch.save`` format (about 0.3 KiB around its bytes) instead of a
``torch.save`` zip (about 1.5 KiB), and each non-tensor item likewise (0.15 KiB instead of
1.2 KiB); a rank's small frozen tensors are one packed shared object, written once and
referenced by later generations while their proofs hold (``save/reuse.py``). Measured on two
tiny PEFT LoRAs of a transformers Llama as the growth of the root between two consecutive
saves; plain ``dcp.load`` and the verified restore (its fast path) read the new items, and
items in the zip framing still restore."""

from __future__ import annotations

import copy
import io
import json
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
from dist_ckpt.format.manifest import DCP_OBJECT_PREFIX, MANIFEST_NAME, OBJECTS_DIR, is_object_path
from dist_ckpt.restore import onepass
from dist_ckpt.restore.records import parse_tensor_record
from dist_ckpt.save import legacy_framing, shardio
from tests.helpers.local_jobs import load_with_plain_dcp

GENERATIONS = ("gen-000000000001", "gen-000000000002", "gen-000000000003")
VOCAB = 64
# the legacy framing's bytes around a tensor: the magic number, protocol version and system
# information pickles, the tensor's pickle, its storage key and element count (a tensor of
# up to 2 dimensions; measured 303 to 316 bytes)
LEGACY_HEADER_MAX = 320
ZIP_FRAMING_MIN = 1500  # a torch.save zip around a tensor of this model: 1577 to 1617 bytes


# (a) the hidden-32 Llama of the real-model tier's tests, LoRA r=4 on q/v: its tensors are a
# few KiB, so the per-save files (.metadata, the RNG state) outweigh its trainable bytes;
# (b) a representative tiny LoRA fine-tune: hidden 128, LoRA r=16 on every linear layer
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "r": 4, "targets": ("q_proj", "v_proj")}
FINETUNE = {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "r": 16,
            "targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
GROWTH_TARGET = 1.15  # issue 42: at most 1.15 x the trainable bytes per save, on model (b)


def lora_state(seed: int = 0, spec: dict[str, Any] = TINY) -> TrainState:
    import peft
    import transformers

    torch.manual_seed(seed)
    sizes = {k: v for k, v in spec.items() if k not in ("r", "targets")}
    config = transformers.LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=True, **sizes)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=spec["r"], target_modules=list(spec["targets"])))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return TrainState(model, optimizer, contract={"job": "tiny-lora"})


def root_bytes(root: str) -> int:
    return sum(files_of(root).values())


def trainable_bytes(state: TrainState) -> int:
    """What must change per save: the trainable parameters and their optimizer state."""
    params = sum(p.numel() * p.element_size() for p in state.model.parameters() if p.requires_grad)
    moments = sum(v.numel() * v.element_size() for s in state.optimizer.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor))
    return params + moments


def train_step(state: TrainState, generator: torch.Generator) -> None:
    ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
    state.model(input_ids=ids, labels=ids).loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)


def run_job(root: str, spec: dict[str, Any] = TINY, before_last: Any = None) -> dict[str, Any]:
    """Three consecutive saves, one update apart; the root's files after each.
    ``before_last(state)`` runs before the last save."""
    state = lora_state(spec=spec)
    generator = torch.Generator().manual_seed(1)
    files = []
    with CheckpointManager(CheckpointConfig(root=root, async_save=False), state) as mgr:
        for update in range(1, len(GENERATIONS) + 1):
            train_step(state, generator)
            if update == len(GENERATIONS) and before_last is not None:
                before_last(state)
            mgr.save(update)
            files.append(files_of(root))
    return {"root": root, "files": files, "sizes": [sum(f.values()) for f in files],
            "trainable": trainable_bytes(state),
            "model": {k: v.clone() for k, v in state.model.state_dict().items()},
            "optimizer": copy.deepcopy(state.optimizer.state_dict())}


def files_of(root: str) -> dict[str, int]:
    return {os.path.relpath(os.path.join(base, name), root): os.path.getsize(os.path.join(base, name))
            for base, _, names in os.walk(root) for name in names}


def growth_by_file(job: dict[str, Any]) -> dict[str, int]:
    """What the last save added to the root, per file."""
    before, after = job["files"][-2], job["files"][-1]
    return {path: size - before.get(path, 0) for path, size in after.items() if size != before.get(path, 0)}


def with_zip_framing(root: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The job with every item framed as DCP frames it (a torch.save zip), as before the change."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shardio.SmallItemsApartWriter, "_legacy_framing", lambda self: False)
        return run_job(root, spec)


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Model (a) twice: small items in the legacy framing, and (as every item was before) in
    torch.save zips."""
    base = tmp_path_factory.mktemp("small-tensors")
    return {"legacy": run_job(str(base / "legacy")), "zip": with_zip_framing(str(base / "zip"), TINY)}


@pytest.fixture(scope="module")
def finetune(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Model (b), in both framings."""
    base = tmp_path_factory.mktemp("finetune")
    return {"legacy": run_job(str(base / "legacy"), FINETUNE),
            "zip": with_zip_framing(str(base / "zip"), FINETUNE)}


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


def in_objects(info: _StorageInfo) -> bool:
    return info.relative_path.startswith(DCP_OBJECT_PREFIX)


def test_the_root_grows_by_what_a_save_writes(roots, record_property) -> None:
    """The growth of the root between two consecutive saves, accounted for: the trained
    tensors' bytes, a header each, the non-tensor items, and the per-save files (.metadata,
    state, manifest). The frozen base (every tensor under 64 KiB here) is one packed shared
    object per rank, written by the first save and referenced since."""
    growth = {kind: job["sizes"][2] - job["sizes"][1] for kind, job in roots.items()}
    legacy = roots["legacy"]
    root, generation = legacy["root"], GENERATIONS[-1]
    found = list(items(root, generation))
    own = [meta for _, meta, info, _ in found
           if isinstance(meta, TensorStorageMetadata) and not in_objects(info)]
    base = {fqn for fqn, meta, info, _ in found if in_objects(info)}
    assert base == {f"model.{k}" for k in legacy["model"] if "lora_" not in k} and len(base) == 21
    assert len(own) == 32  # 8 adapters, 8 x 3 AdamW tensors
    byte_items = [info.length for _, meta, info, _ in found if isinstance(meta, BytesStorageMetadata)]
    folder = os.path.join(root, generation)
    per_save = root_bytes(folder) - sum(os.path.getsize(os.path.join(folder, "dcp", name))
                                        for name in os.listdir(os.path.join(folder, "dcp"))
                                        if name.endswith(".distcp"))
    written = sum(tensor_nbytes(meta) for meta in own)
    # nothing else grows (no object is new), and the small-items file packs its items with no
    # padding between them
    for kind, job in roots.items():
        assert set(growth_by_file(job)) == {os.path.relpath(p, job["root"]) for p in files_of_folder(
            os.path.join(job["root"], generation))}, kind
    assert growth["legacy"] == root_bytes(folder)
    assert growth["legacy"] <= written + LEGACY_HEADER_MAX * len(own) + sum(byte_items) + per_save
    # each of the 32 tensor items saves at least (1500 - 320) bytes against the zip framing,
    # each non-tensor item at least 1000
    assert growth["zip"] - growth["legacy"] >= (ZIP_FRAMING_MIN - LEGACY_HEADER_MAX) * len(own) \
        + 1000 * len(byte_items)
    record_growth(record_property, roots, growth)
    record_property("tensor_bytes_written", written)
    record_property("per_save_files_bytes", per_save)


def files_of_folder(folder: str) -> list[str]:
    return [os.path.join(base, name) for base, _, names in os.walk(folder) for name in names]


def record_growth(record_property: Any, jobs: dict[str, dict[str, Any]], growth: dict[str, int]) -> None:
    trainable = jobs["legacy"]["trainable"]
    for kind in growth:
        record_property(f"growth_{kind}_bytes", growth[kind])
        record_property(f"growth_{kind}_per_trainable_byte", round(growth[kind] / trainable, 3))
        record_property(f"growth_{kind}_by_file", growth_by_file(jobs[kind]))
    record_property("trainable_bytes", trainable)


def test_a_lora_fine_tune_grows_by_at_most_1_15_its_trainable_bytes(finetune, record_property) -> None:
    """Issue 42's target on model (b): per save, the root grows by at most 1.15 x the trainable
    bytes (adapters and their AdamW state). The frozen base is shared objects (its weights
    over 64 KiB one each, the rest one pack per rank), referenced by every later generation."""
    growth = {kind: job["sizes"][2] - job["sizes"][1] for kind, job in finetune.items()}
    trainable = finetune["legacy"]["trainable"]
    assert trainable == 1_130_608  # 28 adapter tensors (r=16) and their AdamW moments
    assert growth["legacy"] <= GROWTH_TARGET * trainable, growth["legacy"] / trainable
    assert growth["legacy"] < growth["zip"]
    root = finetune["legacy"]["root"]
    # the same objects, written by the first save, referenced by the last one
    objects = [{p for p in job if p.startswith(OBJECTS_DIR + "/")} for job in finetune["legacy"]["files"]]
    listed = {f["path"] for f in manifest_of(root, GENERATIONS[-1])["files"] if is_object_path(f["path"])}
    assert objects[0] == objects[2] == listed and len(listed) == 7  # 6 MLP weights over 64 KiB, 1 pack
    record_growth(record_property, finetune, growth)


def manifest_of(root: str, generation: str) -> dict[str, Any]:
    with open(os.path.join(root, generation, MANIFEST_NAME), encoding="utf-8") as handle:
        return json.load(handle)


def test_a_changed_small_frozen_tensor_is_written_again_the_rest_referenced(tmp_path) -> None:
    """A pack is referenced item by item: one of its tensors changed in place (its version
    counter moved) is written again, in a new pack; the others still come from the first
    pack, which the new generation lists too. Restore and plain dcp.load read both."""
    target = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"

    def change(state: TrainState) -> None:
        with torch.no_grad():
            state.model.get_parameter(target).add_(1.0)

    job = run_job(str(tmp_path / "root"), TINY, before_last=change)
    root = job["root"]
    first, last = (manifest_of(root, generation) for generation in (GENERATIONS[1], GENERATIONS[-1]))
    packs = [{f["path"] for f in m["files"] if is_object_path(f["path"])} for m in (first, last)]
    assert len(packs[0]) == 1 and packs[0] < packs[1] and len(packs[1]) == 2
    new_pack = (packs[1] - packs[0]).pop()
    in_new = {fqn for fqn, _, info, _ in items(root, GENERATIONS[-1])
              if in_objects(info) and info.relative_path.endswith(os.path.basename(new_pack))}
    assert in_new == {f"model.{target}"}
    fresh = lora_state(seed=5)
    load_with_plain_dcp(os.path.join(root, GENERATIONS[-1], "dcp"), fresh)
    assert_restored(fresh, job)
    fresh = lora_state(seed=6)
    with CheckpointManager(CheckpointConfig(root=root), fresh) as mgr:
        assert mgr.restore().generation == GENERATIONS[-1]
    assert_restored(fresh, job)


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


@pytest.mark.parametrize("dtype", sorted(legacy_framing.LEGACY_DTYPES, key=str))
def test_the_framing_is_torchs_legacy_save(dtype: torch.dtype) -> None:
    """Header and bytes are what ``torch.save(..., _use_new_zipfile_serialization=False)``
    writes, but for the storage key (an address there, "0" here); torch.load and the restore's
    parser read it."""
    for shape in [(), (0,), (3, 5), (2, 0, 3)]:
        tensor = (torch.rand(shape) * 10).to(dtype)
        theirs = io.BytesIO()
        torch.save(tensor, theirs, _use_new_zipfile_serialization=False)
        mine = legacy_framing.legacy_header(dtype, tuple(tensor.size()), tuple(tensor.stride())) \
            + tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert mine == without_key(theirs.getvalue(), str(tensor.untyped_storage()._cdata)), shape
        assert torch.equal(torch.load(io.BytesIO(mine), weights_only=True), tensor), shape
        record = parse_tensor_record(memoryview(mine))
        assert record is not None and (record.dtype, record.size) == (dtype, tuple(shape))
        assert mine[record.data_offset:] == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_other_tensors_keep_the_zip_framing(tmp_path) -> None:
    """Beside a tensor file (a 96 KiB buffer), the small-items file is written on a thread of
    its own: a dtype without a legacy storage class (uint16) stays a torch.save zip there, with
    no CRC32 (``without_zip_crc32`` reaches the thread), and every item loads back with plain
    dcp.load and restore."""
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
    # the uint16 zip is framed on that thread without CRC32; the non-tensor items (the
    # optimizer's param groups) are in the legacy framing too
    codes = next(raw for fqn, _, _, raw in found if fqn == "model.codes")
    assert all(record.CRC == 0 for record in zipfile.ZipFile(io.BytesIO(codes)).infolist())
    objects = [raw for _, meta, _, raw in found if isinstance(meta, BytesStorageMetadata)]
    assert objects and all(raw.startswith(b"\x80\x02") and len(raw) < 400 for raw in objects)
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
