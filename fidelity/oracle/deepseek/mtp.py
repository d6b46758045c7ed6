"""DeepSeek-V4's (and V4.1's) multi-token-prediction component, the DSpark block drafter, as an optional add-on to the
oracle.

Facts from exllamav3's `architecture/deepseek_v4_mtp.py` and `modules/arch_specific/dspark.py` and from the reference
`inference/model.py` (`DSparkAttention`, `DSparkBlock.forward_embed/forward_head`, `get_dspark_topk_idxs`); our own
formulation, fp32. A draft from seed position s (`starts`) is what model.py's `forward_spec(tokens[s], main_hidden,
start_pos=s)` drafts once the target has run position s:

- taps (`main_hidden`): the trunk's residual after each block in `dspark_target_layer_ids`, as the mean of its hc
  streams, concatenated in layer order and projected: `main_x = RMSNorm(mtp.0.main_proj(taps), mtp.0.main_norm)`
  [T, hidden];
- the block: the seed token tokens[s] followed by block - 1 `dspark_noise_token_id` tokens at positions s + 1 ..
  s + block, embedded with the trunk's embedding and copied into hc_mult streams;
- `n_mtp` blocks `mtp.{i}.*`, each shaped like a trunk sliding layer (same tensor names: attn, ffn with shared
  experts and biased sqrt-softplus routing, hc_attn_*/hc_ffn_*, attn_norm, ffn_norm), but the attention is
  non-causal over [the context rows s + 1 - min(sliding_window, s + 1) .. s ++ the whole block] in one softmax with
  the sinks; a block's context rows are its own `kv_norm(wkv(main_x))`, RoPE'd at their positions (the seed's own
  row s among them);
- exit: the last block's `hc_head_fn/base/scale` collapse, `mtp.{last}.norm`, the trunk's shared head: block
  position j gives the logits of the token at s + j + 1;
- `mtp.{last}.markov_head.markov_w1` [vocab, rank] / `markov_w2` [vocab, rank] (V4.1's checkpoint: `.embed` /
  `.head`): a bigram bias added to position j's logits from the token drafted at position j (the seed for j = 0) in
  the greedy chain; `mtp.{last}.confidence_head.proj` scores each position from [pre-norm hidden, markov embedding]
  (its raw output, as model.py returns it).

Under numerics "deepseek" (V4.1) the blocks round as the trunk does: the context rows and the block's own KV are window
KV (`DeepSeekRounding.window_kv`), and the inputs of the linears stored FP8/FP4 (`main_proj` and the blocks'
projections and experts; not the Markov and confidence heads, which model.py computes in fp32). Checked against
model.py's own dump (tests/test_deepseek_v41_upstream_engram_dspark.py). V4's drafter under "deepseek" is refused: no
dump of its reference shows what it rounds.

DeepSeek-V4.1's drafter (exllamav3's `deepseek_v41_mtp.py`): its own expert count (`dspark_num_experts`,
`dspark_num_experts_per_tok`), no per-head q norm, every hc site collapsing with the previous site's pre (the first
with stream 0) and the exit with the last site's (no `hc_head_*`), taps at the input of each target layer (the output
of the layer before it).

    dspark = drafter(oracle)                        # DSparkDrafter for DeepSeek-V4 packs
    out = dspark.draft(tokens, starts)              # DraftOutput: logits [B, S, block, vocab], drafts, main logits
    out = dspark.draft_on(tokens, main_hidden, starts)   # the same over given trunk rows (no trunk pass)
    acc = acceptance(out)                           # per-position agreement with the trunk's argmax, accepted lengths

DeepSeek-V3 / V3.2 packs carry the paper's MTP module instead (`NextNDrafter`, `model.layers.{n_layers}.enorm`,
`hnorm`, `eh_proj`, `shared_head.*`; see its docstring): `drafter(oracle).logits(tokens)`, `.acceptance(tokens)`.

The oracle's own outputs are untouched: the trunk pass is the oracle's `_forward`, read through layer taps.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import ConfigError, FidelityError, PackError
from ..common import ATTENTION_CHUNK_BYTES, OracleTaps, rms_norm
from .quant import rounds_stored_input
from .dsv4_ops import (SLIDING, Attention, HyperConnection, LayerLoad, MoE, collapse, fetch_block_inputs, hc_names,
                       rope_table, rope_tail, unweighted_rms_norm)
from .v4 import ARCH, DeepseekV4Family, layer_names, name_candidates
from .v3 import DeepseekV3Family

V41_ARCH = "DeepseekV41ForCausalLM"
DSPARK_ARCHS = (ARCH, V41_ARCH)


# ---------------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class DSparkArgs:
    n_blocks: int
    block_size: int              # draft positions per call: the seed and block_size - 1 noise tokens
    noise_token_id: int
    target_layer_ids: list
    n_routed_experts: int
    top_k: int
    q_head_norm: bool = True     # the per-head weightless RMSNorm on q (V4: yes, V4.1: no)
    carry_pre: bool = False      # V4.1: each hc site (and the exit) collapses with the previous site's pre
    tap_layers: list = None      # trunk layers whose outputs are tapped: the targets (V4) or the layers before (V4.1)

    @classmethod
    def from_config(cls, cfg: dict, n_trunk_layers: int, available, v41: bool = False,
                    engram_layers=()) -> "DSparkArgs":
        arch = (cfg.get("architectures") or ["?"])[0]
        targets = cfg.get("dspark_target_layer_ids")
        if not targets:
            raise ConfigError(f"config.json of {arch} has no 'dspark_target_layer_ids': the pack describes no DSpark "
                              f"drafter")
        targets = [int(t) for t in targets]
        first = 1 if v41 else 0   # V4.1 taps a target's input: the output of the layer before it
        bad = [t for t in targets if not first <= t < n_trunk_layers or (v41 and t in engram_layers)]
        if bad or len(set(targets)) != len(targets):
            raise ConfigError(f"config.json of {arch}: dspark_target_layer_ids {targets} must name distinct trunk "
                              f"layers {first}..{n_trunk_layers - 1}" + (" that carry no Engram" if v41 else ""))
        block = int(cfg.get("dspark_block_size") or 0)
        if block < 1:
            raise ConfigError(f"config.json of {arch} has no positive 'dspark_block_size'")
        return cls(n_blocks=count_blocks(cfg, n_trunk_layers, available), block_size=block,
                   noise_token_id=int(cfg.get("dspark_noise_token_id", 0)), target_layer_ids=targets,
                   n_routed_experts=int(cfg.get("dspark_num_experts") or cfg["n_routed_experts"]),
                   top_k=int(cfg.get("dspark_num_experts_per_tok") or cfg["num_experts_per_tok"]),
                   q_head_norm=not v41, carry_pre=v41, tap_layers=sorted(t - first for t in targets))


def count_blocks(cfg: dict, n_trunk_layers: int, available) -> int:
    """The official config's `compress_ratios` runs past the trunk layers to describe the MTP blocks
    (`num_nextn_predict_layers` does not count them); without that tail, the blocks the pack holds."""
    ratios = cfg.get("compress_ratios")
    if ratios is not None and len(ratios) > n_trunk_layers:
        tail = [int(r) for r in ratios[n_trunk_layers:]]
        if any(tail):
            raise ConfigError(f"config.json: compress_ratios past the trunk ({tail}) describe compressing MTP blocks; "
                              f"DSpark blocks are sliding-only (ratio 0)")
        return len(tail)
    have = {name.removeprefix("model.") for name in available}
    n = 0
    while f"mtp.{n}.attn.wkv.weight" in have:
        n += 1
    return n


def trunk_pass(oracle, rows: list[list[int]], tap_layers, reduce=lambda x: x):
    """The oracle's own forward, reading `reduce(output)` of the layers in tap_layers on the way:
    (per row {layer: tap [T, ...]}, per row the final hidden state [T, hidden] after the last norm)."""
    recorded: dict[int, list[torch.Tensor]] = {t: [] for t in tap_layers}
    outputs = {t: lambda out, t=t: recorded[t].append(reduce(out)) for t in tap_layers}
    with oracle.tapped(OracleTaps(layer_outputs=outputs)):
        batches, hidden = oracle._forward(rows, progress=False)
    taps: list = [None] * len(rows)
    finals: list = [None] * len(rows)
    for b, idx in enumerate(batches):
        for j, row in enumerate(idx):
            taps[row] = {t: recorded[t][b][j] for t in tap_layers}
            finals[row] = hidden[b][j]
    return taps, finals


# ---------------------------------------------------------------------------------------------------------------------
# pieces
# ---------------------------------------------------------------------------------------------------------------------
def block_names(i: int, a) -> list[str]:
    """Official names of MTP block i: a trunk sliding layer's names under `mtp.{i}.`."""
    return [name.replace("layers.0.", f"mtp.{i}.", 1) for name in layer_names(a, 0)]


