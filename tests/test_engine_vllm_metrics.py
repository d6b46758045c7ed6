"""fidelity.engine.vllm's reading of vLLM's Prometheus text, on written-out expositions (the real endpoint is read
against prometheus_client's parser in tests/test_engine_vllm.py), and its errors naming the line."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fidelity.engine.vllm import VllmServe, facts_from_metrics, parse_prometheus
from fidelity.errors import FidelityError


def test_samples_labels_escapes_and_special_values():
    text = ('# HELP x A counter.\n# TYPE x counter\n'
            'x_total{engine="0",model_name="a \\"b\\" c\\\\d"} 3.0\n'
            'h_bucket{le="+Inf"} 7 1700000000000\n'
            'g NaN\n\n'
            'neg{a="1",} -2.5e-3\n')
    s = parse_prometheus(text)
    assert [x.name for x in s] == ["x_total", "h_bucket", "g", "neg"]
    assert s[0].labels == {"engine": "0", "model_name": 'a "b" c\\d'} and s[0].value == 3.0
    assert s[1].labels == {"le": "+Inf"} and s[1].value == 7.0  # the timestamp is not the value
    assert math.isnan(s[2].value) and s[3].labels == {"a": "1"} and s[3].value == -2.5e-3


@pytest.mark.parametrize("line, says", [("vllm:x{engine=0} 1", "line 2: cannot read the labels"),
                                        ("vllm:x{engine=\"0\"} one", "line 2: value 'one' is not a number"),
                                        ("{engine=\"0\"} 1", "line 2 is not a Prometheus sample")])
def test_a_line_that_is_no_sample_is_named(line, says):
    with pytest.raises(FidelityError, match=says):
        parse_prometheus("# TYPE vllm:x counter\n" + line + "\nvllm:y 2\n")


def test_facts_and_speculative_acceptance(rng_seed):
    rng = np.random.default_rng(rng_seed)
    drafts = int(rng.integers(10, 100))
    per = sorted(rng.integers(0, drafts + 1, size=3).tolist(), reverse=True)
    lines = ['vllm:cache_config_info{block_size="128",kv_cache_size_tokens="46592",kv_cache_memory_bytes="2147483648",'
             'num_gpu_blocks="364",num_cpu_blocks="None"} 1.0',
             'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 256.0',
             'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 421.0',
             f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}',
             f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {3 * drafts}',
             f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {sum(per)}']
    # positions out of order in the text, as a label says which is which
    lines += [
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {per[i]}' for i in (2, 0, 1)
    ]
    f = facts_from_metrics(parse_prometheus("\n".join(lines)))
    assert (f.kv_cache_tokens, f.kv_cache_bytes, f.block_size, f.kv_blocks) == (46592, 2**31, 128, 364)
    assert (f.prefix_cache_hits, f.prefix_cache_queries) == (256.0, 421.0)
    s = f.spec_decode.summary()
    assert f.spec_decode.accepted_per_position == per
    assert s["mean_accepted_length"] == pytest.approx(1 + sum(per) / drafts, rel=1e-15)
    assert s["first_draft_acceptance"] == pytest.approx(per[0] / drafts, rel=1e-15)
    assert s["acceptance_per_position"] == pytest.approx([a / drafts for a in per], rel=1e-15)
    assert s["draft_acceptance_rate"] == pytest.approx(sum(per) / (3 * drafts), rel=1e-15)
    later = facts_from_metrics(parse_prometheus("\n".join(lines).replace(f"}} {drafts}\n", f"}} {drafts + 5}\n")))
    assert later.spec_decode.minus(f.spec_decode).drafts == 5
    assert facts_from_metrics(parse_prometheus(lines[1])).spec_decode is None  # no drafter, no counters


def test_serve_command_carries_what_the_gates_need():
    cmd = VllmServe("/m", "smol", python="/venv/bin/python", kv_cache_gib=2, enforce_eager=True,
                    speculative={"model": "/d", "num_speculative_tokens": 3}).command(8001)
    assert cmd[:3] == ["env", "VLLM_CPU_KVCACHE_SPACE=2", "/venv/bin/python"]
    assert cmd[cmd.index("--max-logprobs") + 1] == "20" and cmd[cmd.index("--port") + 1] == "8001"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"} <= set(cmd)
    assert cmd[cmd.index("--speculative-config") + 1] == '{"model": "/d", "num_speculative_tokens": 3}'
    assert "--no-enable-prefix-caching" in VllmServe("/m", prefix_caching=False).command(1)
