"""``probe.py``: the seed papers' probes on any checkpoint, one subcommand each.

``python probe.py --ablate attention`` (no subcommand) runs the ablation survey; ``python probe.py SUB --help``
explains each subcommand with an example.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys

import torch

# subcommand -> module in vitlab.probes (imported lazily so `--help` stays fast)
SUBCOMMANDS: dict[str, str] = {
    "drift": "vitlab.probes.drift",
    "ablate": "vitlab.probes.ablate",
    "invert": "vitlab.probes.invert",
    "visualize": "vitlab.probes.visualize",
    "filters": "vitlab.probes.filters",
    "transplant": "vitlab.probes.transplant",
    "mi": "vitlab.probes.mi",
    "stats": "vitlab.probes.stats",
    "attention": "vitlab.probes.attention",
    "spectra": "vitlab.probes.spectra",
    "features": "vitlab.probes.features",
}


def _available() -> dict[str, object]:
    found = {}
    for name, module in SUBCOMMANDS.items():
        try:
            found[name] = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="probe.py",
        description="Probe a Vision Transformer checkpoint (vitlab). `probe.py --ablate attention` = `probe.py ablate --ablate attention`.",
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    for name, module in _available().items():
        sub = subparsers.add_parser(name, help=module.HELP.splitlines()[0], description=module.HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse, load the model, run the subcommand; Ctrl-C keeps what is finished."""
    from torch.utils.tensorboard import SummaryWriter

    from vitlab.probes.common import ProbeContext, load_model, newest_checkpoint, prepare_out

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--ablate"):
        argv.insert(0, "ablate")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.subcommand is None:
        parser.print_help()
        sys.exit(2)
    module = importlib.import_module(SUBCOMMANDS[args.subcommand])
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if getattr(module, "LOADS_MODEL", True) and all(getattr(args, k, None) is None for k in ("checkpoint", "config", "model")):
        args.checkpoint = newest_checkpoint()
        print(f"probe.py {args.subcommand}: no model given, using the newest run's checkpoint {args.checkpoint}", file=sys.stderr)
    if hasattr(module, "fill_defaults"):
        module.fill_defaults(args)
    loaded = load_model(args, device=str(device)) if getattr(module, "LOADS_MODEL", True) else None
    name = getattr(module, "out_name", lambda a, m: (m.run or m.name) if m else args.subcommand)(args, loaded)
    out = prepare_out(args.out, args.subcommand, name, args.overwrite)
    writer = SummaryWriter(log_dir=str(out))
    ctx = ProbeContext(args=args, subcommand=args.subcommand, out=out, device=device, writer=writer, loaded=loaded)
    try:
        module.run(ctx)
    except KeyboardInterrupt:
        writer.close()
        print(f"\nprobe.py {args.subcommand}: interrupted; finished results are kept in {out}", file=sys.stderr)
        sys.exit(130)
    except BaseException:
        writer.close()
        if not any(p for p in out.iterdir() if not p.name.startswith("events.out.tfevents")):
            shutil.rmtree(out)  # nothing but an empty event file: leave no folder that blocks a rerun
        raise
    writer.close()
    print(f"probe.py {args.subcommand}: results in {out}\n  view them with: tensorboard --logdir {out} --host 127.0.0.1")
