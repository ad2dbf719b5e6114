#!/usr/bin/env python
"""Probe a checkpoint: ``python probe.py drift --reference A --finetuned B`` (``--help`` lists subcommands)."""

from vitlab.probe_cli import probe_main

if __name__ == "__main__":
    probe_main()
