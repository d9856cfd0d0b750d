"""Rank 0's half of a save: collect every rank's report, build the manifest, publish it.

Call order (rank 0 only, from ``run_save`` after its own report): ``collect_reports`` until
the deadline -> DCP ``.metadata`` written below the attempt's local directory and handed to
the tier -> ``Attempt.publish`` (the manifest last; see ``dist_ckpt.tiers.base``). Any
failure abandons the attempt: nothing of it is published.
"""

from __future__ import annotations

import base64
import copy
import os
import pickle
import time
import traceback

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from .. import faults
from ..errors import GenerationExists
from ..format.manifest import (
    DCP_DIR,
    FORMAT_VERSION,
    INCREMENTAL_FORMAT_VERSION,
    METADATA_FILE,
    METADATA_NAME,
    FileEntry,
    Manifest,
    is_object_path,
)
from ..protocol import messages
from ..protocol.comm import Comm
from ..protocol.messages import CommitOutcome, RankReport
from ..storage.local import file_digest, fsync_file
from .request import SaveRequest


def collect_reports(request: SaveRequest, comm: Comm,
                    commit_timeout_s: float) -> tuple[list[RankReport], dict[int, str]]:
    """Every rank's report, or the failures (late, missing, or failed ranks)."""
    keys = {rank: messages.report_key(request.generation, request.attempt_id, rank)
            for rank in range(comm.world_size)}
    found = messages.collect(comm, keys, request.started + commit_timeout_s)
    failures = {rank: f"did not report within commit_timeout_s={commit_timeout_s:g}"
                for rank in found.missing}
    reports = [messages.decode(RankReport, raw) for _, raw in sorted(found.received.items())]
    failures.update({report.rank: report.error for report in reports if report.error is not None})
    if not failures and time.monotonic() - request.started > commit_timeout_s:
        failures[0] = f"rank 0 did not finish within commit_timeout_s={commit_timeout_s:g}"
    return reports, failures


def commit(request: SaveRequest, comm: Comm, commit_timeout_s: float) -> CommitOutcome:
    """Publish the generation if every rank reported in time; returns the outcome."""
    reports, failures = collect_reports(request, comm, commit_timeout_s)
    faults.hit("commit.collected", comm.rank)
    attempt = request.attempt
    manifest_raw = None
    metadata: list[dict] = []
    if not failures:
        try:
            results = [pickle.loads(base64.b64decode(r.results)) for r in reports]
            entries = [entry for r in reports for entry in r.files]
            metadata = [_write_dcp_metadata(request, results).model_dump()]
            faults.hit("commit.before_manifest", 0)
            attempt.put_files(metadata)
            manifest_raw = attempt.publish(build_manifest(request, entries + metadata),
                                           request.signing_key)
        except GenerationExists as exc:
            failures[0] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any publish failure fails the generation
            traceback.print_exc()
            failures[0] = f"{type(exc).__name__}: {exc}"
    if failures:
        attempt.abandon()
        return CommitOutcome(False, {str(r): m for r, m in failures.items()})
    own = next((r.files for r in reports if r.rank == comm.rank), [])
    attempt.release(own + metadata, committed=True)
    assert manifest_raw is not None
    return CommitOutcome(True, {}, manifest_raw.decode("utf-8"))


def build_manifest(request: SaveRequest, entries: list[dict]) -> Manifest:
    info = request.info
    assert info is not None
    # a shared object two ranks wrote or referenced (equal bytes, one name) is listed once
    unique = {e["path"]: e for e in sorted(entries, key=lambda e: -e["rank"])}
    files = sorted((FileEntry(**e) for e in unique.values()), key=lambda f: f.path)
    incremental = any(is_object_path(f.path) for f in files)
    return Manifest(
        format_version=INCREMENTAL_FORMAT_VERSION if incremental else FORMAT_VERSION,
        generation=request.generation, kind="resume",
        next_update=request.next_update, tokens_seen=request.tokens_seen,
        world_size=info.world_size, components=info.components, contract=info.contract,
        contract_digest=info.contract_digest, contract_values=info.contract_values,
        torch_version=torch.__version__,
        dist_ckpt_version=info.dist_ckpt_version, created_unix=time.time(),
        save_duration_s=round(time.monotonic() - request.started, 6),
        total_bytes=sum(f.size for f in files), files=files, data_dir=request.attempt.data_dir,
    )


def _write_dcp_metadata(request: SaveRequest, results: list) -> FileEntry:
    dcp_dir = os.path.join(request.attempt.local_dir, DCP_DIR)
    metadata = copy.copy(request.prepared.metadata)
    writer = FileSystemWriter(dcp_dir, sync_files=True)
    writer.finish(metadata, results)
    path = os.path.join(dcp_dir, METADATA_NAME)
    # DCP fsyncs .metadata before flushing its buffer; fsync the finished file ourselves
    fsync_file(path)
    size, digest = file_digest(path, request.digest_algorithm)
    return FileEntry.of(METADATA_FILE, size, request.digest_algorithm, digest, rank=0)
