"""Shard files written past the page cache (``O_DIRECT``): every byte lands in order, a
filesystem that refuses the flag gets the same bytes buffered, real write errors keep their
cause, and a generation written this way loads with plain ``dcp.load``."""

from __future__ import annotations

import ctypes
import errno
import os

import pytest
import torch

from dist_ckpt import CheckpointConfig, CheckpointManager, TrainState
from dist_ckpt.storage import directio
from tests.helpers.local_jobs import assert_same_model, load_with_plain_dcp, two_generations

GEN1 = "gen-000000000001"
# sizes that cross the aligned buffer's edge, leave a partial block, and hit both copy paths
WRITE_SIZES = [1, 4095, 5, directio.CHUNK_BYTES + 3, (64 << 10) + 1, 7, directio.CHUNK_BYTES - 20, 12_345]


def accepts_o_direct(directory: str) -> bool:
    probe = os.path.join(directory, "probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        return False
    os.unlink(probe)
    return True


def assert_holds(path: str, payload: bytes) -> None:
    with open(path, "rb") as handle:
        assert handle.read() == payload


def write_pieces(path: str, *, direct: bool) -> tuple[bytes, bool]:
    """Writes a payload in odd pieces; the observer (what a digest's ``update`` is) must
    see exactly the payload, in order, across every piece and buffer edge."""
    payload = os.urandom(sum(WRITE_SIZES))
    observed = bytearray()
    with directio.durable_file(path, direct=direct) as sink:
        offset = 0
        for size in WRITE_SIZES:
            sink.write(memoryview(payload)[offset:offset + size], observed.extend)
            offset += size
    assert bytes(observed) == payload
    return payload, sink.direct


def test_direct_sink_writes_every_byte_in_order(tmp_path) -> None:
    path = str(tmp_path / "shard")
    payload, was_direct = write_pieces(path, direct=True)
    assert_holds(path, payload)
    assert was_direct == accepts_o_direct(str(tmp_path))  # ext4, xfs: True


def test_buffered_sink_when_direct_io_is_off(tmp_path) -> None:
    path = str(tmp_path / "shard")
    payload, was_direct = write_pieces(path, direct=False)
    assert not was_direct
    assert_holds(path, payload)


def refuse_o_direct_at_open(monkeypatch, code: int) -> None:
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(code, os.strerror(code))
        return real_open(path, flags, *args)

    monkeypatch.setattr(directio.os, "open", refusing_open)


def test_o_direct_refused_at_open_falls_back_to_buffered(tmp_path, monkeypatch) -> None:
    refuse_o_direct_at_open(monkeypatch, errno.EINVAL)
    path = str(tmp_path / "shard")
    payload, was_direct = write_pieces(path, direct=True)
    assert not was_direct
    assert_holds(path, payload)


def test_o_direct_refused_at_the_first_write_falls_back_to_buffered(tmp_path, monkeypatch) -> None:
    """As a FUSE passthrough does: the open takes the flag, the file below refuses each write
    through that descriptor (clearing the flag with fcntl would not reach it)."""
    real_open, real_write = os.open, os.write
    opened_direct: set[int] = set()
    refused: list[int] = []

    def recording_open(path, flags, *args):
        fd = real_open(path, flags, *args)
        opened_direct.discard(fd)
        if flags & os.O_DIRECT:
            opened_direct.add(fd)
        return fd

    def refusing_write(fd, data):
        if fd in opened_direct:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(directio.os, "open", recording_open)
    monkeypatch.setattr(directio.os, "write", refusing_write)
    path = str(tmp_path / "shard")
    payload, was_direct = write_pieces(path, direct=True)
    assert refused == [directio.CHUNK_BYTES]  # one refusal, then every byte buffered
    assert not was_direct
    assert_holds(path, payload)


def test_a_full_disk_during_a_direct_write_reports_enospc(tmp_path, monkeypatch) -> None:
    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio.os, "write", full_disk)
    sink = directio.open_sink(str(tmp_path / "shard"), direct=True)
    try:
        with pytest.raises(OSError) as caught:
            sink.write(memoryview(bytes(directio.CHUNK_BYTES)))
            sink.finish()
        assert caught.value.errno == errno.ENOSPC
    finally:
        sink.close()


