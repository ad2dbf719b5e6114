"""``model.compile``: the network trains through ``torch.compile`` while checkpoints, Q/K/V callbacks and probes see
the uncompiled module; where a split ends with a smaller batch, one graph per mode (a symbolic batch size); AdamW is
fused on a GPU only."""

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
def test_compiled_fit_trains_and_writes_what_an_uncompiled_one_writes(tiny_dataset, tmp_path, capfd):
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit
    from vitlab.qkv.state import load_snapshot

    import torch._dynamo

    five = ["--data.batch_size", "5"]  # 24 training images: a last batch of 4; 8 validation images: 5 and 3
    plain = fit(tiny_args(tiny_dataset, tmp_path / "plain", epochs=1, extra=five))
    # aot_eager: dynamo's graph capture and AOT autograd without inductor's code generation (fast on 2 cores)
    torch._dynamo.reset()
    start = _graphs()
    compiled = fit(tiny_args(tiny_dataset, tmp_path / "compiled", epochs=1, extra=["--model.compile", "{backend: aot_eager}", *five]))
    assert _graphs() - start == 2  # one for training, one for validation, whatever the last batches' sizes
    err = capfd.readouterr().err  # the user is told when the compilation happens
    assert err.count("vitlab: model.compile: the network compiles at the first batches") == 1 and "torch keeps it" not in err
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


def test_the_compile_notice_names_the_folder_torch_keeps_the_compilation_in(monkeypatch):
    from vitlab.models import compile_notice

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/shared/torch-cache")
    assert compile_notice({}).endswith("torch keeps it in /shared/torch-cache, where later runs of this model and batch "
                                       "size find it")
    assert compile_notice({"mode": "reduce-overhead"}) == compile_notice({})
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert "torchinductor_" in compile_notice({})  # (torch's default folder)
    # (no cache of inductor's to name, nor inductor's compile time)
    assert compile_notice({"backend": "aot_eager"}).endswith("of training and of validation (backend aot_eager)")


def _graphs() -> int:
    import torch._dynamo.utils

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_a_compiled_network_with_a_symbolic_batch_makes_one_graph_per_mode_whatever_the_batch_sizes():
    """Batches of 5, 3, 5 and 2 in training and 5 and 3 under inference mode: one training graph and one inference
    graph with a symbolic batch size, where without the mark (as ``nn.Module.compile``) the first batch size is
    specialised and the training graph compiled again at the first smaller batch; outputs and gradients equal the
    uncompiled network's either way."""
    import copy

    import torch._dynamo

    from vitlab.models import build_model, compile_in_place, is_compiled

    torch.manual_seed(0)
    eager = build_model("vit_tiny_patch16_224", num_classes=3, in_chans=1, img_size=16, patch_size=8, embed_dim=16,
                        depth=2, num_heads=2, drop_path_rate=0.0)
    torch.nn.init.normal_(eager.pos_embed)  # (timm starts some at zero)
    torch.nn.init.normal_(eager.cls_token)

    def run(network):
        grads, outputs = [], []
        for n in (5, 3, 5, 2):
            network.zero_grad(set_to_none=True)
            out = network(torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(n)))
            out.square().sum().backward()
            outputs.append(out.detach())
            grads.append([p.grad.clone() for p in network.parameters()])
        with torch.inference_mode():
            outputs += [network(torch.randn(n, 1, 16, 16, generator=torch.Generator().manual_seed(10 + n))) for n in (5, 3)]
        return outputs, grads

    expected = run(eager)
    torch._dynamo.reset()
    network, plain = copy.deepcopy(eager), copy.deepcopy(eager)
    compile_in_place(network, symbolic_batch=True, backend="aot_eager")
    assert is_compiled(network) and not is_compiled(eager)
    start = _graphs()
    got = run(network)
    assert _graphs() - start == 2
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert list(network.state_dict()) == list(eager.state_dict())  # compiled in place: the same keys

    torch._dynamo.reset()  # without the mark: what torch's own in-place compile does, the first size specialised
    compile_in_place(plain, backend="aot_eager")
    start = _graphs()
    torch.testing.assert_close(run(plain), expected, rtol=1e-5, atol=1e-6)
    assert _graphs() - start == 3


@pytest.mark.slow
def test_a_dynamic_setting_given_by_the_user_is_passed_through():
    import torch._dynamo

    from vitlab.models import build_model, compile_in_place

    network = build_model("vit_tiny_patch16_224", num_classes=3, in_chans=1, img_size=16, patch_size=8, embed_dim=16,
                          depth=1, num_heads=2)
    torch._dynamo.reset()
    compile_in_place(network, symbolic_batch=True, backend="aot_eager", dynamic=False)
    start = _graphs()
    with torch.no_grad():
        for n in (5, 3, 2):
            network(torch.randn(n, 1, 16, 16))
    assert _graphs() - start == 3  # every batch size specialised, as asked


@pytest.mark.parametrize(("batch_size", "varies", "varies_on_two_ranks"),
                         [(8, False, True), (4, False, False), (5, True, True), (6, True, True)])
def test_the_data_module_says_whether_a_split_ends_with_a_smaller_batch(tiny_dataset, batch_size, varies, varies_on_two_ranks):
    from vitlab.data.datamodule import MedicalDataModule

    data = MedicalDataModule(root=str(tiny_dataset), image_size=32, batch_size=batch_size, val_fraction=0.25)
    data.setup("fit")
    sizes = (len(data.samples("train")), len(data.samples("val")))
    assert sizes == (24, 8)  # (6: the validation split's 8 end with 2)
    assert data.batch_sizes_vary() is varies
    # on 2 ranks each gets 12 training and 4 validation images (Lightning's distributed sampler)
    assert data.batch_sizes_vary(ranks=2) is varies_on_two_ranks


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
@pytest.mark.parametrize("setting", ["{mode: reduce-overhead}", "{backend: cudagraphs}"])
def test_on_cuda_a_fit_replayed_as_cuda_graphs_trains_and_snapshots_the_weights_it_trained(tiny_dataset, tmp_path, setting):
    """``model.compile: {mode: reduce-overhead}`` (inductor's kernels) or ``{backend: cudagraphs}`` (torch's own, no
    code generated): each compiled step replayed as CUDA graphs (whose outputs the next replay overwrites); training,
    validation and the Q/K/V snapshots go on as without."""
    from tests.helpers.runs import tiny_args
    from vitlab.cli import fit
    from vitlab.qkv.state import load_snapshot, qkv_state

    extra = ["--model.compile", setting, "--trainer.accelerator", "gpu", "--trainer.devices", "1",
             "--trainer.precision", "bf16-mixed", "--data.batch_size", "5"]  # (last batches of 4 and 3: a second size)
    run = fit(tiny_args(tiny_dataset, tmp_path, epochs=2, extra=extra))
    assert getattr(run.model.model, "_compiled_call_impl", None) is not None and run.trainer.global_step > 0
    metrics = run.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss_epoch"]) and "val/acc" in metrics
    snapshot, _ = load_snapshot(tmp_path / "tiny" / "version_0" / "qkv" / "epoch_002.safetensors")
    trained = qkv_state(run.model.model)
    assert snapshot.keys() == trained.keys()
    for key, value in snapshot.items():  # (the weights after the last step, as the snapshot stores them)
        assert torch.equal(value, trained[key].detach().to(value.dtype).cpu()), key
