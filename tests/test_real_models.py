"""Real models (issue 42): a tiny ``transformers`` Llama (from a ``LlamaConfig``, tied
embeddings, nothing downloaded) and a PEFT LoRA of it (frozen base), under FSDP2 on 2 gloo
ranks, trained through the plain API (tests/helpers/llama_job.py).

One uninterrupted run of each kind, shared by the tests of both suite sessions
(``llama_job.trained_once``), is the reference: the launcher's SIGKILLed run must end equal
to it, a 3-rank restore must load exactly what it saved, and its exports must load with
``transformers`` and ``peft`` and equal its trained tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from dist_ckpt import cli
from dist_ckpt.export import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_WEIGHTS_NAME,
    CONFIG_NAME,
    RELEASE_NAME,
    adapter_keys,
    export_adapter,
    export_generation,
)
from dist_ckpt.format.manifest import generation_name
from dist_ckpt.restart.canonical import canonical
from dist_ckpt.testing import run_ranks
from tests.helpers import launchlib, llama_job

UPDATES, SAVE_EVERY, CRASH_AT = 8, 3, 5
FINAL = generation_name(UPDATES)
LLAMA_JOB = os.path.join(launchlib.REPO, "tests", "helpers", "llama_job.py")

Trained = tuple[dict[str, str], dict[str, dict[str, torch.Tensor]]]


@pytest.fixture(scope="module")
def trained() -> Trained:
    """kind -> root (read only), kind -> the gathered final state (``model/<fqn>``, ``optim/...``)."""
    return llama_job.trained_once(UPDATES, SAVE_EVERY)


def model_part(final: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model/"): v for k, v in final.items() if k.startswith("model/")}


def assert_equal_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.launcher
def test_sigkilled_lora_worker_resumes_bitwise(trained: Trained, tmp_path) -> None:
    """Rank 0 of the LoRA job SIGKILLs itself after update 5; the launcher restarts the job
    from gen 3, and it ends with model and optimizer equal bitwise to the uninterrupted run."""
    _, reference = trained
    root, final = str(tmp_path / "root"), str(tmp_path / "final.pt")
    run = launchlib.launch(root, "--backoff", "0.5", script=LLAMA_JOB, script_args=(
        "--kind", "lora", "--updates", str(UPDATES), "--save-every", str(SAVE_EVERY),
        "--crash-at", str(CRASH_AT), "--crash-marker", str(tmp_path / "crashed"), "--dump-final", final))
    assert run.returncode == 0, run.output[-3000:]
    first, second = run.starts
    assert first["classification"] == "transient" and "rank 0 killed by SIGKILL" in first["reason"]
    assert first["resumed_from"] == "fresh"
    assert second["classification"] == "done" and second["resumed_from"] == generation_name(SAVE_EVERY)
    with open(os.path.join(launchlib.run_dir(root), "DONE.json"), encoding="utf-8") as handle:
        assert json.load(handle)["generation"] == FINAL
    resumed = torch.load(final, weights_only=True)
    assert any("lora_A" in k for k in resumed) and any(k.startswith("optim/") for k in resumed)
    assert_equal_tensors(resumed, reference["lora"])


@pytest.mark.processes
def test_restore_at_3_ranks_loads_the_saved_tensors(trained: Trained, tmp_path) -> None:
    """Both models, saved by 2 ranks, restored by 3 into models built from another seed:
    the gathered model and optimizer state is exactly what the 2 ranks saved."""
    roots, reference = trained
    copies = {kind: str(tmp_path / kind) for kind in roots}
    for kind, root in roots.items():  # a restore may write into its root; the shared one stays as it is
        shutil.copytree(root, copies[kind])
    restored = run_ranks(3, llama_job.restore_ranks, copies)[0]
    for kind in roots:
        generation, state = restored[kind]
        assert generation == FINAL
        assert_equal_tensors(state, reference[kind])


@pytest.mark.processes
def test_peft_export_loads_with_peft_model_from_pretrained(trained: Trained, tmp_path) -> None:
    """``dist-ckpt export --peft``: PEFT's own file names, keys and config; loaded onto a fresh
    base, the model equals the trained one (adapters trained, base frozen)."""
    from peft import LoraConfig, PeftModel, get_peft_model_state_dict

    roots, reference = trained
    out = str(tmp_path / "adapter")
    assert cli.main(["export", roots["lora"], "--out", out, "--peft"]) == 0
    assert sorted(os.listdir(out)) == [ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, RELEASE_NAME]
    saved = load_file(os.path.join(out, ADAPTER_WEIGHTS_NAME))
    untrained = get_peft_model_state_dict(llama_job.unsharded("lora"))  # PEFT's names, initial values
    assert saved.keys() == untrained.keys()
    assert any(not torch.equal(saved[k], untrained[k]) for k in saved), "the adapters were not trained"
    assert all(".default." not in k and "lora_" in k for k in saved)
    config = LoraConfig.from_pretrained(out)
    assert (config.r, config.target_modules, config.inference_mode) == (
        llama_job.LORA_RANK, set(llama_job.LORA_TARGETS), True)
    with open(os.path.join(out, RELEASE_NAME), encoding="utf-8") as handle:
        release = json.load(handle)
    assert release["generation"] == FINAL and release["kind"] == "peft_adapter"
    assert release["adapter_config_source"] == "contract field 'peft_config'"
    loaded = PeftModel.from_pretrained(llama_job.base_model(), out)
    assert_equal_tensors(dict(loaded.state_dict()), model_part(reference["lora"]))


@pytest.mark.processes
def test_adapter_config_given_replaces_the_contracts(trained: Trained, tmp_path) -> None:
    roots, _ = trained
    given = {**canonical(llama_job.lora_config().to_dict()), "base_model_name_or_path": "tiny-llama"}
    info = export_adapter(roots["lora"], str(tmp_path / "adapter"), adapter_config=given)
    assert info.release["adapter_config_source"] == "given" and info.tensor_count == 4 * llama_job.LAYERS
    with open(os.path.join(info.out_dir, ADAPTER_CONFIG_NAME), encoding="utf-8") as handle:
        assert json.load(handle) == {**given, "inference_mode": True}


@pytest.mark.processes
def test_full_export_loads_with_auto_model_from_pretrained(trained: Trained, tmp_path) -> None:
    """The plain Llama's full export has config.json from the contract and its tied head
    written once; ``from_pretrained`` ties it again and equals the trained model."""
    from transformers import AutoModelForCausalLM

    roots, reference = trained
    out = str(tmp_path / "release")
    info = export_generation(roots["plain"], out)
    assert info.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert CONFIG_NAME in info.files and info.release["config_json"] == "from contract field 'hf_config'"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_equal_tensors(dict(model.state_dict()), model_part(reference["plain"]))


@pytest.mark.processes
def test_full_export_of_a_peft_job_writes_no_config(trained: Trained, tmp_path) -> None:
    """The PeftModel's names are no from_pretrained checkpoint: no config.json, and why."""
    roots, reference = trained
    info = export_generation(roots["lora"], str(tmp_path / "release"))
    assert CONFIG_NAME not in info.files and "--peft" in info.release["config_json"]
    # every tensor under its PeftModel name; the tied head twice: frozen, the optimizer names
    # neither of the pair, and only an optimizer's naming proves a tie (export's rule)
    assert info.tensor_count == len(model_part(reference["lora"])) and info.aliases == {}