def head_names(last: int) -> list[str]:
    return hc_names(f"mtp.{last}.hc_head") + [f"mtp.{last}.norm.weight"]


MARKOV_SPELLINGS = (("markov_w1", "markov_w2"), ("embed", "head"))   # V4's; V4.1's checkpoint and model.py


def markov_names(last: int, spelling: tuple = MARKOV_SPELLINGS[0]) -> list[str]:
    """(the token embedding [vocab, rank], the bias head [vocab, rank]) of the Markov head."""
    return [f"mtp.{last}.markov_head.{w}.weight" for w in spelling]


def confidence_name(last: int) -> str:
    return f"mtp.{last}.confidence_head.proj.weight"


class DSparkBlock:
    """One drafter block; weights loaded through the V4 trunk's own layer pieces as trunk layer 0, whose names the
    load stores under mtp.i (DSparkDrafter.block_load), its rounding's linear-input rule reading the block's own
    names."""

    def __init__(self, load: LayerLoad, q_head_norm: bool, carry_pre: bool):
        self.a, self.q_head_norm, self.carry_pre = load.args, q_head_norm, carry_pre
        self.attn = Attention(load)
        self.ffn = MoE(load)
        fetch_block_inputs(self, load)

    def context_kv(self, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """main_x [..., T, hidden] -> this block's context rows [..., T, head_dim] (positions 0..T-1), stored as
        the window KV (model.py writes them to its window cache)."""
        r = self.attn.round
        kv = rms_norm(F.linear(r.wkv(main_x), self.attn.wkv), self.attn.kv_norm, self.a.rms_norm_eps)
        return r.window_kv(rope_tail(kv, cos, sin))

    def mix(self, hc: HyperConnection, streams: torch.Tensor, carried):
        """(post, comb, collapsed block input, the pre to carry on). V4 collapses with the site's own pre; V4.1 with the
        previous site's (the first site of the drafter takes stream 0)."""
        pre, post, comb = hc.weights(streams)
        if not self.carry_pre:
            return post, comb, collapse(streams, pre), None
        return post, comb, streams[:, :, 0] if carried is None else collapse(streams, carried), pre

    def __call__(self, streams: torch.Tensor, context: torch.Tensor, ends: torch.Tensor, rope, carried=None):
        """streams [N, block, hc, hidden] of N drafts; context [T, D] this block's rows of the drafts' row;
        ends [N] each draft's context end (seed position + 1: rows before it are context); carried: V4.1's pre from
        the previous site. -> (streams, the pre to carry on)."""
        eps = self.a.rms_norm_eps
        post, comb, x, carried = self.mix(self.attn_hc, streams, carried)
        x = rms_norm(x, self.attn_norm, eps)
        attn = torch.empty_like(x)
        per_draft = 4 * x.shape[1] * self.a.head_dim * (self.a.n_heads + self.a.sliding_window)
        chunk = max(1, ATTENTION_CHUNK_BYTES // per_draft)
        for start in range(0, x.shape[0], chunk):
            rows = slice(start, start + chunk)
            attn[rows] = self.attention(x[rows], context, ends[rows], (rope[0][rows], rope[1][rows]))
        streams = HyperConnection.merge(streams, attn, post, comb)
        post, comb, x, carried = self.mix(self.ffn_hc, streams, carried)
        return HyperConnection.merge(streams, self.ffn(rms_norm(x, self.ffn_norm, eps), None), post, comb), carried

    def attention(self, x: torch.Tensor, context: torch.Tensor, ends: torch.Tensor, rope) -> torch.Tensor:
        """Each block query sees the last min(window, end) context rows before its draft's context end and every
        block row (no causal mask), plus the head's sink, in one softmax (model.py's `get_dspark_topk_idxs`)."""
        a, at, r = self.a, self.attn, self.attn.round
        N, S, _ = x.shape
        cos, sin = rope                                               # [N, S, pairs]: the block's positions
        q_latent = rms_norm(F.linear(r.wq_a(x), at.wq_a), at.q_norm, a.rms_norm_eps)
        q = F.linear(r.wq_b(q_latent), at.wq_b).view(N, S, a.n_heads, a.head_dim)
        if self.q_head_norm:
            q = unweighted_rms_norm(q, a.rms_norm_eps)
        q = rope_tail(q.flatten(0, 1)[None], cos.flatten(0, 1), sin.flatten(0, 1))[0].view_as(q)  # per-draft positions
        kv = r.window_kv(rope_tail(rms_norm(F.linear(r.wkv(x), at.wkv), at.kv_norm, a.rms_norm_eps), cos, sin))
        rows = ends[:, None] - a.sliding_window + torch.arange(a.sliding_window, device=x.device)   # [N, W]
        window = context[rows.clamp(min=0)]                                                       # [N, W, D]
        scale = a.head_dim ** -0.5
        far = torch.einsum("nshd,nwd->nhsw", q, window) * scale
        far = far.masked_fill((rows < 0)[:, None, None, :], float("-inf"))
        near = torch.einsum("nshd,ntd->nhst", q, kv) * scale
        sink = at.sinks.view(1, -1, 1, 1).expand(N, -1, S, 1)
        probs = torch.softmax(torch.cat((far, near, sink), dim=-1), dim=-1)
        W = window.shape[1]
        out = torch.einsum("nhsw,nwd->nshd", probs[..., :W], window)
        out = out + torch.einsum("nhst,ntd->nshd", probs[..., W:W + S], kv)
        out = rope_tail(out.flatten(0, 1)[None], cos.flatten(0, 1), -sin.flatten(0, 1))[0].view_as(out)
        groups = out.reshape(N, S, a.o_groups, -1)
        low_rank = torch.einsum("nsgi,gri->nsgr", groups, at.wo_a.view(a.o_groups, a.o_lora_rank, -1))
        return F.linear(r.wo_b(low_rank.flatten(2)), at.wo_b)


# ---------------------------------------------------------------------------------------------------------------------
# the drafter
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class DraftOutput:
    """Drafts of every row b and seed position p0 = starts[s]: block position j predicts the token at p0 + j + 1."""
    starts: list                  # seed positions p0: the seed is tokens[b, p0], the context rows 0..p0
    logits: torch.Tensor          # [B, S, block, vocab] the drafter's raw logits (no Markov bias)
    biased_logits: torch.Tensor | None   # [B, S, block, vocab] with the Markov bias of the greedy chain, or None
    drafts: torch.Tensor          # [B, S, block] greedy chain (argmax of biased logits; raw when no Markov head)
    confidence: torch.Tensor | None      # [B, S, block] the confidence head's raw output (a logit), or None
    main_logits: torch.Tensor | None     # [B, T, vocab] the trunk's logits (= oracle.logits(tokens)); None from
    #                                      draft_on without them


class DSparkDrafter:
    """The checkpoint's DSpark drafter over an oracle's DeepSeek-V4 trunk. Raises PackError naming the missing tensors
    when the pack has no (or a partial) drafter."""

    def __init__(self, oracle):
        fam = oracle.family
        arch = (oracle.pack.config.get("architectures") or ["?"])[0]
        if not isinstance(fam, DeepseekV4Family) or arch not in DSPARK_ARCHS:
            raise ConfigError(f"the DSpark drafter is implemented for {list(DSPARK_ARCHS)} packs, not {arch}")
        self.oracle, self.family = oracle, fam
        names = oracle.pack.names()
        v41 = arch == V41_ARCH
        cfg = oracle.pack.config
        if v41 and isinstance(cfg.get("text_config"), dict):
            cfg = {**cfg, **cfg["text_config"]}
        self.args = DSparkArgs.from_config(cfg, fam.n_layers, names, v41,
                                           fam.v41.engram_layers if v41 else ())
        self.block_args = dataclasses.replace(fam.args, layer_types=[SLIDING], ratios=[0], hash_layers=[False],
                                              n_routed_experts=self.args.n_routed_experts, top_k=self.args.top_k)
        self.stored = self._resolve(names)
        blocks = max(self.args.n_blocks, 1)   # a pack with no block at all is told what block 0 would need
        self.last = blocks - 1
        exit_names = head_names(self.last)[3:] if self.args.carry_pre else head_names(self.last)   # V4.1: no hc_head
        required = ["mtp.0.main_proj.weight", "mtp.0.main_norm.weight"] + exit_names
        for i in range(blocks):
            required += block_names(i, self.block_args)
        missing = [x for x in required if x not in self.stored]
        if self.args.n_blocks == 0 or missing:
            first = missing[0] if missing else "mtp.0.attn.wkv.weight"
            raise PackError(f"pack has no complete DSpark drafter: lacks {max(len(missing), 1)} tensor(s), first "
                            f"{first!r}" + (f" (also {missing[1:4]})" if len(missing) > 1 else ""),
                            file=getattr(oracle.pack, "path", None), tensor=first)
        self.markov = next((names for names in (markov_names(self.last, sp) for sp in MARKOV_SPELLINGS)
                            if all(x in self.stored for x in names)), None)
        self.has_markov = self.markov is not None
        self.has_confidence = self.has_markov and confidence_name(self.last) in self.stored
        self.rounding = self._rounding(oracle.pack, v41)

    def _resolve(self, names) -> dict[str, str]:
        have = set(names)
        out = {}
        for name in have:
            official = name.removeprefix("model.")
            if official.startswith("mtp."):
                out.setdefault(official, name)
        for official in list(out):  # an exact official name wins over a model.-prefixed copy
            found = next((c for c in name_candidates(official) if c in have), None)
            if found is not None:
                out[official] = found
        return out

    def n(self, name: str) -> str:
        return self.stored.get(name, name)

    def _rounding(self, pack, v41: bool):
        """The family's reference rounding with its linear-input rule reading the drafter's own tensors, or None."""
        rounding = self.family.rounding
        if rounding is None:
            return None
        if not v41:
            raise ConfigError(f"the DeepSeek-V4 DSpark drafter runs under numerics 'exact' only: what DeepSeek's V4 "
                              f"model.py rounds in its drafter is not established (no dump of it), while this oracle "
                              f"runs numerics {self.family.numerics!r} ({self.family.numerics_label})")
        return dataclasses.replace(rounding, rounds_input=rounds_stored_input(pack, self.n))

    def block_rounding(self, i: int):
        """The rounding of block i, whose pieces name their weights as trunk layer 0's."""
        if self.rounding is None:
            return None
        mtp_name = lambda name: name.replace("layers.0.", f"mtp.{i}.", 1)   # noqa: E731
        return dataclasses.replace(self.rounding, rounds_input=lambda name: self.rounding.rounds_input(mtp_name(name)))

    # -- pieces --------------------------------------------------------------------------------------------------
    def taps(self, rows: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One trunk pass (the oracle's own): (per row the concatenated taps [T, n_taps * hidden],
        per row the final hidden state [T, hidden])."""
        layers = self.args.tap_layers   # concatenated in the order the trunk produces them
        taps, finals = trunk_pass(self.oracle, rows, layers, lambda streams: streams.mean(dim=2))
        return [torch.cat([row[t] for t in layers], dim=-1) for row in taps], finals

    def main_x(self, taps: torch.Tensor) -> torch.Tensor:
        fetch = self.oracle.fetch
        proj = "mtp.0.main_proj.weight"
        if self.rounding is not None:
            taps = self.rounding.linear_input(proj)(taps)
        return rms_norm(F.linear(taps, fetch(self.n(proj))), fetch(self.n("mtp.0.main_norm.weight")),
                        self.family.rms_norm_eps)

    def block_load(self, i: int) -> LayerLoad:
        """Block i as trunk layer 0 of the block args: official names `layers.0.*` stored as the pack's `mtp.{i}.*`."""
        stored_name = lambda name: self.n(name.replace("layers.0.", f"mtp.{i}.", 1))   # noqa: E731
        return LayerLoad(self.block_args, 0, self.oracle.fetch, stored_name, self.block_rounding(i))

    def load_block(self, i: int) -> DSparkBlock:
        return DSparkBlock(self.block_load(i), self.args.q_head_norm, self.args.carry_pre)

    # -- drafting ------------------------------------------------------------------------------------------------
    def draft(self, tokens: torch.Tensor, starts: list[int] | None = None) -> DraftOutput:
        """tokens LongTensor [B, T]; starts: seed positions p0 (0 <= p0 < T; default every one), the seed of each
        draft being tokens[:, p0] and its context the trunk's rows 0..p0. One trunk pass for all of them."""
        self._check(tokens, starts)
        taps, finals = self.taps(tokens.tolist())
        return self.draft_on(tokens, torch.stack(taps), starts, self.oracle.apply_head(torch.stack(finals)))

    def _check(self, tokens: torch.Tensor, starts) -> list[int]:
        if tokens.dim() != 2 or tokens.shape[1] < 1:
            raise FidelityError(f"tokens must be a [batch, length >= 1] tensor (a draft needs a seed), got shape "
                                f"{list(tokens.shape)}")
        T = tokens.shape[1]
        starts = list(range(T)) if starts is None else [int(p) for p in starts]
        bad = [p for p in starts if not 0 <= p < T]
        if bad or not starts:
            raise FidelityError(f"draft starts must be seed positions 0..{T - 1} (the seed is the token at the start, "
                                f"its context the rows up to it), got {bad or starts}")
        return starts

    def draft_on(self, tokens: torch.Tensor, main_hidden: torch.Tensor, starts: list[int] | None = None,
                 main_logits: torch.Tensor | None = None) -> DraftOutput:
        """The drafts over given trunk rows, no trunk pass: main_hidden [B, T, n_targets * hidden] (what `taps`
        computes, and what model.py hands its drafter as `main_hidden`); main_logits: the trunk's logits, kept in the
        output for `acceptance` (or None)."""
        starts = self._check(tokens, starts)
        oracle, fam, a = self.oracle, self.family, self.args
        B, T = tokens.shape
        width = len(a.target_layer_ids) * fam.hidden_size
        if tuple(main_hidden.shape) != (B, T, width):
            raise FidelityError(f"main_hidden must be [{B}, {T}, {width}] (the tokens' rows, {len(a.target_layer_ids)} "
                                f"taps of {fam.hidden_size}), got {list(main_hidden.shape)}")
        device, dtype = oracle.device, oracle.dtype
        S, bs = len(starts), a.block_size
        ends = torch.tensor(starts, device=device) + 1                                  # context rows before it
        positions = ends[:, None] + torch.arange(bs, device=device)                     # [S, block]
        max_pos = int(positions.max()) + 1
        cos, sin = rope_table(fam.args.main_rope, torch.arange(max(max_pos, T)), dtype, device)
        block_ids = torch.full((B, S, bs), a.noise_token_id, dtype=torch.long)
        block_ids[:, :, 0] = tokens[:, starts]
        embed = oracle.fetch(fam.embed_name)
        x = F.embedding(block_ids.to(device), embed).view(B * S, bs, -1)
        del embed
        streams = fam.embed_hook(x)
        main_x = [self.main_x(t.to(device=device, dtype=dtype)) for t in main_hidden]   # per row [T, hidden]
        rope = (cos[positions].repeat(B, 1, 1), sin[positions].repeat(B, 1, 1))
        carried = None                                                                  # V4.1: [B * S, block, hc]
        for i in range(a.n_blocks):
            block = self.load_block(i)
            out = torch.empty_like(streams)
            pre = streams.new_empty(streams.shape[:3]) if a.carry_pre else None
            for b in range(B):
                rows = slice(b * S, (b + 1) * S)
                context = block.context_kv(main_x[b], cos[:T], sin[:T])
                out[rows], row_pre = block(streams[rows], context, ends, (rope[0][rows], rope[1][rows]),
                                           None if carried is None else carried[rows])
                if pre is not None:
                    pre[rows] = row_pre
            streams, carried = out, pre
            del block
        fetch = oracle.fetch
        if a.carry_pre:     # V4.1: the exit collapses with the last site's pre, no hc_head
            pre = carried
        else:
            fn, base, scale = (fetch(self.n(x)) for x in head_names(self.last)[:3])
            mixes = F.linear(unweighted_rms_norm(streams.flatten(2), fam.rms_norm_eps), fn)
            pre = torch.sigmoid(mixes * scale + base) + fam.args.hc_eps
        prenorm = collapse(streams, pre)                                                # [B * S, block, hidden]
        hidden = rms_norm(prenorm, fetch(self.n(head_names(self.last)[3])), fam.rms_norm_eps)
        logits = oracle.apply_head(hidden).view(B, S, bs, -1)
        drafts, biased, confidence = self._chain(logits, block_ids[:, :, 0], prenorm.view(B, S, bs, -1))
        return DraftOutput(starts, logits, biased, drafts, confidence, main_logits)

    def _chain(self, logits: torch.Tensor, seeds: torch.Tensor, prenorm: torch.Tensor):
        """The greedy chain: position j's logits get the Markov bias of the token drafted at j - 1 (the seed at
        j = 0); the confidence head reads [pre-norm hidden, that token's Markov embedding]."""
        B, S, bs, V = logits.shape
        if not self.has_markov:
            return logits.argmax(-1), None, None
        fetch = self.oracle.fetch
        w1, w2 = (fetch(self.n(x)) for x in self.markov)
        biased = torch.empty_like(logits)
        drafts = torch.empty(B, S, bs, dtype=torch.long)
        prev = seeds.clone()
        embs = []
        for j in range(bs):
            emb = F.embedding(prev.to(w1.device), w1)                                   # [B, S, rank]
            embs.append(emb)
            biased[:, :, j] = logits[:, :, j] + F.linear(emb, w2).to(logits)
            prev = biased[:, :, j].argmax(-1)
            drafts[:, :, j] = prev
        confidence = None
        if self.has_confidence:
            proj = fetch(self.n(confidence_name(self.last)))
            bias_name = confidence_name(self.last).removesuffix(".weight") + ".bias"
            bias = fetch(self.n(bias_name)) if bias_name in self.stored else None
            feats = torch.cat((prenorm, torch.stack(embs, dim=2).to(prenorm)), dim=-1)
            confidence = F.linear(feats, proj, bias).squeeze(-1).cpu()
        return drafts, biased, confidence


# ---------------------------------------------------------------------------------------------------------------------
# acceptance
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class Acceptance:
    match: torch.Tensor       # [B, S, block] bool: draft j == the trunk's argmax at p0 + j (False past the row's end)
    valid: torch.Tensor       # [B, S, block] bool: p0 + j is a position of the row
    accepted: torch.Tensor    # [B, S] leading matches: the tokens one verify step would accept

    @property
    def per_position_rate(self) -> torch.Tensor:
        """[block] fraction of valid drafts at block position j that match."""
        return (self.match & self.valid).sum((0, 1)) / self.valid.sum((0, 1)).clamp(min=1)

    @property
    def mean_accepted(self) -> float:
        return float(self.accepted.float().mean())


def acceptance(out: DraftOutput) -> Acceptance:
    """Drafts against the trunk's own greedy predictions along the given tokens (teacher forced): when the tokens are
    the trunk's greedy continuation this is what speculative decoding would accept."""
    if out.main_logits is None:
        raise FidelityError("acceptance needs the trunk's logits: these drafts were made by draft_on without "
                            "main_logits (draft() computes them)")
    B, S, bs = out.drafts.shape
    T = out.main_logits.shape[1]
    target = out.main_logits.argmax(-1)                                                 # [B, T]
    pos = torch.tensor(out.starts)[:, None] + torch.arange(bs)                          # [S, block]
    valid = (pos < T).expand(B, S, bs)
    want = target[:, pos.clamp(max=T - 1)]                                             # [B, S, block]
    match = (out.drafts == want) & valid
    accepted = match.long().cumprod(-1).sum(-1)
    return Acceptance(match, valid, accepted)


# ---------------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 / V3.2: the next-token-prediction module (`num_nextn_predict_layers`, stored as layer n_layers)
# ---------------------------------------------------------------------------------------------------------------------
NEXTN_ARCHS = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")


# the module's own tensors past the trunk's layer tensors, under model.layers.{n_layers}: role -> name
NEXTN_TENSORS = {"enorm": "enorm.weight", "hnorm": "hnorm.weight", "eh_proj": "eh_proj.weight",
                 "head_norm": "shared_head.norm.weight"}


class NextNDrafter:
    """DeepSeek-V3's MTP module, stored as `model.layers.{n_layers}.*`: position i combines the trunk's hidden state
    at i with the embedding of token i + 1, `eh_proj([enorm(embed(t[i+1])), hnorm(h[i])])`, runs one decoder layer
    shaped like the trunk's MoE layers (causal over these positions, RoPE at i), then `shared_head.norm` and the
    shared head (`shared_head.head` where stored): its logits at i are for token i + 2.

    `hidden="post_norm"` feeds the trunk's state after its final norm (what vLLM and exllamav3 feed; exllamav3 measured
    higher acceptance with it on GLM-5.2's module of this shape), `"pre_norm"` the last layer's residual (the
    DeepSeek-V3 paper's reading)."""

    def __init__(self, oracle, hidden: str = "post_norm"):
        cfg = oracle.pack.config
        arch = (cfg.get("architectures") or ["?"])[0]
        fam = oracle.family
        if arch not in NEXTN_ARCHS or not isinstance(fam, DeepseekV3Family):
            raise ConfigError(f"the next-token-prediction module is implemented for {list(NEXTN_ARCHS)}, not {arch}")
        depth = int(cfg.get("num_nextn_predict_layers") or 0)
        if depth != 1:
            raise ConfigError(f"config.json of {arch}: num_nextn_predict_layers is {depth}; the MTP module is "
                              f"implemented for exactly 1" + (" (the pack declares none)" if depth == 0 else ""))
        if hidden not in ("post_norm", "pre_norm"):
            raise FidelityError(f"hidden must be 'post_norm' or 'pre_norm', not {hidden!r}")
        self.oracle, self.hidden = oracle, hidden
        self.layer = L = fam.n_layers
        self.family = copy.copy(fam)   # the MTP layer is a sparse layer past the trunk's per-layer schedules
        if hasattr(fam, "mlp_types"):
            self.family.mlp_types = list(fam.mlp_types) + ["sparse"]
        p = f"model.layers.{L}"
        have = set(oracle.pack.names())
        self.tensor_names = {role: f"{p}.{name}" for role, name in NEXTN_TENSORS.items()}
        required = list(self.tensor_names.values()) + self.family.layer_names(L)
        missing = [x for x in required if x not in have]
        if missing:
            raise PackError(f"pack has no complete MTP module (layer {L}): lacks {len(missing)} tensor(s), first "
                            f"{missing[0]!r}" + (f" (also {missing[1:4]})" if len(missing) > 1 else ""),
                            file=getattr(oracle.pack, "path", None), tensor=missing[0])
        self.head_name = f"{p}.shared_head.head.weight" if f"{p}.shared_head.head.weight" in have else fam.head_name
        self.embed_name = f"{p}.embed_tokens.weight" if f"{p}.embed_tokens.weight" in have else fam.embed_name

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] (T >= 2) -> [B, T - 1, vocab]: entry i is the module's prediction of token i + 2."""
        return self.run(tokens)[0]

    def run(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the module's logits [B, T - 1, vocab], the trunk's logits [B, T, vocab] = oracle.logits(tokens)), one
        trunk pass."""
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise FidelityError(f"tokens must be a [batch, length >= 2] tensor, got shape {list(tokens.shape)}")
        oracle, fam, fetch, L = self.oracle, self.family, self.oracle.fetch, self.layer
        last = fam.n_layers - 1
        taps, finals = trunk_pass(oracle, tokens.tolist(), [last] if self.hidden == "pre_norm" else [])
        main = oracle.apply_head(torch.stack(finals))
        h = torch.stack([row[last] for row in taps] if self.hidden == "pre_norm" else finals)[:, :-1]
        w, eps = {role: fetch(name) for role, name in self.tensor_names.items()}, fam.rms_norm_eps
        emb = F.embedding(tokens[:, 1:].to(oracle.device), fetch(self.embed_name))
        x = F.linear(torch.cat((rms_norm(emb, w["enorm"], eps), rms_norm(h, w["hnorm"], eps)), dim=-1), w["eh_proj"])
        x = fam.load_layer(L, fetch)(x, fam.rope_tables(x.shape[1], oracle.dtype, oracle.device))
        x = rms_norm(x, w["head_norm"], eps)
        return F.linear(x, fetch(self.head_name)).cpu(), main

    def acceptance(self, tokens: torch.Tensor) -> torch.Tensor:
        """Bool [B, T - 2]: the module's argmax at i equals the trunk's argmax at i + 1 (both predict token i + 2,
        teacher forced along the given tokens)."""
        mtp, main = self.run(tokens)
        return mtp[:, :-1].argmax(-1) == main[:, 1:-1].argmax(-1)


def drafter(oracle, **options):
    """The pack's own drafter over the oracle's trunk: DSpark for DeepSeek-V4, the MTP module for V3 / V3.2."""
    arch = (oracle.pack.config.get("architectures") or ["?"])[0]
    if arch not in NEXTN_ARCHS + DSPARK_ARCHS:
        raise ConfigError(f"the oracle runs no drafter of {arch} packs: DSpark for {list(DSPARK_ARCHS)}, the MTP "
                          f"module for {list(NEXTN_ARCHS)}")
    return NextNDrafter(oracle, **options) if arch in NEXTN_ARCHS else DSparkDrafter(oracle, **options)
