"""Files that used to end in a traceback (issue 16) are clear errors naming the file and the item: safetensors headers
that are valid JSON of the wrong shape, negative or reversed data_offsets (which the safetensors library refuses too),
a panel that is not UTF-8."""
import json
import struct

import pytest

from fidelity.errors import PackError
from fidelity.packs.safetensors_io import SafetensorsFile


def _raw(path, header, data: bytes = b"\0" * 8):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


@pytest.mark.parametrize(
    "header,pattern",
    [
        ([1, 2, 3], r"header is not a JSON object \(got list\)"),
        (
            {"__metadata__": [1], "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            r"__metadata__ is not an object",
        ),
        ({"w": [0, 8]}, r"header entry is not an object \(got list\) \[tensor 'w'"),
        ({"w": {"dtype": "F32", "shape": [2]}}, r"header entry lacks data_offsets \[tensor 'w'"),
        (
            {"w": {"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}},
            r"shape '2' is not a list of non-negative integers",
        ),
        ({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, r"shape \[2.0\] is not a list"),
        ({"w": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}}, r"dtype 7 is not a string"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, r"data_offsets \[0\] is not two integers"),
        (
            {"w": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}},
            r"data_offsets \['0', '8'\] is not two integers",
        ),
    ],
)
def test_schema_invalid_headers_are_named(tmp_path, header, pattern):
    f = _raw(tmp_path / "bad.safetensors", header)
    with pytest.raises(PackError, match=pattern) as e:
        SafetensorsFile(f)
    assert str(f) in str(e.value)


@pytest.mark.parametrize("offsets", [[-8, 0], [8, 0]])
def test_negative_or_reversed_data_offsets_are_refused_like_safetensors_does(tmp_path, offsets):
    from safetensors import safe_open
    span = offsets[1] - offsets[0]
    f = _raw(tmp_path / "neg.safetensors", {"w": {"dtype": "F32", "shape": [abs(span) // 4],
                                                   "data_offsets": offsets}}, b"\0" * 16)
    with pytest.raises(Exception):   # the reference library refuses the file too
        with safe_open(str(f), "pt") as g:
            g.get_tensor("w")
    with pytest.raises(
        PackError, match=r"data_offsets .* are negative or out of order \[tensor 'w', file .*neg\.safetensors\]"
    ):
        SafetensorsFile(f)


def test_a_panel_that_is_not_utf8_names_file_and_line(tmp_path):
    from fidelity.panels.panel import PanelError, load_panel
    p = tmp_path / "panel.jsonl"
    p.write_bytes(b'{"id": "a", "domain": "d", "text": "fine"}\n{"id": "b", "domain": "d", "text": "caf\xe9"}\n')
    with pytest.raises(PanelError, match=rf"{p} line 2: not UTF-8 text \(byte 0xe9 at offset \d+\)"):
        load_panel(p)
