"""Progress marks: what a rank writes is what the launcher reads, sections carry their
deadline, a torn write is never read as progress, and outside the launcher nothing is written."""

from __future__ import annotations

import os
import time

from dist_ckpt import marks


def test_marks_round_trip_with_longest_interval(tmp_path) -> None:
    writer = marks.open_writer(str(tmp_path), 3)
    assert marks.read_marks(str(tmp_path))[3].count == 0  # the file exists before the first mark
    before = time.monotonic()
    writer.mark(7)
    writer.mark(8)
    found = marks.read_marks(str(tmp_path))[3]
    assert (found.rank, found.update, found.count, found.pid) == (3, 8, 2, os.getpid())
    assert before <= found.mark_s <= time.monotonic()
    assert 0 <= found.longest_s <= found.mark_s - before
    assert found.section == "" and found.deadline_s == 0.0


def test_a_section_carries_its_deadline_and_nested_sections_keep_the_outer(tmp_path) -> None:
    writer = marks.open_writer(str(tmp_path), 0)
    with writer.section("finish", 100.0):
        outer = marks.read_marks(str(tmp_path))[0]
        with writer.section("save", 1.0):
            inner = marks.read_marks(str(tmp_path))[0]
    left = time.monotonic()
    after = marks.read_marks(str(tmp_path))[0]
    assert outer.section == inner.section == "finish"
    assert outer.mark_s <= after.mark_s <= left  # leaving the section is progress
    assert inner.deadline_s == outer.deadline_s >= time.monotonic() + 90
    assert after.section == "" and after.deadline_s == 0.0


def test_a_write_in_progress_is_not_progress(tmp_path) -> None:
    writer = marks.open_writer(str(tmp_path), 1)
    writer.mark(5)
    path = marks.marks_path(str(tmp_path), 1)
    with open(path, "r+b") as handle:  # a writer that died between its two sequence stores
        raw = bytearray(handle.read())
        raw[0] |= 1
        handle.seek(0)
        handle.write(raw)
    assert marks.read_mark(path) is None
    assert marks.read_marks(str(tmp_path)) == {}


def test_outside_the_launcher_nothing_is_written(tmp_path) -> None:
    writer = marks.open_writer(None, 0)
    writer.mark(1)
    with writer.section("save", 1.0):
        writer.mark(2)
    writer.close()
    assert writer.update == 2 and os.listdir(tmp_path) == []
    unwritable = tmp_path / "file"
    unwritable.write_text("")
    marks.open_writer(str(unwritable / "sub"), 0).mark(1)  # cannot be made: no error
