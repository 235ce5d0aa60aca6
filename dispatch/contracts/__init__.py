"""The contracts every layer agrees on, importing nothing else of ours: the activation table
(``activations``), the dropout RNG spec (``rng``), what a call and a backend are (``backend``), real
models' feature sizes (``shapes``) and the per-dtype tolerances (``tolerances``). Backends and the
heuristics import only these; the dispatcher, API, nn, patch and CLIs sit above."""
