"""``probe.py``'s entry point and the one-line user errors both command lines share.

Kept free of Lightning (and of every probe's own imports): ``probe.py --help`` imports only this module and
:func:`vitlab.probes.build_parser`, and a probe imports just its subcommand's module.
"""

from __future__ import annotations

import os
import sys


def _exit_with_message(err: BaseException) -> None:
    """User errors end in one line (``VITLAB_DEBUG=1`` shows the traceback)."""
    if os.environ.get("VITLAB_DEBUG") or not _is_user_error(err):
        raise err
    print(f"vitlab: error: {err}", file=sys.stderr)
    sys.exit(2)


def _is_user_error(err: BaseException) -> bool:
    module = type(err).__module__ or ""
    return module.startswith("vitlab") or type(err) in (ValueError, FileNotFoundError, FileExistsError)


def probe_main(args: list[str] | None = None) -> None:
    """Entry point of ``probe.py``."""
    from vitlab.runtime import prepare_process

    prepare_process()  # before torch is imported
    from vitlab import cli_support
    from vitlab.probes import main

    cli_support.quiet_output(one_line_warnings=True)
    try:
        main(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as err:
        _exit_with_message(err)
