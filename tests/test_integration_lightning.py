"""dist_ckpt.integrations.lightning: Lightning's FSDP2 strategy (Trainer and Fabric) checkpointing
through dist_ckpt, killed mid-epoch and resumed bitwise.

The jobs (tests/helpers/lightning_job.py, 2 gloo ranks each): one uninterrupted reference with
Lightning's own strategies (Trainer, then Fabric, in one job), shared by the module; the Trainer
under ``python -m launch`` with a worker SIGKILLed mid-epoch (one launch, two starts); Fabric on
an ``s3://`` root (moto), killed and run again. The rest start no process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from dist_ckpt import ConfigError, ValidationError
from dist_ckpt.config import CheckpointConfig
from dist_ckpt.integrations.lightning_common import (
    NamedSchedulers,
    StrategyCheckpoints,
    check_json,
)
from dist_ckpt.restart import codec
from tests.helpers import launchlib
from tests.helpers.lightning_job import run_job

JOB = os.path.join(launchlib.REPO, "tests", "helpers", "lightning_job.py")
CRASH_AT = 7  # rank 1 dies as it starts update 7 of 8 in epoch 0; gen-6 is the newest saved
RESUMED_FROM = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Lightning's own ModelParallelStrategy, Trainer then Fabric, uninterrupted, no checkpoints."""
    out = str(tmp_path_factory.mktemp("reference"))
    assert run_job("--api", "both", "--own", "--dump", out) == [0, 0]
    return out


def assert_same_run(reference: str, resumed: str, api: str, *, updates: int, epoch: int) -> None:
    """Bitwise the same final weights on every rank, the same counters and learning rate, and
    the resumed process trained on exactly the reference's batches from the resumed update on."""
    for rank in (0, 1):
        expected = torch.load(os.path.join(reference, f"{api}-rank{rank}.pt"), weights_only=True)
        got = torch.load(os.path.join(resumed, f"{api}-rank{rank}.pt"), weights_only=True)
        assert expected["weights"].keys() == got["weights"].keys() and len(got["weights"]) == 4
        differing = [key for key in expected["weights"] if not torch.equal(expected["weights"][key],
                                                                           got["weights"][key])]
        assert not differing, f"rank {rank}: the resumed run's {differing} differ from the reference's"
        assert (got["global_step"], got["epoch"]) == (expected["global_step"], expected["epoch"])
        assert (got["global_step"], got["epoch"]) == (updates, epoch)
        assert got["lr"] == expected["lr"]
        assert got["seen"][0][0] == RESUMED_FROM
        assert got["seen"] == expected["seen"][RESUMED_FROM:]


@pytest.mark.launcher
def test_trainer_killed_mid_epoch_resumes_bitwise_under_launcher(tmp_path, reference: str) -> None:
    root, dump, marker = str(tmp_path / "root"), str(tmp_path / "dump"), str(tmp_path / "crashed")
    launched = launchlib.launch(root, "--backoff", "0.5", script=JOB, script_args=(
        "--api", "trainer", "--crash-at", str(CRASH_AT), "--crash-marker", marker, "--dump", dump))
    assert launched.returncode == 0, launched.output[-3000:]
    first, second = launched.starts
    # which rank's failure the reason names is torchrun's race (the forked start reports only
    # the first): the marker says rank 1 killed itself at the update
    assert first["classification"] == "transient" and first["resumed_from"] == "fresh", first
    assert open(marker).read() == str(CRASH_AT)
    assert second["classification"] == "done"
    assert second["resumed_from"] == f"gen-{RESUMED_FROM:012d}" and second["resumed_update"] == RESUMED_FROM
    # the workers' output is the launcher's; the fit loop took the loader's saved position
    # (Lightning warns on resuming mid-epoch with a loader it cannot resume)
    assert "`Trainer.fit` stopped: `max_epochs=2` reached" in launched.output
    assert "not resumable" not in launched.output
    done = json.load(open(os.path.join(launchlib.run_dir(root), "DONE.json")))
    assert done["generation"] == "gen-000000000016"
    assert_same_run(reference, dump, "trainer", updates=16, epoch=2)


def test_fabric_killed_mid_epoch_resumes_bitwise_on_s3(tmp_path, reference: str, s3_root: str) -> None:
    import fsspec

    dump, marker = str(tmp_path / "dump"), str(tmp_path / "crashed")
    args = ("--api", "fabric", "--root", s3_root, "--dump", dump, "--crash-marker", marker,
            "--crash-at", str(CRASH_AT))
    killed = run_job(*args)
    assert killed[1] == -9 and open(marker).read() == str(CRASH_AT), killed
    store = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket_path = s3_root.removeprefix("s3://")
    assert store.exists(f"{bucket_path}/gen-{RESUMED_FROM:012d}/manifest.json")
    assert not store.exists(f"{bucket_path}/DONE.json")
    assert run_job(*args) == [0, 0]
    done = json.loads(store.cat_file(f"{bucket_path}/DONE.json"))
    assert done["generation"] == "gen-000000000012"
    assert_same_run(reference, dump, "fabric", updates=12, epoch=1)


