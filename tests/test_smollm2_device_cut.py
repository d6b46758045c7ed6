"""The SmolLM2 cut for the device machine (tests/fixtures/smollm2_device_cut.py): the first blocks of the real GGUF,
every kept tensor's stored bytes and every metadata value as in the original (block_count aside), and it opens,
tokenizes and runs like the model it came from."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
import smollm2_device_cut  # noqa: E402


@pytest.mark.slow
def test_cut_keeps_the_first_blocks_bytes_and_metadata(smollm2_gguf, tmp_path):
    import gguf
    from transformers import AutoTokenizer

    from fidelity import open_pack
    from fidelity.oracle import Oracle

    out = smollm2_device_cut.cut(smollm2_gguf, tmp_path / "cut.gguf", 2)
    src, dst = gguf.GGUFReader(str(smollm2_gguf)), gguf.GGUFReader(str(out))
    assert set(dst.fields) == set(src.fields)
    for key, field in src.fields.items():
        if key in ("GGUF.tensor_count", "GGUF.kv_count", "llama.block_count"):
            continue
        assert dst.fields[key].contents() == field.contents(), key
    assert dst.fields["llama.block_count"].contents() == 2
    kept = [t for t in src.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < 2]
    assert [t.name for t in dst.tensors] == [t.name for t in kept] and len(kept) == 2 + 2 * 9
    for a, b in zip(kept, dst.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert np.array_equal(np.asarray(a.data).view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name

    pack = open_pack(out)
    assert pack.config["num_hidden_layers"] == 2
    text = "The oracle is the fixed point every pack and every kernel is measured against. " * 3
    ids = [AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)(text)["input_ids"] for p in (smollm2_gguf, out)]
    assert ids[0] == ids[1]
    logits = Oracle(pack).logits(torch.tensor([ids[1][:24]]))
    assert logits.shape == (1, 24, 49152) and torch.isfinite(logits).all()
    assert logits.std() > 1                        # a real head over real hidden states, not zeros
