"""``probe.py``: the probes of the papers behind vitlab on any checkpoint, one subcommand each.

``python probe.py --ablate attention`` (no subcommand) runs the ablation survey; ``python probe.py SUB --help``
explains each subcommand with an example.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import shutil
import sys
from pathlib import Path

import torch

from vitlab.cli_support import program_name

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
    "claims": "vitlab.probes.claims",
}


def _summary(module: str) -> str | None:
    """The subcommand's HELP text read from its source without importing it (None: module absent)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "HELP" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{module}: a probe subcommand module needs a HELP string")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``probe.py`` parser; with ``argv``, only the subcommand it names is imported (fast `--help` and start-up).

    Every subcommand is listed with its HELP (read from the module's source); its options are added by importing
    its module, for all of them when ``argv`` is None, else for the one ``argv[0]`` names.
    """
    parser = argparse.ArgumentParser(
        prog=program_name("probe.py"),  # vitlab-probe when installed
        description="Probe a Vision Transformer checkpoint (vitlab). `%(prog)s --ablate attention` = `%(prog)s ablate --ablate attention`.",
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
    chosen = argv[0] if argv else None
    for name, module in SUBCOMMANDS.items():
        text = _summary(module)
        if text is None:
            continue
        sub = subparsers.add_parser(name, help=text.splitlines()[0], description=text, formatter_class=argparse.RawDescriptionHelpFormatter)
        if argv is None or name == chosen:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse, load the model, run the subcommand; Ctrl-C keeps what is finished."""
    from torch.utils.tensorboard import SummaryWriter

    from vitlab.probes.common import ProbeContext, prepare_out
    from vitlab.probes.loading import load_model
    from vitlab.runs import newest_checkpoint

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].startswith("--ablate"):
        argv.insert(0, "ablate")
    parser = build_parser(argv)
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
    from vitlab.outputs.tensorboard import fast_event_checksums

    fast_event_checksums()
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
