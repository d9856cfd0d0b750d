"""The offline tools on incremental generations (issue 28): ``verify`` hashes each shared
object once and names every generation a damaged one fails; ``ls`` shows each generation's
own and referenced bytes; ``diff``, ``export`` and ``rehearse`` read an incremental
generation as completely as a full one, and ``export`` writes the same safetensors from it."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator

import pytest

from dist_ckpt.cli.app import main as cli
from dist_ckpt.format.manifest import OBJECTS_DIR, is_object_path
from dist_ckpt.storage.local import LocalStore
from dist_ckpt.testing import run_ranks
from tests.helpers import finetune_jobs
from tests.helpers.incremental_tiers import manifest, objects_of

GEN1, GEN2 = "gen-000000000001", "gen-000000000002"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "tests", "helpers", "finetune_script.py")
FROZEN = ("model.base1.", "model.base2.")
TRAINED = ("model.adapter.", "model.head.")


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The same FSDP2 fine-tuning job on 2 ranks, saved at updates 1 and 2 twice: as
    incremental generations sharing the frozen base, and with ``incremental=False``."""
    base = tmp_path_factory.mktemp("incremental_cli")
    found = {"inc": str(base / "inc"), "full": str(base / "full")}
    run_ranks(2, finetune_jobs.run, "fsdp", found["inc"], [1, 2])
    run_ranks(2, finetune_jobs.run, "fsdp", found["full"], [1, 2], {"incremental": False})
    return found


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter]:
    """Every file a local store hashes, counted by its path below the root."""
    counted: Counter = Counter()
    original = LocalStore.digest

    def counting(self: LocalStore, rel: str, algorithm: str) -> str:
        counted[rel] += 1
        return original(self, rel, algorithm)

    monkeypatch.setattr(LocalStore, "digest", counting)
    yield counted


def json_out(capsys: pytest.CaptureFixture, args: list[str], status: int | None = 0) -> dict:
    """The command's JSON; its exit status must be ``status`` (None: any)."""
    capsys.readouterr()
    found = cli([*args, "--json"])
    assert status is None or found == status
    return json.loads(capsys.readouterr().out)


def damage(root: str, how: str) -> str:
    """Damage one shared object of ``root`` (both generations list it); returns its path."""
    path = sorted(objects_of(root, GEN2))[0]
    where = os.path.join(root, path)
    if how == "flip":
        with open(where, "r+b") as handle:
            handle.seek(-100, os.SEEK_END)
            byte = handle.read(1)
            handle.seek(-100, os.SEEK_END)
            handle.write(bytes([byte[0] ^ 1]))
    elif how == "truncate":
        os.truncate(where, os.path.getsize(where) - 1)
    else:
        os.unlink(where)
    return path


# ---- verify ----------------------------------------------------------------------------------
@pytest.mark.processes
def test_verify_all_hashes_each_shared_object_once(roots, digests, capsys) -> None:
    inc = roots["inc"]
    shared = objects_of(inc, GEN2)
    assert len(shared) == 4 and shared == objects_of(inc, GEN1)
    out = json_out(capsys, ["verify", inc, "--all"])
    assert out["ok"] and [g["generation"] for g in out["generations"]] == [GEN2, GEN1]
    # two generations list the four objects; each was read and hashed once
    assert {path: digests[path] for path in shared} == dict.fromkeys(shared, 1)
    assert out["objects"] == {"checked": 4, "hashed": 4, "damaged": []}
    # each generation's own files are hashed, once each
    own = [f"{GEN2}/{f['path']}" for f in manifest(inc, GEN2)["files"] if not is_object_path(f["path"])]
    assert all(digests[path] == 1 for path in own)
    # verify ROOT (the latest generation and any newer one): the objects once too
    digests.clear()
    assert cli(["verify", inc]) == 0
    assert "4 shared object(s) checked, each read once; 0 damaged" in capsys.readouterr().out
    assert {path: digests[path] for path in shared} == dict.fromkeys(shared, 1)


@pytest.mark.processes
@pytest.mark.parametrize("how", ["flip", "truncate", "missing"])
def test_a_damaged_object_fails_every_generation_and_is_named_once(roots, digests, capsys, tmp_path,
                                                                   how: str) -> None:
    root = str(tmp_path / "root")
    shutil.copytree(roots["inc"], root)
    bad = damage(root, how)
    out = json_out(capsys, ["verify", root, "--all"], status=1)
    assert not out["ok"]
    for result in out["generations"]:  # every generation that references it fails, naming it
        assert not result["ok"] and result["path"] == bad and bad in result["reason"]
    # the damaged object is one report naming every generation that references it
    assert [d["path"] for d in out["objects"]["damaged"]] == [bad]
    assert out["objects"]["damaged"][0]["generations"] == [GEN2, GEN1]
    assert out["objects"]["checked"] == 4
    assert digests[bad] == (1 if how == "flip" else 0)  # a wrong size is never hashed
    assert all(count == 1 for path, count in digests.items() if is_object_path(path))
    # text: each generation INVALID, the object reported once with both generations
    assert cli(["verify", root, "--all"]) == 1
    text = capsys.readouterr().out
    assert text.count(f"damaged shared object {bad}") == 1
    assert f"referenced by 2 generation(s), each INVALID: {GEN2}, {GEN1}" in text
    assert "0 of 2 generation(s) valid" in text
    # one generation checked by name: the others that reference the object are named too
    out = json_out(capsys, ["verify", root, "1"], status=1)
    assert out["generation"] == GEN1 and out["path"] == bad
    assert out["objects"]["damaged"][0]["generations"] == [GEN2, GEN1]


