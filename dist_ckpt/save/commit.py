"""Rank 0's half of a save: collect every rank's report, build the manifest, publish it.

Call order (rank 0 only, from ``run_save`` after its own report): ``collect_reports`` (one
key per node, ``protocol/gather.py``) until the deadline -> DCP ``.metadata`` written below
the attempt's local directory (or the same bytes as the last save's, under the same plan)
and handed to the tier -> the commit point claimed in the store -> ``Attempt.publish`` (the
manifest last; see ``dist_ckpt.tiers.base``). Any failure abandons the attempt: nothing of
it is published.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import time
import traceback

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from .. import faults
from ..errors import CommitError, GenerationExists
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
from ..protocol import gather, messages
from ..protocol.comm import Comm
from ..protocol.messages import CommitOutcome, RankReport
from ..storage.local import file_digest, fsync_file, write_durable
from .request import SaveRequest


def collect_reports(request: SaveRequest, comm: Comm, commit_timeout_s: float,
                    own: bytes) -> tuple[list[RankReport], dict[int, str], list[int]]:
    """Every rank's report (through the node leaders), or the failures (late, missing, or
    failed ranks), and the ranks of rank 0's node that reported. ``own``: rank 0's report."""
    found, own_node = gather.gather(comm, messages.save_scope(request.generation, request.attempt_id), own,
                          request.started + commit_timeout_s)
    failures = {rank: f"did not report within commit_timeout_s={commit_timeout_s:g}"
                for rank in found.missing}
    reports = [messages.decode(RankReport, raw) for _, raw in sorted(found.received.items())]
    failures.update({report.rank: report.error for report in reports if report.error is not None})
    if not failures and time.monotonic() - request.started > commit_timeout_s:
        failures[0] = f"rank 0 did not finish within commit_timeout_s={commit_timeout_s:g}"
    return reports, failures, own_node


def _results(request: SaveRequest, reports: list[RankReport],
             failures: dict[int, str]) -> dict[str, bytes]:
    """Every report's pickled DCP write results by digest; a report whose results rank 0 no
    longer holds fails its rank (it sends them in full next time)."""
    cache, out = request.prepared.results, {}
    for report in reports:
        raw = cache.resolve(report.results, report.results_sha256)
        if raw is None:
            failures[report.rank] = "its write results repeat a generation rank 0 no longer holds"
        else:
            out[report.results_sha256] = raw
    return out


def commit(request: SaveRequest, comm: Comm, commit_timeout_s: float,
           own: bytes) -> tuple[CommitOutcome, bytes | None, list[int]]:
    """Publish the generation if every rank reported in time; returns the outcome (posted by
    the caller), the manifest's bytes when committed, and the ranks of rank 0's node that
    reported (they wait for its relay).

    The commit point is claimed first (``COMMITTING`` under the claim key, compare-and-set):
    a node leader that gave up waiting set ``ABANDONED`` there before, and then rank 0 does
    not publish, so no rank can record as failed a generation rank 0 commits."""
    reports, failures, own_node = collect_reports(request, comm, commit_timeout_s, own)
    faults.hit("commit.collected", comm.rank)
    attempt = request.attempt
    manifest_raw = None
    metadata: list[dict] = []
    results: dict[str, bytes] = {}
    if not failures:
        results = _results(request, reports, failures)
    if not failures:
        try:
            digests = [r.results_sha256 for r in reports]
            metadata = [_write_dcp_metadata(request, [results[d] for d in digests], digests).model_dump()]
            entries = [entry for r in reports for entry in r.files]
            faults.hit("commit.before_manifest", 0)
            attempt.put_files(metadata)
            manifest = build_manifest(request, entries + metadata)
            key = messages.claim_key(request.generation, request.attempt_id)
            if comm.store.compare_set(key, "", messages.COMMITTING.decode()) != messages.COMMITTING:
                raise CommitError("a node leader gave up waiting for the outcome first")
            faults.hit("commit.claimed", 0)
            manifest_raw = attempt.publish(manifest, request.signing_key)
        except GenerationExists as exc:
            failures[0] = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any publish failure fails the generation
            traceback.print_exc()
            failures[0] = f"{type(exc).__name__}: {exc}"
    if failures:
        attempt.abandon()
        failed = CommitOutcome(False, {str(r): m for r, m in failures.items()}, request.generation)
        return failed, None, own_node
    own_files = next((r.files for r in reports if r.rank == comm.rank), [])
    attempt.release(own_files + metadata, committed=True)
    request.prepared.results.remember(results)
    assert manifest_raw is not None
    digest = hashlib.sha256(manifest_raw).hexdigest()
    return CommitOutcome(True, {}, request.generation, digest), manifest_raw, own_node


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


def _write_dcp_metadata(request: SaveRequest, results: list[bytes], digests: list[str]) -> FileEntry:
    """DCP's ``.metadata`` below the attempt's directory: the bytes of the last save under the
    same plan when every rank's results repeat (``save/results_cache.py``), else built."""
    dcp_dir = os.path.join(request.attempt.local_dir, DCP_DIR)
    path = os.path.join(dcp_dir, METADATA_NAME)
    cache = request.prepared.results
    key = hashlib.sha256("\n".join(digests).encode()).hexdigest()
    kept = cache.metadata(key, request.prepared.plan)
    if kept is not None:
        write_durable(path, kept)
    else:
        metadata = copy.copy(request.prepared.metadata)
        writer = FileSystemWriter(dcp_dir, sync_files=True)
        writer.finish(metadata, [pickle.loads(raw) for raw in results])
        # DCP fsyncs .metadata before flushing its buffer; fsync the finished file ourselves
        fsync_file(path)
        with open(path, "rb") as handle:
            cache.keep_metadata(key, request.prepared.plan, handle.read())
    size, digest = file_digest(path, request.digest_algorithm)
    return FileEntry.of(METADATA_FILE, size, request.digest_algorithm, digest, rank=0)
