"""The contracts every layer agrees on: the activation table (``activations``), the dropout RNG spec
(``rng``), what a call and a backend are (``backend``), what an op is (``op``), how a call runs on a
backend's kernels (``running``), the argument checks the specs share (``checks``), real models'
feature sizes (``shapes``), the per-dtype tolerances (``tolerances``) and the compile lock and cache
the compiling backends share (``compiled``).

The layers, as ``tests/test_layers.py`` checks them: the contracts import nothing else of ours; an op's
spec (``dispatch/ops``) imports the contracts and the ``dispatch.ops`` package; backends and the
heuristics import the contracts and the op specs (a backend may build on the reference backend,
eager); the dispatcher, API, nn, patch and CLIs sit above."""