@pytest.mark.processes
def test_cli_refuses_adapter_requests_it_cannot_meet(trained: Trained, tmp_path, capsys) -> None:
    roots, _ = trained
    out = str(tmp_path / "x")
    assert cli.main(["export", roots["lora"], "--out", out, "--adapter-name", "other"]) == 2
    assert cli.main(["export", roots["lora"], "--out", out, "--peft", "--max-shard-size", "1MB"]) == 2
    assert cli.main(["export", roots["plain"], "--out", out, "--peft"]) == 2
    assert "no 'peft_config' field" in capsys.readouterr().err
    given = str(tmp_path / "lora.json")
    with open(given, "w", encoding="utf-8") as handle:
        json.dump(canonical(llama_job.lora_config().to_dict()), handle)
    assert cli.main(["export", roots["plain"], "--out", out, "--peft", "--adapter-config", given]) == 2
    assert "no PEFT adapter tensors" in capsys.readouterr().err
    assert cli.main(["export", roots["lora"], "--out", out, "--peft", "--adapter-name", "other"]) == 2
    assert "adapters found: default" in capsys.readouterr().err
    assert not os.path.exists(out)


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, attention_bias=True, tie_word_embeddings=False, max_position_embeddings=8))


def _lora(**options: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=2, **options)


ADAPTER_CASES = {
    "the job's": [("default", {"target_modules": ["q_proj", "v_proj"]})],
    "dora, embedding, lora_only bias": [("default", {"target_modules": ["q_proj", "embed_tokens"],
                                                     "bias": "lora_only", "use_dora": True})],
    "regex, modules_to_save, all biases": [("default", {"target_modules": r".*\.(k_proj|embed_tokens)",
                                                        "modules_to_save": ["lm_head"], "bias": "all"})],
    "two adapters": [("default", {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}),
                     ("second", {"target_modules": ["v_proj", "o_proj"], "bias": "lora_only",
                                 "modules_to_save": ["gate_proj"]})],
}


@pytest.mark.parametrize("case", sorted(ADAPTER_CASES))
def test_adapter_keys_are_peft_get_peft_model_state_dict(case: str) -> None:
    """The names-only rule selects and names exactly what PEFT saves, from the tensor it reads."""
    from peft import get_peft_model, get_peft_model_state_dict

    adapters = ADAPTER_CASES[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's notes on saving targeted embeddings
        model = get_peft_model(_tiny_llama(), _lora(**adapters[0][1]), adapter_name=adapters[0][0])
        for name, options in adapters[1:]:
            model.add_adapter(name, _lora(**options))
        with torch.no_grad():  # every tensor distinct, so that reading the wrong one shows
            for param in model.parameters():
                param.add_(torch.randn_like(param))
        state = model.state_dict()
        for name, options in adapters:
            expected = get_peft_model_state_dict(model, adapter_name=name)
            mapping = adapter_keys(list(state), canonical(_lora(**options).to_dict()), name)
            assert mapping.keys() == expected.keys()
            assert all(torch.equal(state[mapping[k]], expected[k]) for k in expected)
