"""Hugging Face checkpoints in and out, proven against transformers (an implementation no one here wrote).

Tiny random `LlamaForCausalLM` (Llama 3.1 RoPE scaling, GQA, untied), `MistralForCausalLM`
(tied embeddings), `Qwen3ForCausalLM` (QK-norm, biases, YaRN, head_dim apart from hidden /
heads), `Qwen3MoeForCausalLM` and `MixtralForCausalLM` (4 experts, top-2) are saved with
`save_pretrained` into several safetensors files, loaded through `model.init_from` in one
process and under the layouts of hf_jobs.py (one 4-rank torchrun launch): Llama under TP 2, CP
2, PP 2 and FSDP 2 x TP 2, Mistral and Qwen3 under FSDP 2 x TP 2, Qwen3-MoE under EP 2 with the
experts FSDP-sharded too, Mixtral under EP 2 x TP 2; and compared with transformers' forward in fp32.

The layout jobs train one step at lr 1e-30 (an update far below fp32 resolution) and export:
the step-1 loss is the loaded model's loss, and the export is the loaded weights, so it must
equal the original checkpoint tensor for tensor (the experts' names and layout included). The
round-trip jobs (Llama, and Qwen3-MoE under EP) train 3 steps for real, export, and transformers'
`from_pretrained` of the export gives our logits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from launcher.errors import UsageError

from .entrypoint_jobs import Job
from .hf_jobs import CASES, EARLIER_SAVE, ROUND_TRIPS
from .hf_models import MODELS, hf_logits, hf_loss

pytestmark = pytest.mark.torchrun

RELATIVE = 1e-5


def job_config(job: Job):
    from launcher.contract.config import load_config

    return load_config(job.config)


def first_batch(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of step 1 (every layout trains on exactly these)."""
    from entrypoints.data import SyntheticTokens

    data = SyntheticTokens(vocab_size=cfg.model.vocab_size, seq_len=cfg.training.seq_len, seed=cfg.training.seed)
    samples = torch.stack([data.sample(i) for i in range(cfg.training.global_batch_size)])
    return samples[:, :-1], samples[:, 1:]


