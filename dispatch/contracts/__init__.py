"""The contracts every layer agrees on, importing nothing else of ours: the activation table
(``activations``), the dropout RNG spec (``rng``), what a call and a backend are (``backend``), real
models' feature sizes (``shapes``), the per-dtype tolerances (``tolerances``) and the compile lock
and cache the compiling backends share (``compiled``). Backends and the heuristics import only these;
the dispatcher, API, nn, patch and CLIs sit above."""
