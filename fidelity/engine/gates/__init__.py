"""Engine gates: each an async function of an `EngineClient` returning a `GateResult` (measured values, thresholds,
pass/fail, worst examples). A gate that cannot get valid answers from the engine returns status "error", never "pass" or
"fail".

- `oracle_kl.py`: the engine's prompt logprobs on the reference store's panel vs the oracle's exact distributions.
- `invariance.py`: batch-invariance, decode-vs-prefill and prefix-cache, the engine against itself.
- `echo.py`: when oracle-kl or decode-vs-prefill fails, whether the engine's echo logprobs are shifted.
- `settings.py`: thresholds, the evidence a verdict needs, `GateSettings`, `GateResult`; `logprobs.py`: comparing
  logprobs.
- `kinds.py`: `@gate_kind` registers a gate's runner in `fidelity.registry.GATES` under its gate.toml section;
  `config.py` reads gate.toml and runs the selected gates (`fidelity gate`, the tuning ladder).
"""