# ---- the mapping of Lightning paths and state, without processes ---------------------------


def checkpoints(root: str) -> StrategyCheckpoints:
    return StrategyCheckpoints(CheckpointConfig(root=root), contract=None, numpy_generators=None,
                               require_optimizer_boundary=True)


@pytest.mark.parametrize("root", ["/ckpt/run", "s3://bucket/run"])
def test_load_paths_name_the_root_or_a_generation_in_it(root: str) -> None:
    mapping = checkpoints(root)
    assert mapping.wanted(root) is None and mapping.wanted(root + "/") is None
    assert mapping.wanted("last") is None
    assert mapping.wanted("gen-000000000006") == "gen-000000000006"
    assert mapping.wanted(f"{root}/gen-000000000006") == "gen-000000000006"
    for other in (f"{root}/epoch=0-step=6.ckpt", f"{root}-other", "/elsewhere/gen-000000000006"):
        with pytest.raises(ConfigError, match="is not a checkpoint of this strategy"):
            mapping.wanted(other)


def test_a_save_label_that_names_a_generation_must_name_its_update() -> None:
    mapping = checkpoints("/ckpt/run")
    mapping.check_label("/labels/epoch=0-step=6.ckpt", 6)
    mapping.check_label("/ckpt/run", 6)
    mapping.check_label("/ckpt/run/gen-000000000006", 6)
    with pytest.raises(ConfigError, match="gen-000000000007"):
        mapping.check_label("/ckpt/run/gen-000000000006", 7)


def test_extras_keep_zero_dim_tensors_and_refuse_what_json_cannot_hold() -> None:
    checkpoint = {"callbacks": {"ModelCheckpoint": {"kth_value": torch.tensor(float("inf")),
                                                    "best_k_models": {"a.ckpt": torch.tensor(3)}}},
                  "loops": [(1, 2)]}
    check_json(checkpoint)
    back = codec.decode(codec.encode(checkpoint))
    kth = back["callbacks"]["ModelCheckpoint"]["kth_value"]
    assert kth.shape == () and kth.item() == float("inf") and list(map(list, back["loops"])) == [[1, 2]]
    assert back["callbacks"]["ModelCheckpoint"]["best_k_models"]["a.ckpt"].dtype == torch.int64
    with pytest.raises(ConfigError, match="'hparams_type'"):
        check_json({"hparams_type": dict})


def test_named_schedulers_refuse_another_set() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    first = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    second = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
    saved = NamedSchedulers({"0": first, "1": second}).state_dict()
    NamedSchedulers({"0": first, "1": second}).load_state_dict(saved)
    with pytest.raises(ValidationError, match="schedulers"):
        NamedSchedulers({"0": first}).load_state_dict(saved)


def test_fabric_state_maps_by_type_and_needs_one_module_and_an_update() -> None:
    from dist_ckpt.integrations.data import ResumableLoader
    from dist_ckpt.integrations.lightning_fabric import split_state

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    loader = ResumableLoader(list(range(8)), 2, rank=0, world_size=1)
    parts = split_state({"model": model, "opt": optimizer, "sched": schedule, "data": loader, "step": 4,
                         "note": "x"}, "step")
    assert (parts.model, parts.optimizer, parts.sampler, parts.update) == (model, optimizer, loader, 4)
    assert parts.schedulers == {"sched": schedule} and parts.extras == {"step": 4, "note": "x"}
    with pytest.raises(ConfigError, match="2 module"):
        split_state({"a": model, "b": torch.nn.Linear(1, 1), "step": 0}, "step")
    with pytest.raises(ConfigError, match="update number"):
        split_state({"model": model}, "step")


def test_trainer_strategy_leaves_out_hyperparameters_without_json_form(tmp_path) -> None:
    from dist_ckpt.integrations.lightning import DistCkptStrategy

    strategy = DistCkptStrategy(CheckpointConfig(root=str(tmp_path)))
    extras = {"hyper_parameters": {"activation": print}, "hparams_name": "kwargs", "loops": {"fit_loop": {}}}
    assert strategy._without_unsaved_hparams(extras) == {"hparams_name": "kwargs", "loops": {"fit_loop": {}}}
    with pytest.raises(ConfigError, match="save_distributed_checkpoint"):
        DistCkptStrategy(CheckpointConfig(root=str(tmp_path)), save_distributed_checkpoint=False)
