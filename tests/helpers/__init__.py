"""What several test modules share (no test module imports another): :mod:`tests.helpers.runs` (tiny train.py runs,
TensorBoard events read back), :mod:`tests.helpers.volumes` (tiny 3-D run folders), :mod:`tests.helpers.models`
(hand oracles, tiny Hugging Face models), :mod:`tests.helpers.probes` (probe.py's arguments and outputs) and
:mod:`tests.helpers.data` (planted images, manifests). Fixtures live in ``tests/conftest.py`` and
``tests/probes/conftest.py``."""
