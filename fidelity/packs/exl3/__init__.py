"""EXL3 (exllamav3 trellis) packs: `codec` decodes a stored linear bit for bit, `layouts` recognises the five pack
layouts and claims their tensors. The reference encoder is a fixture writer: fidelity/fixtures/exl3_encoder.py."""
