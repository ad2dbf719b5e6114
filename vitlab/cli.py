"""Command lines: ``train.py`` (LightningCLI fine-tuning) and ``probe.py`` (analyses of a checkpoint)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from vitlab.runtime import Runtime, available_cores, frozen_heap, nvml_cuda_check, prepare_process, prepare_training

prepare_process()  # before torch is imported (by Lightning, below)

from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from pytorch_lightning.utilities.model_helpers import is_overridden  # noqa: E402

from vitlab import cli_support, runs  # noqa: E402
from vitlab.run_record import RECORD_KEY  # noqa: E402
from vitlab.data import DenseDataModule, MedicalDataModule  # noqa: E402
from vitlab.probe_cli import _exit_with_message, probe_main  # noqa: E402,F401 - Lightning-free, shared with probe.py
from vitlab.training import ClassificationModule, DetectionModule, DINOModule, SegmentationModule  # noqa: E402

TENSORBOARD_LOGGER = "pytorch_lightning.loggers.TensorBoardLogger"
# task -> (LightningModule, DataModule, checkpoint monitor); chosen by the config's top-level ``task:`` key
TASKS = {
    "classification": (ClassificationModule, MedicalDataModule, "val/balanced_acc"),
    "detection": (DetectionModule, DenseDataModule, "val/map_50"),
    "segmentation": (SegmentationModule, DenseDataModule, "val/dice"),
    "dino": (DINOModule, MedicalDataModule, "val/knn_acc"),  # self-supervised: labels only score k-NN
}


class VitlabCLI(LightningCLI):
    """LightningCLI with vitlab's conventions.

    - ``python train.py --config x.yaml`` fits without a subcommand (``run=False``); ``--ckpt_path`` resumes.
    - ``data.num_classes`` / ``data.in_chans`` / ``data.class_names`` are linked into the model.
    - ``runtime.threads`` / ``runtime.workers`` / ``runtime.figures`` (:class:`vitlab.runtime.Runtime`): ``auto`` is
      resolved from the cores and the accelerator, printed once and saved resolved in the run's ``config.yaml``; the
      workers become ``data.num_workers``; a :class:`vitlab.callbacks.RuntimeCallback` runs the figure worker and
      keeps what a resumed run needs in each checkpoint. Older configs' keys (``data.num_workers``) are read as
      their new ones with one warning (:func:`vitlab.cli_support.move_old_keys`).
    - Every run lives in ``<save_dir>/<name>/<version>/`` (TensorBoard events, ``config.yaml``,
      ``checkpoints/`` with best + last); resuming from ``.../checkpoints/last.ckpt`` appends to the same
      run folder.
    """

    def __init__(self, *args: Any, task: str = "classification", **kwargs: Any) -> None:
        self.task = task
        super().__init__(*args, **kwargs)

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        self.parser_class = cli_support.parser_class()  # unknown keys: one line each, closest valid key
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if args is None:  # --config quickstart -> configs/quickstart.yaml
            sys.argv[1:] = cli_support.resolve_config_args(sys.argv[1:])
        elif isinstance(args, list):
            args = cli_support.resolve_config_args(args)
        if args is None:
            sys.argv[1:] = cli_support.move_old_keys(sys.argv[1:])
        else:
            args = cli_support.move_old_keys(args)
        super().parse_arguments(parser, args)

    def instantiate_classes(self) -> None:
        super().instantiate_classes()
        self._recipe[RECORD_KEY] = self.model.run_record(self.datamodule)  # what built the run, as its checkpoints say
        cli_support.save_recipe(self.trainer, self._recipe)  # config.yaml repeats the run, never re-resumes
        from vitlab.callbacks import RuntimeCallback

        # first: its epoch-start hook restores a resumed run's random streams before any other callback draws
        self.trainer.callbacks.insert(0, RuntimeCallback(self.runtime.figures, self.runtime.workers))
        configured = [str(getattr(c, "class_path", c)) for c in (self.config.trainer.get("callbacks") or [])]
        if not any("ProgressBar" in name for name in configured):
            _progress_bar_at_log_steps(self.trainer)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--task",
            type=str,
            default="classification",
            help=f"What to train: {', '.join(TASKS)} (read before parsing; picks the model and data classes)",
        )
        parser.add_class_arguments(Runtime, "runtime", help="How the run uses the machine (threads, loader workers, figures)")
        parser.add_argument(
            f"--{RECORD_KEY}",
            type=Optional[dict],
            default=None,
            help="What built the run (task, network call, data class and arguments; see vitlab.runs): written into the "
            "run's config.yaml for probe.py; a value given is replaced",
        )
        parser.link_arguments(("runtime.workers", "trainer.accelerator"), "data.num_workers", compute_fn=_workers, apply_on="parse")
        parser.add_argument(
            "--ckpt_path",
            type=Optional[str],
            default=None,
            help="Resume training from this checkpoint, e.g. runs/quickstart/version_0/checkpoints/last.ckpt",
        )
        # Two checkpointers: the best by a validation metric, and "last.ckpt" rewritten every epoch
        # (Lightning 2.6 only refreshes save_last when a top-k file is saved, so it cannot be relied on).
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.add_lightning_class_args(ModelCheckpoint, "last_checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": TASKS[self.task][2],
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 1,
                "checkpoint.filename": "best-epoch{epoch:03d}",
                "checkpoint.auto_insert_metric_name": False,
                # save after every callback's on_train_epoch_end, so checkpoints hold their finished epoch
                "checkpoint.save_on_train_epoch_end": True,
                "last_checkpoint.monitor": None,
                "last_checkpoint.save_top_k": 1,
                "last_checkpoint.filename": "last",
                "last_checkpoint.enable_version_counter": False,
                "last_checkpoint.save_on_train_epoch_end": True,
            }
        )
        if TASKS[self.task][1] is MedicalDataModule:  # classification, DINO: image labels
            parser.link_arguments("data.num_classes", "model.num_classes", apply_on="instantiate")
            parser.link_arguments("data.class_names", "model.class_names", apply_on="instantiate")
        else:  # dense tasks: the mask classes, and the input size for the detector's transform
            parser.link_arguments("data.num_mask_classes", "model.num_classes", apply_on="instantiate")
            parser.link_arguments("data.mask_classes", "model.class_names", apply_on="instantiate")
            parser.link_arguments("data.image_size", "model.image_size", apply_on="instantiate")
        parser.link_arguments("data.in_chans", "model.in_chans", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        unlabelled = (self.config.get("data") or {}).get("unlabelled_root")
        if unlabelled and self.task != "dino":
            raise ValueError(f"data.unlabelled_root {unlabelled} adds images without labels: task {self.task} cannot "
                             "learn from them (self-supervised pretraining: task: dino)")
        gpu = _trains_on_gpu(self.config.trainer.get("accelerator"))
        self.runtime = Runtime(**self.config.runtime).resolved(gpu)
        self.runtime.apply()
        prepare_training((self.config.get("data") or {}).get("sample"))  # freed memory kept for 3-D volumes
        nvml_cuda_check()  # no failed NVML search at every optimiser step on a machine without NVIDIA's driver
        self.runtime_line = self.runtime.describe(available_cores(), gpu)  # printed once the run is set up
        self._recipe = cli_support.clean_recipe(self.config)
        self._recipe.runtime.threads, self._recipe.runtime.workers = self.runtime.threads, self.runtime.workers
        self._recipe.runtime.tf32 = self.runtime.tf32  # (auto resolved on a GPU: its products are part of the numbers)
        ckpt_path = self.config.get("ckpt_path")
        if not ckpt_path:
            return
        ckpt = Path(ckpt_path)
        if not ckpt.is_file():
            raise FileNotFoundError(f"--ckpt_path {ckpt_path}: no such checkpoint file")
        recorded = runs.recorded_task(ckpt)
        if recorded is not None and recorded != self.task:
            raise ValueError(f"--ckpt_path {ckpt_path}: a {recorded} checkpoint; this config trains {self.task} "
                             f"(resume it with task: {recorded})")
        logger = self.config.trainer.get("logger")
        version_dir = runs.run_folder(ckpt)
        if version_dir is not None and logger is not None and not isinstance(logger, bool):
            # runs/<name>/<version>/checkpoints/last.ckpt -> log into runs/<name>/<version> again
            init = logger.init_args if hasattr(logger, "init_args") else logger
            init.save_dir = cli_support.resume_save_dir(ckpt, version_dir)
            init.name = version_dir.parent.name
            init.version = version_dir.name


def _trains_on_gpu(accelerator: Any) -> bool:
    """Whether ``trainer.accelerator`` trains on a GPU here (``auto``: when one is present)."""
    name = str(getattr(accelerator, "__name__", accelerator) or "auto").lower()
    if name in ("cpu", "cpuaccelerator"):
        return False
    import torch

    return torch.cuda.is_available()


def _workers(workers: Any, accelerator: Any) -> int:
    """``data.num_workers`` from ``runtime.workers`` (``auto`` resolved for this machine)."""
    return Runtime(workers=workers).resolved(_trains_on_gpu(accelerator)).workers


def _progress_bar_at_log_steps(trainer) -> None:
    """Lightning's default progress bar reads the logged loss off the device after every step: on a GPU the host
    waits there for the step to finish before it launches the next one. The default bar is replaced by one that reads
    it every ``log_every_n_steps`` steps (when the logger reads it anyway): Rich's by
    :class:`~vitlab.callbacks.LogStepProgressBar`, tqdm's by one that redraws at those steps. A bar the config names
    is kept as it is."""
    from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar

    from vitlab.callbacks import LogStepProgressBar

    bar = trainer.progress_bar_callback
    if type(bar) is RichProgressBar:  # (also when the logger reads every step: its redraws at 100 a second cost too)
        replacement = LogStepProgressBar()
    elif type(bar) is TQDMProgressBar and bar.refresh_rate == 1 and trainer.log_every_n_steps > 1:
        replacement = TQDMProgressBar(refresh_rate=trainer.log_every_n_steps)
    else:
        return
    trainer.callbacks[trainer.callbacks.index(bar)] = replacement


def _trainer_defaults() -> dict[str, Any]:
    return {
        "logger": {
            "class_path": TENSORBOARD_LOGGER,
            "init_args": {"save_dir": "runs", "name": "vitlab", "default_hp_metric": False},
        },
        "log_every_n_steps": 10,
    }


def _report(log_dir: Path | None, checkpoints: list[tuple[Any, str, Any]]) -> None:
    """The closing lines (rank 0 alone: no collective here, such as ``trainer.log_dir`` under a distributed strategy);
    ``checkpoints`` = (monitor, path, score) per checkpointer, taken before testing (testing the best checkpoint
    restores the checkpointers' state as it was when that file was written)."""
    log_dir = log_dir or Path(".")
    root = log_dir.parent.parent if log_dir.parent.parent != Path("") else log_dir
    print("\nvitlab: run finished.")
    print(f"  run folder   : {log_dir}")
    for monitor, path, score in checkpoints:
        if not path:
            continue
        if monitor is None:
            print(f"  last weights : {path}  (resume: --ckpt_path {path})")
        else:
            note = f"  ({monitor} = {float(score):.4f})" if score is not None else ""
            print(f"  best weights : {path}{note}")
    print(f"  view it with : tensorboard --logdir {root} --host 127.0.0.1")


def fit(args: list[str] | dict[str, Any] | None = None) -> VitlabCLI:
    """Parse a train config, fit, test when a test split exists, and return the CLI (trainer, model, data).

    With ``--study``: run a grid of such fits instead and return its record (:mod:`vitlab.study`)."""
    cli_support.quiet_output()
    from vitlab import study
    from vitlab.outputs.tensorboard import fast_event_checksums

    fast_event_checksums()

    if not isinstance(args, dict) and study.requested(list(sys.argv[1:] if args is None else args)):
        return study.run_study(list(sys.argv[1:] if args is None else args), fit)
    task = _task_of(args)
    model_class, data_class, _ = TASKS[task]
    return _fit(task, model_class, data_class, args)


def _fit(task: str, model_class: type, data_class: type, args: list[str] | dict[str, Any] | None) -> VitlabCLI:
    cli = VitlabCLI(
        model_class,
        data_class,
        task=task,
        run=False,
        trainer_defaults=_trainer_defaults(),
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Fine-tune a Vision Transformer on medical images (vitlab).", "epilog": cli_support.configs_help()},
        args=args,
    )
    if cli.trainer.is_global_zero:
        print(cli.runtime_line, file=sys.stderr)
    cli_support.without_validation(cli.trainer, cli.datamodule)  # unlabelled images, val_fraction 0
    if cli.config.get("ckpt_path"):
        from vitlab.outputs.tensorboard import purge_after_checkpoint

        purge_after_checkpoint(cli.trainer, cli.config.get("ckpt_path"))  # no duplicate points after a kill
    log_dir = Path(cli.trainer.log_dir) if cli.trainer.log_dir else None
    existed = log_dir is not None and log_dir.exists()
    try:
        with frozen_heap():  # start-up objects skip the full garbage collections of the fit
            cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))
    except BaseException:
        if cli.trainer.is_global_zero:  # leave no stub version_N folder for TensorBoard to list
            cli_support.remove_stub_run(log_dir, existed, cli.trainer.global_step)
        raise
    checkpoints = [(cb.monitor, cb.best_model_path, cb.best_model_score) for cb in cli.trainer.checkpoint_callbacks]
    has_test_step = is_overridden("test_step", cli.model)  # DINO has no test step
    if getattr(cli.datamodule, "has_test", False) and has_test_step and not cli.trainer.interrupted:
        best = cli.trainer.checkpoint_callback and cli.trainer.checkpoint_callback.best_model_path
        cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path="best" if best else None)
    if cli.trainer.is_global_zero:
        _report(log_dir, checkpoints)
    return cli


def _task_of(args: list[str] | dict[str, Any] | None) -> str:
    """The ``task`` a command line / config dict / config file asks for (classification by default)."""
    import yaml

    task = None
    if isinstance(args, dict):
        task = args.get("task")
    else:
        argv = cli_support.resolve_config_args(list(sys.argv[1:] if args is None else args))  # --config NAME: shipped
        for i, arg in enumerate(argv):
            value = arg.split("=", 1)[1] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else None)
            if arg.split("=", 1)[0] in ("--config", "-c") and value and Path(value).is_file():
                content = yaml.safe_load(Path(value).read_text()) or {}
                task = content.get("task", task) if isinstance(content, dict) else task
            elif arg.split("=", 1)[0] == "--task":
                task = value
    task = task or "classification"
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {list(TASKS)}")
    return task


def train_main(args: list[str] | None = None) -> None:
    """Entry point of ``train.py``: :func:`fit` with one-line errors for bad input."""
    cli_support.quiet_output(one_line_warnings=True)
    try:
        fit(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        _exit_with_message(err)