# ---- ls ----------------------------------------------------------------------------------------
@pytest.mark.processes
def test_ls_shows_own_and_referenced_bytes(roots, capsys) -> None:
    inc, full = roots["inc"], roots["full"]
    listed = json_out(capsys, ["ls", inc])
    shared = objects_of(inc, GEN2)
    for record in listed["generations"]:
        files = manifest(inc, record["name"])["files"]
        assert record["referenced_bytes"] == sum(shared.values())
        assert record["own_bytes"] == sum(f["size"] for f in files if not is_object_path(f["path"]))
        assert record["own_bytes"] + record["referenced_bytes"] == record["total_bytes"]
    folder = os.path.join(inc, OBJECTS_DIR)
    on_disk = sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder))
    assert listed["objects"] == {"count": 4, "bytes": on_disk}
    # the same job saved in full: nothing referenced, its own bytes hold the frozen base too
    plain = json_out(capsys, ["ls", full])
    for record in plain["generations"]:
        assert record["referenced_bytes"] == 0 and record["own_bytes"] == record["total_bytes"]
    assert plain["objects"] == {"count": 0, "bytes": 0}
    frozen = sum(shared.values())
    assert listed["generations"][0]["own_bytes"] < plain["generations"][0]["own_bytes"] - frozen // 2
    # text: OWN and SHARED columns on an incremental root only
    assert cli(["ls", inc]) == 0
    text = capsys.readouterr().out
    header = text.splitlines()[0].split()
    assert header[:6] == ["GENERATION", "UPDATE", "BYTES", "SIZE", "OWN", "SHARED"]
    assert "shared objects: 4 under objects/" in text
    assert cli(["ls", full]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == [
        "GENERATION", "UPDATE", "BYTES", "SIZE", "STATE", "REASON"]


def test_plan_counts_shared_objects_once(roots, capsys, tmp_path) -> None:
    """``dist-ckpt plan`` on an incremental root: every kept generation's own bytes, the shared
    objects once; on the same job saved in full, every generation whole."""
    inc, full = roots["inc"], roots["full"]
    shared, whole = sum(objects_of(inc, GEN2).values()), manifest(inc, GEN2)["total_bytes"]
    plan = json_out(capsys, ["plan", inc, "--save-cost", "10s", "--keep-last", "3"])
    assert plan["generation_bytes"] == whole and plan["shared_bytes"] == shared > whole // 2
    assert plan["disk_bytes"] == (3 + 0 + 1) * (whole - shared) + shared
    assert plan["kept_bytes"] == 3 * (whole - shared) + shared
    plain = json_out(capsys, ["plan", full, "--save-cost", "10s", "--keep-last", "3"])
    assert plain["shared_bytes"] == 0 and plain["disk_bytes"] == 4 * plain["generation_bytes"]
    assert plan["disk_bytes"] < plain["disk_bytes"] // 2
    assert cli(["plan", inc, "--save-cost", "10s", "--keep-last", "3"]) == 0
    assert "shared objects once" in capsys.readouterr().out
    # a save puts its own files and the manifest, a restore gets every file
    tiers = tmp_path / "tiers.json"
    tiers.write_text(json.dumps({"tiers": [{"name": "s3", "read_bytes_per_s": 1e9,
                                            "usd_per_1000_put": 0.005, "usd_per_1000_get": 0.0004}]}))
    priced = json_out(capsys, ["plan", inc, "--save-cost", "10s", "--tiers", str(tiers)])
    files, objects = len(manifest(inc, GEN2)["files"]) + 1, len(objects_of(inc, GEN2))
    assert priced["files_per_generation"] == files and objects == 4
    assert priced["tiers"][0]["put_requests"] == pytest.approx((files - objects) * priced["saves"])
    assert priced["tiers"][0]["get_requests"] == pytest.approx(files * priced["restores"])


# ---- diff --------------------------------------------------------------------------------------
def _differing(report: dict) -> set[str]:
    return {d["key"] for d in report["differences"] if d["component"] in ("model", "optimizer")}


@pytest.mark.processes
def test_diff_between_incremental_generations_and_a_full_one(roots, digests, capsys) -> None:
    inc, full = roots["inc"], roots["full"]
    report = json_out(capsys, ["diff", f"{inc}/{GEN1}", f"{inc}/{GEN2}"], status=1)
    changed = _differing(report)
    # the trained adapter and head changed; the frozen base is compared and unchanged
    assert changed and all(key.startswith(TRAINED) or key.startswith("optim.") for key in changed)
    assert not any(key.startswith(FROZEN) for key in changed)
    assert report["components"]["model"]["compared"] == 8
    # both sides read the same shared objects: hashed once for the two
    assert all(digests[path] == 1 for path in objects_of(inc, GEN2))
    # incremental against full, the same update: the tensors are the same bitwise (the
    # Python and NumPy RNG streams of two runs differ: they are not seeded by the job)
    report = json_out(capsys, ["diff", f"{inc}/{GEN2}", f"{full}/{GEN2}"], status=None)
    assert _differing(report) == set()
    assert report["components"]["model"] == {"compared": 8, "differing": 0}
    # and across updates: the frozen base the same, in one read from objects, in the other not
    report = json_out(capsys, ["diff", f"{inc}/{GEN1}", f"{full}/{GEN2}"], status=1)
    assert _differing(report) == changed


# ---- export ------------------------------------------------------------------------------------
@pytest.mark.processes
def test_export_of_an_incremental_generation_equals_a_full_ones(roots, tmp_path, capsys) -> None:
    inc, full = roots["inc"], roots["full"]
    for generation in (GEN1, GEN2):
        out_inc, out_full = tmp_path / f"inc-{generation}", tmp_path / f"full-{generation}"
        release = json_out(capsys, ["export", inc, generation, "--out", str(out_inc)])
        json_out(capsys, ["export", full, generation, "--out", str(out_full)])
        for name in ("model.safetensors", "model.safetensors.index.json"):
            assert (out_inc / name).read_bytes() == (out_full / name).read_bytes(), name
        # the frozen base was read from the shared objects, each hashed before it was read
        verified = set(release["verified_source_files"])
        assert set(objects_of(inc, generation)) <= verified


@pytest.mark.processes
def test_export_refuses_a_damaged_shared_object(roots, tmp_path, capsys) -> None:
    root = str(tmp_path / "root")
    shutil.copytree(roots["inc"], root)
    bad = damage(root, "flip")
    assert cli(["export", root, GEN1, "--out", str(tmp_path / "out")]) == 1
    assert bad in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---- rehearse ----------------------------------------------------------------------------------
def rehearse_job(rank: int, world: int, kind: str, root: str, generation: str | None) -> tuple:
    """Rehearse ``generation`` (default: the newest valid) into a fresh job, one update on."""
    job = finetune_jobs.Job(kind, rank, world, seed=7)
    mgr = finetune_jobs.manager(job, root)
    try:
        result = mgr.rehearse(lambda _state: (job.step(), 0.0)[1], generation=generation)
    finally:
        mgr.close()
    return result.generation, result.digest


@pytest.mark.processes
def test_rehearse_an_incremental_generation(roots, tmp_path) -> None:
    copies = {}
    for name in ("inc", "full"):  # a rehearsal records itself in ROOT/rehearsals.json
        copies[name] = str(tmp_path / name)
        shutil.copytree(roots[name], copies[name])
    inc = run_ranks(2, rehearse_job, "fsdp", copies["inc"], None)
    full = run_ranks(2, rehearse_job, "fsdp", copies["full"], None)
    assert inc[0][0] == GEN2 and inc[0] == inc[1]
    # the same state after the same update: the incremental generation restored it whole
    assert inc[0] == full[0]
    with open(os.path.join(copies["inc"], "rehearsals.json"), encoding="utf-8") as handle:
        assert json.load(handle)[GEN2]["passed"]
    # the older generation, by name, at another world size
    older = run_ranks(1, rehearse_job, "plain", copies["inc"], GEN1)
    assert older[0][0] == GEN1


@pytest.mark.launcher  # torchrun runs the job's own script
def test_cli_rehearse_of_an_incremental_generation(roots, tmp_path, capsys, monkeypatch) -> None:
    root = str(tmp_path / "inc")
    shutil.copytree(roots["inc"], root)
    monkeypatch.setenv("PYTHONPATH", REPO)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    capsys.readouterr()
    assert cli(["rehearse", root, GEN1, "--script", SCRIPT, "--nproc-per-node", "2", "--json",
                "--script-args", "fsdp"]) == 0
    outcome = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outcome["generation"] == GEN1 and outcome["passed"] and outcome["updates"] == 1
    assert sorted(n for n in os.listdir(root) if n.startswith("gen-")) == [GEN1, GEN2]  # nothing written

