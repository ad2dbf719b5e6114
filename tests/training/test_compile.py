"""``model.compile``: the network trains through ``torch.compile`` while checkpoints, Q/K/V callbacks and probes see
the uncompiled module; AdamW is fused on a GPU only."""

from __future__ import annotations

import pytest
import torch

from vitlab.training.base import compile_options


def test_compile_option_values():
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {}
    assert compile_options({"mode": "max-autotune", "dynamic": False}) == {"mode": "max-autotune", "dynamic": False}
    with pytest.raises(ValueError, match=r"model.compile must be true, false or a dict of torch.compile arguments .*got \{'speed': 'max'\}"):
        compile_options({"speed": "max"})
    with pytest.raises(ValueError, match="model.compile must be"):
        compile_options("yes")


@pytest.mark.slow
def test_compiled_fit_trains_and_writes_what_an_uncompiled_one_writes(tiny_dataset, tmp_path):
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit
    from vitlab.qkv.state import load_snapshot

    plain = fit(tiny_args(tiny_dataset, tmp_path / "plain", epochs=1))
    # aot_eager: dynamo's graph capture and AOT autograd without inductor's code generation (fast on 2 cores)
    compiled = fit(tiny_args(tiny_dataset, tmp_path / "compiled", epochs=1, extra=["--model.compile", "{backend: aot_eager}"]))
    assert getattr(compiled.model.model, "_compiled_call_impl", None) is not None  # trained through the compiled forward
    assert getattr(plain.model.model, "_compiled_call_impl", None) is None
    assert compiled.trainer.global_step == plain.trainer.global_step > 0
    assert torch.isfinite(compiled.trainer.callback_metrics["train/loss_epoch"])
    ckpts = [torch.load(root / "tiny" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
             for root in (tmp_path / "plain", tmp_path / "compiled")]
    assert list(ckpts[0]["state_dict"]) == list(ckpts[1]["state_dict"])  # same layout: no _orig_mod prefixes
    assert ckpts[1]["hyper_parameters"]["compile"] == {"backend": "aot_eager"}
    snap_plain, _ = load_snapshot(tmp_path / "plain" / "tiny" / "version_0" / "qkv" / "epoch_001.safetensors")
    snap_compiled, _ = load_snapshot(tmp_path / "compiled" / "tiny" / "version_0" / "qkv" / "epoch_001.safetensors")
    assert snap_plain.keys() == snap_compiled.keys()
    # the probes open the compiled run's checkpoint as an ordinary model
    from vitlab.probe_cli import probe_main

    ckpt = tmp_path / "compiled" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    probe_main(["spectra", "--checkpoint", str(ckpt), "--out", str(tmp_path / "probe")])
    assert (tmp_path / "probe").is_dir()


def test_adamw_is_fused_on_cuda_only():
    from tests.helpers.runs import TINY_SWIN
    from vitlab.training.classification import ClassificationModule

    module = ClassificationModule(num_classes=2, layer_decay=0.75, **TINY_SWIN)
    module.trainer = type("T", (), {"estimated_stepping_batches": 10, "max_epochs": 1})()
    optimizer = module.configure_optimizers()["optimizer"]
    assert not optimizer.defaults.get("fused")
    if torch.cuda.is_available():
        module = module.cuda()
        optimizer = module.configure_optimizers()["optimizer"]
        assert optimizer.defaults["fused"] and len(optimizer.param_groups) > 2  # per-group learning rates kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_on_cuda_a_fit_replayed_as_cuda_graphs_trains_and_snapshots_the_weights_it_trained(tiny_dataset, tmp_path):
    """``model.compile: {mode: reduce-overhead}``: each compiled step replayed as CUDA graphs (whose outputs the next
    replay overwrites); training, validation and the Q/K/V snapshots go on as without."""
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit
    from vitlab.qkv.state import load_snapshot, qkv_state

    extra = ["--model.compile", "{mode: reduce-overhead}", "--trainer.accelerator", "gpu", "--trainer.devices", "1",
             "--trainer.precision", "bf16-mixed"]
    run = fit(tiny_args(tiny_dataset, tmp_path, epochs=2, extra=extra))
    assert getattr(run.model.model, "_compiled_call_impl", None) is not None and run.trainer.global_step > 0
    metrics = run.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss_epoch"]) and "val/acc" in metrics
    snapshot, _ = load_snapshot(tmp_path / "tiny" / "version_0" / "qkv" / "epoch_002.safetensors")
    trained = qkv_state(run.model.model)
    assert snapshot.keys() == trained.keys()
    for key, value in snapshot.items():  # (the weights after the last step, as the snapshot stores them)
        assert torch.equal(value, trained[key].detach().to(value.dtype).cpu()), key
