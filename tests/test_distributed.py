"""The oracle across 2 processes (torch.distributed, gloo on CPU): row parallel and expert parallel equal the
single-process oracle exactly (torch.equal); a rank that dies or raises fails the run with that rank named."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import traceback
from pathlib import Path

import pytest
import torch
import transformers as T

from fidelity import open_pack
from fidelity.errors import FidelityError, PackError
from fidelity.oracle import LoadChain, Oracle, parallel, runner
from fidelity.oracle.parallel import Prefetcher, RunSettings
from test_oracle import COMMON, MOE, make_moe
from test_oracle_support import build

WORLD = 2
# The ranks' device: "cpu" (gloo, CI) or "cuda" (NCCL, one GPU per rank; tests/test_oracle_cuda.py sets it on the
# device)
DEVICE_VAR = "FIDELITY_DIST_TEST_DEVICE"


def rank_device() -> torch.device:
    return parallel.local_device(os.environ.get(DEVICE_VAR, "cpu"))
SMALL_BATCH_TOKENS = 40  # several batches per row length, some partial: exercises the deal and the regrouping
# Each rank runs with one torch thread (as torchrun's OMP_NUM_THREADS=1 gives it), so one process is run with one thread
# too: the bit-equality claim is "same thread count per process". MKL's strict CNR mode does not make a float32 GEMM
# with
# few rows per thread independent of the thread count on AMD EPYC (tests/test_blas.py measures it; DEVELOPERS.md).
RANK_THREADS = 1


@contextlib.contextmanager
def rank_threads():
    """This process at the ranks' torch thread count, restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def without_command_line(path) -> str:
    """The report's text with the one field that names how it was launched (its command line) removed."""
    report = json.loads(path.read_text())
    assert report.pop("command_line").startswith("fidelity compare ")
    return json.dumps(report, indent=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, job: str, root: str) -> None:
    """One rank of a test run: the launcher's environment, then `job`; results and errors go to root/<job>.<rank>.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(RANK_THREADS)
    if os.environ.get("FIDELITY_DIST_TEST_DUMP_S"):  # a rank that hangs prints every thread's stack, then exits
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["FIDELITY_DIST_TEST_DUMP_S"]), exit=True)
    runner.BATCH_TOKENS = SMALL_BATCH_TOKENS
    out = Path(root) / f"{job}.{rank}.pt"
    try:
        result = JOBS[job](rank, Path(root))
        parallel.finish()
        torch.save({"ok": result}, out)
    except BaseException as e:
        parallel.finish(e)
        torch.save({"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}, out)


def _reads(pack) -> list[str]:
    """Names this process reads from `pack` from now on (recorded as `pack.tensor` is called)."""
    read = []
    original = pack.tensor
    pack.tensor = lambda name, original=original, **where: (read.append(name), original(name, **where))[1]
    return read


def _equal_job(rank: int, root: Path) -> dict:
    inputs = torch.load(root / "inputs.pt")
    pack = open_pack(root / "llama")
    read = _reads(pack)
    llama = parallel.make_oracle(pack, rank_device(), RunSettings(parallel="rows"))
    result = {"llama_logits": llama.logits(inputs["tokens"]),
              "llama_hidden": llama.hidden_states(inputs["rows"], progress=False),
              "llama_one_batch": llama.logits(inputs["tokens"][:2]),  # one batch: rank 1 has no rows, reads its share
              "llama_layers_read": [n for n in read if ".layers." in n]}
    for case in inputs["moe_cases"]:
        pack = open_pack(root / case)
        read = []
        original = pack.tensor
        pack.tensor = lambda name, original=original, **where: (read.append(name), original(name, **where))[1]
        oracle = parallel.make_oracle(pack, rank_device(), RunSettings(parallel="experts"))
        result[case] = oracle.logits(inputs["moe_tokens"])
        result[f"{case}_experts_read"] = sorted({n.split(".experts.")[0] + "." + n.split(".experts.")[1].split(".")[0]
                                                 for n in read if ".experts." in n})
    return result


def _killed_job(rank: int, root: Path) -> dict:
    def dying(i, layer):
        if i == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return layer
    oracle = parallel.make_oracle(open_pack(root / "llama"), rank_device(), RunSettings(parallel="rows", stale_s=3.0),
                                  layer=(dying,) if rank == 1 else ())
    return {"logits": oracle.logits(torch.load(root / "inputs.pt")["tokens"])}


def _raising_job(rank: int, root: Path) -> dict:
    def poisoned(i, layer):  # rank 1's layer 1 turns its rows' activations to NaN
        return (lambda *args: layer(*args) * float("nan")) if i == 1 else layer
    oracle = parallel.make_oracle(open_pack(root / "llama"), rank_device(), RunSettings(parallel="rows"),
                                  layer=(poisoned,) if rank == 1 else ())
    return {"logits": oracle.logits(torch.load(root / "inputs.pt")["tokens"])}


def _bad_share_job(rank: int, root: Path) -> dict:
    """Rank 1 cannot decode the layer-1 tensors it reads for everyone."""
    pack = open_pack(root / "llama")
    if rank == 1:
        original = pack.tensor

        def broken(name, **where):
            if ".layers.1." in name:
                raise PackError("block 7 has a corrupt scale", file=pack.path, tensor=name)
            return original(name, **where)
        pack.tensor = broken
    oracle = parallel.make_oracle(pack, rank_device(), RunSettings(parallel="rows"))
    return {"logits": oracle.logits(torch.load(root / "inputs.pt")["tokens"])}


JOBS = {"equal": _equal_job, "killed": _killed_job, "raising": _raising_job, "bad_share": _bad_share_job}


def run_ranks(job: str, root: Path, timeout: float = 240) -> list[dict]:
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, job, str(root))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    for p in procs:
        if p.is_alive():
            p.kill()
            pytest.fail(f"rank process {p.pid} of job {job} hung")
    return [
        torch.load(root / f"{job}.{r}.pt", map_location="cpu") if (root / f"{job}.{r}.pt").exists() else None
        for r in range(WORLD)
    ]


MOE_CASES = ["qwen3moe-renorm-sparse-step", "deepseek-v3-qlora-yarn"]


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"distributed packs seed {seed}")
    root = tmp_path_factory.mktemp("dist")
    build(T.LlamaConfig(**{**COMMON, "tie_word_embeddings": False}), T.LlamaForCausalLM, root / "llama", seed)
    for case in MOE_CASES:
        make_moe(root, case, seed)
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 7, 7, 7, 7, 7, 13, 5, 13, 7, 5]
    inputs = {"tokens": torch.randint(0, COMMON["vocab_size"], (9, 11), generator=g),
              "rows": [torch.randint(0, COMMON["vocab_size"], (n,), generator=g).tolist() for n in lengths],
              "moe_tokens": torch.randint(0, COMMON["vocab_size"], (5, 9), generator=g),
              "moe_cases": MOE_CASES}
    torch.save(inputs, root / "inputs.pt")
    return root, inputs


def single_process(root: Path, inputs: dict, monkeypatch, device: str = "cpu") -> dict:
    monkeypatch.setattr(runner, "BATCH_TOKENS", SMALL_BATCH_TOKENS)
    with rank_threads():
        llama = Oracle(open_pack(root / "llama"), device=device)
        want = {"llama_logits": llama.logits(inputs["tokens"]),
                "llama_hidden": llama.hidden_states(inputs["rows"], progress=False),
                "llama_one_batch": llama.logits(inputs["tokens"][:2])}
        for case in MOE_CASES:
            want[case] = Oracle(open_pack(root / case), device=device).logits(inputs["moe_tokens"])
    return want


def test_deal_is_balanced_and_deterministic():
    batches = [[0, 1], [2], [3, 4, 5], [6]]
    lengths = [10, 10, 40, 5, 5, 5, 100]
    assert parallel.deal(batches, lengths, 2) == [1, 1, 1, 0]   # 100-token batch alone vs 20 + 40 + 15
    assert parallel.deal(batches, lengths, 1) == [0, 0, 0, 0]
    assert parallel.deal(batches, lengths, 2) == parallel.deal(batches, lengths, 2)


def test_prefetch_gives_the_same_numbers_and_reads_ahead(tmp_path, rng_seed):
    build(T.LlamaConfig(**{**COMMON, "tie_word_embeddings": False}), T.LlamaForCausalLM, tmp_path / "m", rng_seed)
    pack = open_pack(tmp_path / "m")
    tokens = torch.randint(0, COMMON["vocab_size"], (3, 17))
    want = Oracle(pack).logits(tokens)
    asked = []
    oracle = Oracle(pack, chain=LoadChain(prefetch=Prefetcher,
                                          layer=(lambda i, layer: asked.append((i, threading.current_thread().name))
                                                 or layer,)))
    got = oracle.logits(tokens)
    assert torch.equal(got, want)
    # every layer on the one loader thread, in order: layer 0 on demand, each next one while the previous computes
    assert asked == [(0, "fidelity-prefetch_0"), (1, "fidelity-prefetch_0"), (2, "fidelity-prefetch_0")]
    assert torch.equal(oracle.logits(tokens), want) and len(asked) == 6


@pytest.mark.slow
def test_two_ranks_equal_one_process_exactly(packs, monkeypatch):
    root, inputs = packs
    results = run_ranks("equal", root)
    check_equal(results, single_process(root, inputs, monkeypatch), root, inputs)


def check_equal(results: list[dict], want: dict, root: Path, inputs: dict) -> None:
    for rank, res in enumerate(results):
        assert res is not None and "ok" in res, f"rank {rank}: {res and res.get('trace')}"
    for rank, res in enumerate(results):
        got = res["ok"]
        assert torch.equal(got["llama_logits"], want["llama_logits"]), f"rank {rank} row-parallel logits differ"
        assert torch.equal(got["llama_one_batch"], want["llama_one_batch"]), f"rank {rank}: one batch differs"
        assert len(got["llama_hidden"]) == len(inputs["rows"])
        for i, (a, b) in enumerate(zip(got["llama_hidden"], want["llama_hidden"])):
            assert torch.equal(a, b.cpu()), f"rank {rank} row {i} hidden state differs"
        for case in MOE_CASES:
            delta = (got[case] - want[case]).abs().max().item()
            assert torch.equal(got[case], want[case]), f"rank {rank} {case} expert-parallel logits differ by {delta}"
    # Sharded loads: each rank read about half of every layer's tensors, the two halves disjoint and together all of
    # them, in each of the 3 passes (logits, hidden states, one batch, where the idle rank loads too).
    pack = open_pack(root / "llama")
    family = Oracle(pack).family
    for i in range(family.n_layers):
        layer = set(family.layer_names(i))
        shares = [[n for n in res["ok"]["llama_layers_read"] if n in layer] for res in results]
        assert not set(shares[0]) & set(shares[1]) and set(shares[0]) | set(shares[1]) == layer, i
        assert len(shares[0]) == len(set(shares[0])) * 3 and len(shares[1]) == len(set(shares[1])) * 3
        sizes = [sum(pack.storage(n).numel for n in set(share)) for share in shares]
        assert max(sizes) <= 0.6 * sum(sizes), (i, sizes)
    # Each rank read only its own block of experts: disjoint across ranks.
    for case in MOE_CASES:
        read = [set(res["ok"][f"{case}_experts_read"]) for res in results]
        assert read[0] and read[1] and not read[0] & read[1]
        n_experts = MOE[case][2].get("num_experts") or MOE[case][2].get("n_routed_experts")
        for rank, names in enumerate(read):
            assert all(int(n.rsplit(".", 1)[1]) * WORLD // n_experts == rank for n in names)


@pytest.mark.slow
def test_killed_rank_fails_the_run_naming_it(packs):
    root, _ = packs
    check_killed(run_ranks("killed", root))


def check_killed(results: list[dict]) -> None:
    assert results[1] is None  # SIGKILLed: wrote nothing
    assert "error" in results[0], "rank 0 returned a result although rank 1 died"
    message = results[0]["error"]
    assert "RankFailed" in message and "rank 1 stopped responding" in message and "no result" in message


@pytest.mark.slow
def test_raising_rank_fails_the_run_with_its_error(packs):
    root, _ = packs
    results = run_ranks("raising", root)
    assert all("error" in r for r in results)
    # 9 rows of 11 tokens, 3 rows a batch: rank 1 owns the middle batch, rows 3-5, and names row 3 as one process would
    assert parallel.deal([[0, 1, 2], [3, 4, 5], [6, 7, 8]], [11] * 9, WORLD) == [0, 1, 0]
    want = "NaN in the activations after layer 1, row 3 (first at position 0)"
    # rank 0 meets rank 1's error at the next exchange: of layer 2's weights (rank 1 had already exchanged them ahead,
    # so it waits at layer 3's) or of the logits
    assert re.search(rf"rank 1 failed before the exchange of (layer [23]'s weights|logits): {re.escape(want)}",
                     results[0]["error"]), results[0]["error"]
    assert f"rank 1: {want}" in results[1]["error"]


@pytest.mark.slow
def test_a_rank_that_cannot_read_its_share_fails_the_run_naming_it(packs):
    root, _ = packs
    check_bad_share(run_ranks("bad_share", root))


def check_bad_share(results: list[dict]) -> None:
    assert all("error" in r for r in results)
    assert re.search(r"RankFailed: rank 1 failed before the exchange of layer 1's weights: block 7 has a corrupt "
                     r"scale \[tensor 'model\.layers\.1\.[a-z_.]+weight', file .*llama\]", results[0]["error"]), \
        results[0]["error"]
    assert "block 7 has a corrupt scale" in results[1]["error"]


# -- the command line under torchrun ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_packs(tmp_path_factory, smollm2_gguf):
    from fidelity.panels.panel import PanelRow, write_panel
    from test_compare import noisy_packs, tiny_setting
    root, tok, gen = tiny_setting(tmp_path_factory, smollm2_gguf, "dist_cli")
    _, _, packs = noisy_packs(root, tok, gen, {"pack": 0.02})
    ref, pack = packs["ref"], packs["pack"]
    texts = ["The river flows through the old town towards the sea.", "def square(x):\n    return x * x\n",
             "Red, green and blue are colors.", "One two three four five six seven eight nine ten eleven twelve.",
             "A short one."]
    panel = write_panel(root / "panel", [PanelRow(f"t{i}", "text" if i % 2 else "code", text=t)
                                         for i, t in enumerate(texts)], name="dist-test").path
    return root, ref, pack, panel


def torchrun(args: list[str], cwd: Path, timeout: float = 300):
    import subprocess
    import sys

    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(RANK_THREADS),
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port",
           str(free_port()), "-m", "fidelity", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_torchrun_compare_and_reference_equal_one_process(cli_packs):
    """`torchrun --nproc-per-node 2 -m fidelity compare|reference` writes the same JSON and store as one process."""
    import pyarrow.parquet as pq
    from fidelity.cli import main
    root, ref, pack, panel = cli_packs
    common = [str(ref), str(pack), "--panel", str(panel), "--bootstrap", "200", "--seed", "3"]
    with rank_threads():
        assert main(["compare", *common, "--json", str(root / "one.json")]) == 0
        assert main(["reference", str(ref), "--panel", str(panel), "-o", str(root / "store_one")]) == 0
    done = torchrun(["compare", *common, "--json", str(root / "two.json"), "--out", str(root / "out_two")], root)
    assert done.returncode == 0, done.stderr[-3000:]
    # the same command again resumes: rank 0 finds every pass finished in OUT/passes and all ranks skip them together
    again = torchrun(["compare", *common, "--json", str(root / "three.json"), "--out", str(root / "out_two")], root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "oracle: 100%" not in again.stderr
    three = json.loads(without_command_line(root / "three.json"))
    assert three.pop("resumed") == ["reference", "noise-floor", f"pack-{open_pack(pack).fingerprint()}"]
    import re
    layer_rows = {int(n) for n in re.findall(r"oracle: 100%\|[^|]*\| (\d+)/", done.stderr)}
    assert layer_rows and max(layer_rows) < 2 * 5, layer_rows
    done = torchrun(["reference", str(ref), "--panel", str(panel), "-o", str(root / "store_two")], root)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (without_command_line(root / f) for f in ("one.json", "two.json"))
    assert json.loads(one)["noise_floor"]["kld_mean"] > 0 and json.loads(one)["results"][0]["overall"]["kld_mean"] > 0
    assert one == two
    assert json.loads(one)["resumed"] == [] and json.dumps({**json.loads(one), "resumed": []}, sort_keys=True) == \
        json.dumps({**three, "resumed": []}, sort_keys=True)
    a, b = (pq.read_table(root / d / "records.parquet") for d in ("store_one", "store_two"))
    assert a.equals(b)
    # identical apart from the thread count recorded as a diagnostic (one per process here: RANK_THREADS)
    m_one, m_two = (json.loads((root / d / "manifest.json").read_text()) for d in ("store_one", "store_two"))
    assert m_one["numerics"].pop("threads") >= 1 and m_two["numerics"].pop("threads") >= 1
    assert m_one == m_two


@pytest.mark.slow
def test_torchrun_compare_expert_parallel_equals_one_process(tmp_path, smollm2_gguf, rng_seed):
    """`--parallel experts` on a tiny Qwen3Moe: every rank runs every row, experts split; same JSON as one process
    (measured routing counts included), and so does row parallel, whose ranks' counts are summed."""
    from safetensors.torch import load_file
    from fidelity.cli import main
    from fidelity.packs.tokenizer import load_tokenizer
    from fidelity.panels.panel import PanelRow, write_panel
    from test_compare import _save
    from test_oracle import MOE_COMMON
    tok = load_tokenizer(open_pack(smollm2_gguf))
    extra = {**MOE["qwen3moe-renorm-sparse-step"][2], "vocab_size": 49152, "num_experts": 8, "mlp_only_layers": []}
    build(T.Qwen3MoeConfig(**{**MOE_COMMON, **extra}), T.Qwen3MoeForCausalLM, tmp_path / "ref", rng_seed)
    tok.save_pretrained(str(tmp_path / "ref"))
    gen = torch.Generator().manual_seed(rng_seed)
    weights = load_file(str(tmp_path / "ref" / "model.safetensors"))
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    _save(tmp_path / "pack", config, {k: v + 0.02 * v.abs().mean() * torch.randn(v.shape, generator=gen)
                                      for k, v in weights.items()}, tok)
    panel = write_panel(tmp_path / "panel", [PanelRow("a", "text", text="Experts route tokens to a few of many MLPs."),
                                             PanelRow("b", "code", text="for i in range(3):\n    print(i)\n")],
                        name="moe-test").path
    common = [str(tmp_path / "ref"), str(tmp_path / "pack"), "--panel", str(panel), "--bootstrap", "100"]
    with rank_threads():
        assert main(["compare", *common, "--json", str(tmp_path / "one.json")]) == 0
    done = torchrun(["compare", *common, "--parallel", "experts", "--json", str(tmp_path / "two.json")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    one = without_command_line(tmp_path / "one.json")
    assert json.loads(one)["results"][0]["overall"]["kld_mean"] > 0
    assert one == without_command_line(tmp_path / "two.json")
    # row parallel: each rank routes its own rows; the expert counts summed over the ranks are one process's
    done = torchrun(["compare", *common, "--json", str(tmp_path / "rows.json")], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(one)["results"][0]["routing"]["layers"]
    assert one == without_command_line(tmp_path / "rows.json")


# -- failure detection, in one process against a real store -------------------------------------------------------

def lonely_rank0(monkeypatch, **settings):
    """A Group of world size 2 whose rank 1 never shows up (no process group needed for checkpoints)."""
    import torch.distributed as dist
    g = object.__new__(parallel.Group)
    g.rank, g.world_size, g._steps, g._beats = 0, 2, {}, {}
    g.store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    g.settings = RunSettings(**settings)
    monkeypatch.setattr(parallel.group, "HEARTBEAT_S", 0.05)
    return g


def test_checkpoint_names_a_rank_that_posted_an_error(monkeypatch):
    g = lonely_rank0(monkeypatch)
    g.store.set("fidelity/error/1", "FidelityError: NaN in the activations after layer 4, row 2")
    with pytest.raises(parallel.RankFailed, match=r"rank 1 failed before the exchange: FidelityError: NaN .*layer 4"):
        g.checkpoint("the exchange")


def test_checkpoint_names_a_rank_whose_heartbeat_stopped(monkeypatch):
    g = lonely_rank0(monkeypatch, stale_s=0.3)
    g.store.add("fidelity/beat/1", 5)  # it beat once, then nothing
    with pytest.raises(parallel.RankFailed, match=r"rank 1 stopped responding before the exchange .*no result"):
        g.checkpoint("the exchange")


def test_checkpoint_times_out_naming_the_missing_rank(monkeypatch):
    g = lonely_rank0(monkeypatch, stale_s=1e9, timeout_s=0.3)
    with pytest.raises(parallel.RankFailed, match=r"rank\(s\) \[1\] did not reach the exchange within"):
        g.checkpoint("the exchange")


def test_checkpoint_passes_when_every_rank_arrives(monkeypatch):
    g = lonely_rank0(monkeypatch, stale_s=1e9, timeout_s=5.0)
    g.store.set("fidelity/at/1/1", "1")
    g.checkpoint("the exchange")  # returns


def test_bad_settings_are_named():
    with pytest.raises(FidelityError, match="parallel must be 'rows' or 'experts', not 'tensors'"):
        RunSettings(parallel="tensors")
    assert RunSettings().parallel == "rows"
    with pytest.raises(TypeError, match="unexpected keyword argument 'nodes'"):
        RunSettings(nodes=2)
    with pytest.raises(FidelityError, match=r"RunSettings.stale_s=-1.0: expected a number >= 0"):
        RunSettings(stale_s=-1.0)


def test_single_process_is_untouched(tmp_path, rng_seed, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    build(T.LlamaConfig(**{**COMMON, "tie_word_embeddings": False}), T.LlamaForCausalLM, tmp_path / "m", rng_seed)
    oracle = parallel.make_oracle(open_pack(tmp_path / "m"))
    assert type(oracle) is Oracle and parallel.current_group() is None and parallel.is_main()
    assert oracle.shards is None and oracle.fetch.expert_parallel is None
    assert isinstance(oracle.prefetcher, Prefetcher) == RunSettings().prefetch


def test_prefetch_recovers_from_an_aborted_pass(tmp_path, rng_seed):
    """A pass that stops early (an error in layer 0) leaves layer 1 loading; the next pass neither sees its result nor
    the error a layer it never needed raised."""
    build(T.LlamaConfig(**{**COMMON, "tie_word_embeddings": False}), T.LlamaForCausalLM, tmp_path / "m", rng_seed)
    pack = open_pack(tmp_path / "m")
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 9))
    want = Oracle(pack).logits(tokens)
    state = set()

    def flaky(i, layer):
        if i == 1 and "layer 1 failed" not in state:
            state.add("layer 1 failed")
            raise FidelityError("transient read error in layer 1")
        if i == 0 and "aborted" not in state:
            state.add("aborted")
            return lambda *args: (_ for _ in ()).throw(FidelityError("boom"))
        return layer
    oracle = Oracle(pack, chain=LoadChain(prefetch=Prefetcher, layer=(flaky,)))
    with pytest.raises(FidelityError, match="boom"):
        oracle.logits(tokens)
    assert torch.equal(oracle.logits(tokens), want)


def test_bad_launch_environment_is_named(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(FidelityError, match="WORLD_SIZE=2 asks for a distributed run but RANK is missing"):
        parallel.Group("cpu")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(FidelityError, match=r"rank 1 of 2 could not join the gloo process group at "
                                            r"MASTER_ADDR:MASTER_PORT=None:None: .*MASTER_ADDR"):
        parallel.Group("cpu")
