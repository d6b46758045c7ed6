"""The DeepSeek family: V3 (`v3`), V3.2 (`v32`), V4 (`v4`), V4.1 (`v41`, with its Engram layers in `engram`), the
packs' own drafters (`mtp`) and the V4 reference's fake quantisation (`quant`). The families register themselves in
`fidelity.registry.ARCHITECTURES`; nothing is imported here."""