def test_the_aligned_buffer_is_reused_across_files(tmp_path) -> None:
    if not accepts_o_direct(str(tmp_path)):
        pytest.fail("this machine's test directory must take O_DIRECT (ext4 or xfs)")
    buffers = []
    for index in range(2):
        sink = directio.open_sink(str(tmp_path / f"shard{index}"), direct=True)
        assert isinstance(sink, directio.DirectSink)
        buffers.append(sink._buffer)
        address = ctypes.addressof(ctypes.c_char.from_buffer(sink._buffer))
        assert address % directio.ALIGN == 0
        sink.close()
    assert buffers[0] is buffers[1]


def large_state() -> TrainState:  # 4.5 MB of weights, 13.5 MB with Adam: whole buffers
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1100)
    return TrainState(model, torch.optim.Adam(model.parameters()), contract={"config": "v1"})


def save_one(root: str, state: TrainState, **options) -> None:
    with CheckpointManager(CheckpointConfig(root=root, **options), state) as mgr:
        state.model(torch.randn(2, 1024)).sum().backward()
        state.optimizer.step()  # Adam's moments exist from here
        state.optimizer.zero_grad(set_to_none=True)
        mgr.save(1)


def test_a_local_generation_is_written_direct_and_loads_with_plain_dcp(tmp_path, monkeypatch) -> None:
    opened: list[tuple[str, bool]] = []
    real_open_sink = directio.open_sink

    def recording_open_sink(path: str, *, direct: bool) -> directio.Sink:
        sink = real_open_sink(path, direct=direct)
        opened.append((os.path.basename(path), sink.direct))
        return sink

    monkeypatch.setattr(directio, "open_sink", recording_open_sink)
    root = str(tmp_path / "root")
    saved = large_state()
    save_one(root, saved, direct_io=True)
    assert os.path.getsize(os.path.join(root, GEN1, "dcp", "__0_0.distcp")) > directio.CHUNK_BYTES
    assert opened and all(name.endswith(".distcp") for name, _ in opened)
    assert all(direct for _, direct in opened) == accepts_o_direct(str(tmp_path))
    fresh = large_state()
    load_with_plain_dcp(os.path.join(root, GEN1, "dcp"), fresh)
    assert_same_model(fresh, saved)

    opened.clear()
    two_generations(str(tmp_path / "buffered"), direct_io=False)
    assert opened and not any(direct for _, direct in opened)


def large_item_alignment(dcp_dir: str) -> tuple[list, list[bool]]:
    """Every item of a generation's DCP files in file order, and for each tensor item of more
    than 64 KiB (the small ones are packed) whether its bytes start at an aligned offset."""
    from torch.distributed.checkpoint import FileSystemReader

    from dist_ckpt.restore.records import parse_tensor_record

    items = sorted(FileSystemReader(dcp_dir).read_metadata().storage_data.values(),
                   key=lambda info: (info.relative_path, info.offset))
    aligned = []
    for info in items:
        with open(os.path.join(dcp_dir, info.relative_path), "rb") as handle:
            handle.seek(info.offset)
            record = parse_tensor_record(memoryview(handle.read(info.length)))
        if record is not None and record.nbytes > 64 << 10:
            aligned.append((info.offset + record.data_offset) % directio.ALIGN == 0)
    return items, aligned


