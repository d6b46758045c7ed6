"""Measuring a pack against its reference: `compare` (the pipeline: oracle logits -> per-position metrics -> report),
`store` (reference stores), `metrics` and `metrics_triton` (KL, top-k, the fused kernels), `stats` (summaries over rows
and domains, built on `bootstrap` and `intervals`). The panels it scores on are in `fidelity.panels`."""
