"""``python -m vitlab.data.synthetic --out DIR [--volumes] [--seed ...]`` (see :func:`vitlab.data.synthetic.main`)."""

from vitlab.data.synthetic import main

main()