def test_tensor_bytes_go_from_staging_buffers_to_the_disk_at_aligned_offsets(tmp_path, monkeypatch) -> None:
    """Page-aligned staging buffers, each large item placed so that its tensor bytes start at
    an aligned file offset: they reach the kernel from the staging buffers (no copy into the
    write buffer), and the padding this takes leaves the generation loadable by plain
    ``dcp.load`` and by restore.
    (A synchronous save writes from the live tensors, wherever they lie: through the buffer.)"""
    in_place: list[int] = []
    real_write_in_place = directio.DirectSink._write_in_place

    def recording(self, view, observe):
        taken = real_write_in_place(self, view, observe)
        in_place.append(taken)
        return taken

    monkeypatch.setattr(directio.DirectSink, "_write_in_place", recording)
    root = str(tmp_path / "root")
    saved = large_state()
    save_one(root, saved, direct_io=True, async_save=True)  # async: written from the staging slot
    dcp_dir = os.path.join(root, GEN1, "dcp")
    _, aligned = large_item_alignment(dcp_dir)
    assert len(aligned) == 3  # the weight and its two Adam moments
    tensor_bytes = 3 * 1024 * 1100 * 4
    if accepts_o_direct(str(tmp_path)):
        assert aligned == [True, True, True]
        assert sum(in_place) >= tensor_bytes - 3 * directio.ALIGN  # all but each last block
    else:
        assert sum(in_place) == 0
    fresh = large_state()
    load_with_plain_dcp(dcp_dir, fresh)
    assert_same_model(fresh, saved)
    restored = large_state()
    with CheckpointManager(CheckpointConfig(root=root), restored) as mgr:
        assert mgr.restore().generation == GEN1
    assert_same_model(restored, saved)


def test_a_wrong_guess_of_where_a_record_keeps_its_bytes_costs_one_copy_only(tmp_path, monkeypatch) -> None:
    """The first large item placed with a wrong guess goes through the write buffer; the
    next ones use what it taught; small items stay packed back to back in their own file."""
    from dist_ckpt.save import shardio

    monkeypatch.setattr(shardio, "_storage_offset_guess", 1)
    root = str(tmp_path / "root")
    saved = large_state()
    save_one(root, saved, direct_io=True, async_save=True)
    dcp_dir = os.path.join(root, GEN1, "dcp")
    items, aligned = large_item_alignment(dcp_dir)
    if accepts_o_direct(str(tmp_path)):
        assert aligned == [False, True, True]
    small = [info for info in items if info.relative_path != items[0].relative_path]
    assert small and all(after.offset == before.offset + before.length
                         for before, after in zip(small, small[1:], strict=False))
    fresh = large_state()
    load_with_plain_dcp(dcp_dir, fresh)
    assert_same_model(fresh, saved)


def test_an_empty_item_never_covers_padding(monkeypatch) -> None:
    """DCP's pattern: tell (start), writes, tell (end). An item with no writes, even with the
    guess changed by another writer in between, records length 0; the next item is placed."""
    from dist_ckpt.save import shardio

    class Collect:
        direct = True
        data = bytearray()

        def write(self, view, observe=None):
            self.data.extend(view)
            if observe is not None:
                observe(view)

    monkeypatch.setattr(shardio, "_storage_offset_guess", 100)
    stream = shardio.HashingStream(Collect(), align_items=True)  # type: ignore[arg-type]
    stream.write(b"x" * 10)
    assert stream.tell() == 10  # an item's end: never padded
    start = stream.tell()  # the next item's start: placed
    assert (start + 100) % directio.ALIGN == 0
    monkeypatch.setattr(shardio, "_storage_offset_guess", 7)  # another writer learned
    assert stream.tell() == start  # the empty item's end: length 0
    assert stream.tell() == start  # the next item's start, at the same offset: placed once only
    stream.write(b"y")
    stream.tell()  # its end
    assert (stream.tell() + 7) % directio.ALIGN == 0  # the item after is placed anew
    assert bytes(Collect.data) == b"x" * 10 + bytes(start - 10) + b"y" + bytes(stream.size - start - 1)


