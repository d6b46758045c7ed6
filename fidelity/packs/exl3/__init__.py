"""EXL3 (exllamav3 trellis) packs: `codec` decodes a stored linear bit for bit, `layouts` recognises the five pack
layouts and claims their tensors, `encoder` is the reference encoder and `writer` writes packs in those layouts."""