def our_model(cfg, init_from: Path | None = None):
    """Our model in one process, loaded from `init_from` (default: the config's) by init_from's loader."""
    import dataclasses

    from entrypoints.hf_weights import load_hf_weights
    from entrypoints.model.llama import build_model

    if init_from is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=str(init_from)))
    model = build_model(cfg.model, seq_len=cfg.training.seq_len, device="meta")
    model.to_empty(device="cpu")
    model.init_rope()
    load_hf_weights([model], cfg)
    return model


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def read_safetensors_dir(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, read by the safetensors library (not by our reader)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("kind", MODELS)
def test_one_process_logits_and_loss_match_transformers(hf_runs, kind):
    cfg = job_config(next(job for (k, _), job in hf_runs.layouts.items() if k == kind))
    model = our_model(cfg)
    tokens, targets = first_batch(cfg)
    with torch.no_grad():
        logits, loss = model(tokens), model(tokens, targets=targets).item()
    reference = hf_runs.models[kind]
    assert relative_error(logits, hf_logits(reference, tokens)) <= RELATIVE
    assert loss == pytest.approx(hf_loss(reference, tokens, targets), rel=RELATIVE)


@pytest.mark.parametrize(("kind", "layout"), CASES)
def test_layout_loss_matches_transformers(hf_runs, kind, layout):
    job = hf_runs.layouts[kind, layout]
    tokens, targets = first_batch(job_config(job))
    assert job.losses()[0] == pytest.approx(hf_loss(hf_runs.models[kind], tokens, targets), rel=RELATIVE)


@pytest.mark.parametrize(("kind", "layout"), [case for case in CASES if case not in ROUND_TRIPS])
def test_layout_loads_and_exports_every_tensor_exactly(hf_runs, kind, layout):
    exported = read_safetensors_dir(hf_runs.layouts[kind, layout].output_dir / "hf")
    original = read_safetensors_dir(hf_runs.checkpoints[kind])
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


# A weight training must have changed, in each round trip's transformers model.
CHANGED = {
    "llama": ("layers.0.attention.wq.weight", "model.layers.0.self_attn.q_proj.weight"),
    "qwen3_moe": ("layers.0.feed_forward.experts.w1", "model.layers.0.mlp.experts.0.gate_proj.weight"),
}


@pytest.mark.parametrize("kind", [kind for kind, _ in ROUND_TRIPS])
def test_round_trip_export_loads_in_transformers_with_our_logits(hf_runs, kind):
    from transformers import AutoModelForCausalLM

    job = hf_runs.round_trips[kind]
    export = job.output_dir / "hf"
    architecture = MODELS[kind][0]
    assert json.loads((export / "config.json").read_text())["architectures"] == [architecture]
    if kind == "llama":
        assert (export / "tokenizer_config.json").read_text() == '{"model_max_length": 1024}\n'
        # The earlier save's weights (seed_an_earlier_save) are gone, the user's file is not:
        # from_pretrained would otherwise load the untrained model.safetensors and fail below.
        assert not any((export / name).exists() for name in EARLIER_SAVE)
        assert (export / "notes.txt").read_text() == "the user's\n"
    reloaded = AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == architecture
    cfg = job_config(job)
    ours = our_model(cfg, init_from=export)
    tokens, _ = first_batch(cfg)
    with torch.no_grad():
        assert relative_error(ours(tokens), hf_logits(reloaded, tokens)) <= RELATIVE
    # The export holds the trained weights: those of the job's final DCP checkpoint.
    trained, exported = job.final_model(3), read_safetensors_dir(export)
    assert exported.keys() == read_safetensors_dir(hf_runs.checkpoints[kind]).keys()
    for name, tensor in dict(ours.named_parameters()).items():
        assert torch.equal(tensor.detach(), trained[name]), name
    ours_name, theirs_name = CHANGED[kind]
    original = read_safetensors_dir(hf_runs.checkpoints[kind])[theirs_name]
    trained_part = trained[ours_name][0] if ours_name.endswith(("w1", "w2", "w3")) else trained[ours_name]
    assert not torch.equal(trained_part, original), "training changed the weights"


def test_launcher_export_of_a_local_jobs_checkpoint_equals_the_export_in_training(hf_runs, tmp_path, monkeypatch):
    """`launcher export JOB --step 3 --out DIR`: the job's own code bundle reads its DCP checkpoint."""
    from launcher import api
    from launcher.bundle import Bundle
    from launcher.registry import JobRef, job_dir, write_json

    monkeypatch.setenv("LAUNCHER_HOME", str(tmp_path / "home"))
    job = hf_runs.round_trips["llama"]
    Bundle.build(job.config.read_text()).extract(job_dir("fine-tune") / "code")  # as the local backend does
    write_json(job_dir("fine-tune") / "job.json", JobRef(name="fine-tune", backend="local").to_dict())
    written = api.export("fine-tune", step=3, out=tmp_path / "hf")
    in_training = {p.name for p in (job.output_dir / "hf").iterdir()} - {"notes.txt"}  # the user's (hf_jobs.py)
    assert {p.name for p in written.iterdir()} == in_training
    after, during = read_safetensors_dir(written), read_safetensors_dir(job.output_dir / "hf")
    assert after.keys() == during.keys()
    assert all(torch.equal(after[name], during[name]) for name in during)
    before = {path.name: path.stat().st_mtime_ns for path in written.iterdir()}
    with pytest.raises(
        UsageError, match=rf"^--out {re.escape(str(written))}: holds config.json, generation_config.json, "
    ):
        api.export("fine-tune", step=3, out=written)  # refused here, before the job's exporter starts
    assert {path.name: path.stat().st_mtime_ns for path in written.iterdir()} == before


def test_export_refuses_an_out_that_holds_files_or_is_one_and_changes_nothing(hf_runs, tmp_path, capsys):
    """An export writes only into a new or empty directory: transformers' files in a directory the
    user already filled (config.json) would otherwise be overwritten without a word."""
    from entrypoints.export_hf import main

    config = str(hf_runs.round_trips["llama"].config)
    filled = tmp_path / "filled"
    filled.mkdir()
    (filled / "config.json").write_text("theirs")
    (filled / "notes.txt").write_text("theirs too")
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    blocked = a_file / "below"  # a directory that cannot be made under a file
    expected = {
        filled: f"error: --out {filled}: holds config.json, notes.txt; name a new or empty directory, so nothing there is overwritten",
        a_file: f"error: --out {a_file}: is a file, not a directory; name a new or empty directory",
        blocked: f"error: --out {blocked}: cannot make the directory: Not a directory",
    }
    for out, line in expected.items():
        assert main(["--config", config, "--out", str(out)]) == 2
        assert capsys.readouterr().err.splitlines() == [line]
    assert {p.name: p.read_text() for p in filled.iterdir()} == {"config.json": "theirs", "notes.txt": "theirs too"}
    assert a_file.read_text() == "mine"
    assert main(["--config", config, "--out", str(tmp_path / "new" / "hf")]) == 0
    assert (tmp_path / "new" / "hf" / "config.json").is_file()


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_partial_file(hf_runs, tmp_path, capsys):
    """Two blocks free on a real tmpfs: the file opens and its first bytes fit, the rest does not.
    The partial file goes (its header promises tensors it lacks), and nothing names it."""
    from entrypoints.export_hf import main
    from tests.disks import fill_disk, small_disk

    with small_disk(tmp_path / "small", "256k") as small:
        out = small / "hf"
        out.mkdir()
        fill_disk(small, leave_blocks=2)
        assert main(["--config", str(hf_runs.round_trips["llama"].config), "--out", str(out)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: --out {out}: writing the export failed: No space left on device"
        ]
        assert list(out.iterdir()) == []


def test_export_of_a_missing_step_names_the_steps_there(hf_runs, capsys):
    from entrypoints.export_hf import main

    assert main(["--config", str(hf_runs.round_trips["llama"].config), "--step", "7", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "--step: no complete checkpoint of step 7" in err and "there are steps [3]" in err
