"""Panels, the rows a pack is scored on: `panel` (rows, panel folders, loading from files and datasets, chat rendering
and tokenizing), `text` (fixed-length token rows cut from text), `encoding` (rows rendered by a pack's own encoder
code), `build` (prompts answered by a served engine, journaled) and `check` (n-gram overlap with suite and calibration
texts). `panel`, `text` and `encoding` sit with measuring, which reads panels; `build` and `check` use the engine client
and the suites, so they sit in that layer (tests/test_import_graph.py)."""
