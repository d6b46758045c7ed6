"""Test support, not part of the installed package: miniature DeepSeek-V4/V4.1 packs (`minipacks_v4`, `minipacks_v41`),
the on-the-fly synthetic Llama pack (`synthetic`), raw GGUF files (`raw_gguf`) and the fault-injecting toy server
(`faults`). Tests and benchmarks import it from the repository root; nothing in `fidelity` does
(tests/test_import_graph.py). Pack writers the demo and `fidelity plan` use are product code: fidelity/packs/writers.py,
fidelity/packs/exl3/."""