def test_large_staging_buffers_are_page_aligned_and_exactly_their_size() -> None:
    from dist_ckpt.save.staging import StagingPool

    slot = StagingPool(1).acquire()
    state = {"large": torch.randn(600, 601), "small": torch.randn(7), "empty": torch.empty(0, 3)}
    staged = slot.stage(state)
    large = staged["large"]
    assert large.data_ptr() % directio.ALIGN == 0
    assert large.untyped_storage().nbytes() == large.numel() * large.element_size()
    assert all(torch.equal(staged[key], state[key]) for key in state)
    staged_again = slot.stage({key: value * 2 for key, value in state.items()})
    assert staged_again["large"].data_ptr() == large.data_ptr()  # reused, not reallocated
    assert torch.equal(staged_again["large"], state["large"] * 2)


MOUNTINFO_LINES = [
    "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw",
    r"40 27 0:50 / /mnt/nfs\040share rw - nfs4 server:/export rw",
    "41 27 8:1 / /data rw - xfs /dev/sdb1 rw",
    "42 27 0:60 / /data rw - fuse.sshfs host:/ rw",  # mounted over /data later: shadows it
    "43 27 0:61 / /dev/shm rw - tmpfs tmpfs rw",
    "44 27 0:62 / /mnt/données rw - nfs4 server:/export2 rw",  # not escaped: UTF-8 as it is
    r"45 27 8:2 / /mnt/a\134b rw - btrfs /dev/sdc1 rw",  # a backslash, escaped
]


@pytest.mark.parametrize(("path", "expected"), [
    ("/work/run", "ext4"),
    ("/mnt/nfs share/run/gen-1", "nfs4"),
    ("/mnt/nfs/run", "ext4"),  # a mount point is a whole path component
    ("/data/run", "fuse.sshfs"),
    ("/dev/shm/dist_ckpt-x", "tmpfs"),
    ("/mnt/données/run", "nfs4"),
    ("/mnt/a\\b/run", "btrfs"),
])
def test_the_mount_table_names_the_filesystem_of_a_path(path: str, expected: str) -> None:
    assert directio.mount_type(path, MOUNTINFO_LINES) == expected


def test_auto_writes_direct_on_a_local_disk_only(tmp_path) -> None:
    assert directio.filesystem_type("/dev/shm/not-there-yet") == "tmpfs"
    assert not directio.resolve_direct_io("auto", "/dev/shm/not-there-yet")
    local = directio.filesystem_type(str(tmp_path))
    assert directio.resolve_direct_io("auto", str(tmp_path)) == (local in directio.DIRECT_IO_FILESYSTEMS)
    assert directio.resolve_direct_io(True, "/dev/shm")
    assert not directio.resolve_direct_io(False, str(tmp_path))


def test_the_manager_says_how_its_shard_files_are_written(tmp_path, caplog) -> None:
    caplog.set_level("INFO", logger="dist_ckpt")
    for direct_io, expected in ((True, "past the page cache (O_DIRECT)"), (False, "through the page cache")):
        caplog.clear()
        with CheckpointManager(CheckpointConfig(root=str(tmp_path / str(direct_io)), direct_io=direct_io),
                               TrainState(torch.nn.Linear(2, 2))):
            pass
        started = [r.getMessage() for r in caplog.records if "shard files under" in r.getMessage()]
        assert len(started) == 1 and started[0].endswith(expected), started


def test_a_failed_open_gives_the_aligned_buffer_back(tmp_path, monkeypatch) -> None:
    directio.open_sink(str(tmp_path / "warm"), direct=True).close()  # one buffer in the pool
    free_before = len(directio._pool._free)
    refuse_o_direct_at_open(monkeypatch, errno.EACCES)
    with pytest.raises(PermissionError):
        directio.open_sink(str(tmp_path / "shard"), direct=True)
    assert len(directio._pool._free) == free_before
