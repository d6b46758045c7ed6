"""Make panels: `panel build` answers prompts through a served model (`--engine`) or greedily through the reference
oracle (`--pack`), `panel from-text` cuts a text source into fixed-length token rows, `panel encode` renders chat rows
through a pack's own encoder code into token-exact rows, `panel check` finds rows sharing an n-gram with a calibration
or benchmark set, `panel manifest` re-hashes an edited panel."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from ..pack_settings import PackSettings
from ..panels.build import read_prompts
from ..panels.panel import PanelError, PanelRow, load_panel, write_panel


def add_arguments(p: argparse.ArgumentParser):
    from .compare import add_numerics_argument
    sub = p.add_subparsers(dest="panel_command", metavar="ACTION", required=True)
    b = sub.add_parser(
        "build", help="answer prompts through a served model (--engine) or the reference oracle (--pack)"
    )
    b.add_argument(
        "--prompts",
        required=True,
        help='jsonl: {"id", "domain", "prompt"} or {"id", "domain", "messages", '
        '"tools"?} per line (OpenAI chat format, ending with a user or tool turn)',
    )
    who = b.add_mutually_exclusive_group(required=True)
    who.add_argument("--pack", help="the reference pack that answers (its oracle decides every token; small models)")
    who.add_argument("--engine", help="URL of an OpenAI-compatible server running the native model")
    b.add_argument("--model", help="model name on the engine (with --engine)")
    b.add_argument("-o", "--out", required=True, help="panel folder to write")
    b.add_argument("--name", help="panel name (default: the folder name)")
    b.add_argument("--description", default="")
    b.add_argument(
        "--max-new-tokens",
        type=int,
        help="answer length limit (default 64 with --pack, 2048 with --engine); answers cut by it are marked truncated",
    )
    b.add_argument("--temperature", type=float, default=0.0, help="with --engine: 0 is greedy (default)")
    b.add_argument("--seed", type=int, help="with --engine: the sampling seed sent with each request")
    b.add_argument("--thinking", choices=["on", "off"], help="with --engine: the chat template's thinking switch "
                                                            "(chat_template_kwargs); default: the engine's")
    b.add_argument("--concurrency", type=int, default=4, help="with --engine: requests in flight")
    b.add_argument("--timeout", type=float, default=600.0, help="with --engine: seconds per request")
    b.add_argument("--no-score-reasoning", action="store_true", help="rows score content and tool calls, not reasoning")
    b.add_argument("--license", default="CC0-1.0", help="license of the prompts (answers are model outputs)")
    add_numerics_argument(b)
    m = sub.add_parser(
        "manifest", help="recompute a panel folder's manifest (sha256, row counts) after editing panel.jsonl"
    )
    m.add_argument("folder")
    t = sub.add_parser("from-text", help="fixed-length token rows cut from text sources (one domain per source)")
    t.add_argument("sources", nargs="+", metavar="SOURCE", help=".txt, .jsonl, .parquet or hf:NAME[:SPLIT]")
    t.add_argument("--pack", required=True, help="the pack whose tokenizer cuts the rows")
    t.add_argument("--tokens-per-row", type=int, required=True)
    t.add_argument("--rows", type=int, required=True, help="rows per source")
    t.add_argument("--domain", action="append", help="domain of each source, in order (default: the source's name)")
    t.add_argument("--field", default="text", help="the text field of .jsonl / .parquet / hf: records (default text)")
    t.add_argument("--bos", action="store_true", help="each row starts with the tokenizer's BOS token")
    t.add_argument("-o", "--out", required=True)
    t.add_argument("--name")
    t.add_argument("--description", default="")
    t.add_argument("--license", default="see the source", help="license of the texts")
    c = sub.add_parser("check", help="rows sharing a word n-gram with calibration or benchmark texts (exit 1 if any)")
    c.add_argument("panel")
    c.add_argument(
        "--against",
        nargs="+",
        required=True,
        metavar="FILE",
        help=".txt, .jsonl(.gz), .json, .parquet, a folder of those, or suite:NAME (fidelity's suites' prompts)",
    )
    c.add_argument("--ngram", type=int, default=8)
    c.add_argument(
        "--field", action="append", help="only these fields of .jsonl/.json/.parquet records (default: every string)"
    )
    c.add_argument("--pack", help="tokenizer to decode token-exact rows with")
    c.add_argument("--json", help="write the findings as JSON here")
    e = sub.add_parser("encode", help="token-exact rows from chat rows rendered by the pack's own encoding/*.py code")
    e.add_argument("panel")
    e.add_argument("--pack", required=True)
    e.add_argument("--trust-pack-code", action="store_true", help="allow running the pack's encoding/*.py (it is code)")
    e.add_argument("--encoder-kwargs", default="{}", help="JSON object of keyword arguments for encode_messages")
    e.add_argument("--no-score-reasoning", action="store_true")
    e.add_argument("-o", "--out", required=True)


class GreedyAnswerer:
    """Greedy answers that are exactly the oracle's argmax at every step.

    Decoding token by token through the oracle costs a full forward per token (it has no KV cache), so a draft comes
    from transformers' cached greedy generate on the same fp32 weights; one teacher-forced oracle pass then checks every
    drafted token, and at the first one that is not the oracle's argmax (a near tie where the two differ in the last
    bits) the oracle's token replaces it and drafting resumes from there. An architecture transformers does not have
    (DeepSeek-V4.1) gets no draft: the oracle decides each token in its own forward."""

    def __init__(self, pack, device: str = "cpu", max_new_tokens: int = 64, numerics: str = "exact",
                 activation_budget: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        from ..oracle import Oracle
        from ..packs.tokenizer import load_tokenizer

        self.tok = load_tokenizer(pack)
        self.oracle = Oracle(pack, device=device, keep_weights=True, numerics=numerics,
                             activation_budget=activation_budget)
        src = pack.tokenizer_source()
        if not pack.path.is_dir():
            raise PanelError(f"panel build drafts with transformers and needs a native pack folder, not {pack.path}")
        self.draft = (AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
                      if transformers_has(pack.config) else None)
        self.max_new = max_new_tokens
        self.stop = {
            t for t in (self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")) if t is not None and t >= 0
        }

    def _draft(self, ids: list[int], n: int) -> list[int]:
        if self.draft is None:
            return []
        import torch

        with torch.no_grad():
            out = self.draft.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=n, do_sample=False, pad_token_id=self.tok.eos_token_id)
        return out[0, len(ids):].tolist()

    def answer(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, int, bool]:
        """(answer text, number of drafted tokens the oracle corrected, whether max_new_tokens cut it short)."""
        prompt = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                              **({"tools": tools} if tools else {}))
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        new: list[int] = []
        corrected = 0
        while len(new) < self.max_new and not (new and new[-1] in self.stop):
            drafted = self._draft(ids + new, self.max_new - len(new))
            seq = ids + new + drafted
            hidden = self.oracle.hidden_states([seq], progress=False)[0]
            start = len(ids) + len(new) - 1
            chosen = self.oracle.apply_head(hidden[start:start + len(drafted) + 1]).argmax(-1).tolist()
            k = 0
            while k < len(drafted) and drafted[k] == chosen[k] and drafted[k] not in self.stop:
                k += 1
            if k < len(drafted) and drafted[k] in self.stop and drafted[k] == chosen[k]:
                new += drafted[:k + 1]
                break
            new += drafted[:k]
            if len(new) < self.max_new:
                corrected += int(k < len(drafted))
                new.append(chosen[k])
        finished = bool(new and new[-1] in self.stop)
        if finished:
            new = new[:-1]
        return self.tok.decode(new, skip_special_tokens=True).strip(), corrected, not finished


def transformers_has(config: dict) -> bool:
    """Whether transformers knows the config's model_type (a model it can draft with)."""
    from transformers import CONFIG_MAPPING
    return config.get("model_type") in CONFIG_MAPPING


def build_panel(prompts: str | Path, pack_path: str | Path, out: str | Path, *, name: str | None = None,
                description: str = "", max_new_tokens: int = 64, license: str = "CC0-1.0", progress: bool = True,
                score_reasoning: bool = True, numerics: str = "exact", activation_budget: int | None = None,
                pack_settings: PackSettings = PackSettings()):
    from tqdm.auto import tqdm

    from ..packs import open_pack
    from ..panels.panel import template_messages

    pack = open_pack(pack_path, pack_settings)
    items = read_prompts(prompts)
    answerer = GreedyAnswerer(pack, max_new_tokens=max_new_tokens, numerics=numerics,
                              activation_budget=activation_budget)
    rows, corrected = [], 0
    for p in tqdm(items, desc="answering", disable=not progress, unit="prompt"):
        shaped = template_messages(PanelRow(p.id, p.domain, messages=p.messages), answerer.tok.chat_template or "")
        text, fixed, cut_short = answerer.answer(shaped, tools=p.tools)
        if not text:
            raise PanelError(f"row {p.id!r}: the reference answered with nothing")
        corrected += fixed
        # an answer cut at max_new_tokens never produced the template's end-of-turn token: it is marked and not scored
        answer = {"role": "assistant", "content": text, **({"truncated": True} if cut_short else {})}
        rows.append(PanelRow(p.id, p.domain, messages=p.messages + [answer], tools=p.tools,
                             score_reasoning=score_reasoning))
    sources = [
        {"part": "prompts", "source": str(Path(prompts).name), "license": license},
        {
            "part": "answers",
            "source": f"greedy answers of the reference pack (fingerprint {pack.fingerprint()}, "
            f"max {max_new_tokens} new tokens) through the fidelity oracle (numerics {numerics})",
            "license": "model output",
        },
    ]
    return write_panel(out, rows, name=name or Path(out).name, description=description, sources=sources,
                       extra={"answers": {"pack_fingerprint": pack.fingerprint(), "max_new_tokens": max_new_tokens,
                                          "oracle_corrections": corrected, "numerics": numerics}})


def run(args) -> int:
    con = Console()
    if args.panel_command == "build":
        if args.engine:
            from ..panels.build import EngineSettings, build_panel_from_engine

            if not args.model:
                raise PanelError("panel build --engine needs --model (the model name the engine serves)")
            settings = EngineSettings(max_new_tokens=args.max_new_tokens or 2048, temperature=args.temperature,
                                      seed=args.seed, thinking=args.thinking, concurrency=args.concurrency,
                                      timeout_s=args.timeout)
            panel = build_panel_from_engine(args.prompts, args.engine, args.model, args.out, settings, name=args.name,
                                            description=args.description, license=args.license,
                                            score_reasoning=not args.no_score_reasoning)
            a = json.loads((panel.path / "manifest.json").read_text())["answers"]
            con.print(f"{a['requests']['sent']} requests sent, {a['requests']['from_journal']} answered from the "
                      f"journal; finish reasons {a['finish_reasons']}, {a['truncated_rows']} rows truncated")
        else:
            for flag in ("model", "seed", "thinking"):
                if getattr(args, flag) is not None:
                    raise PanelError(f"--{flag} is for --engine builds; --pack answers greedily through the oracle")
            panel = build_panel(args.prompts, args.pack, args.out, name=args.name, description=args.description,
                                max_new_tokens=args.max_new_tokens or 64, license=args.license,
                                score_reasoning=not args.no_score_reasoning, numerics=args.numerics,
                                activation_budget=args.environment.device_activations_bytes,
                                pack_settings=args.environment.pack_settings())
    elif args.panel_command == "from-text":
        from ..panels.text import panel_from_text

        panel = panel_from_text(args.sources, args.pack, args.out, tokens_per_row=args.tokens_per_row, rows=args.rows,
                                domains=args.domain, field=args.field, bos=args.bos, name=args.name,
                                description=args.description, license=args.license)
    elif args.panel_command == "check":
        from ..panels.check import check_panel, print_findings

        findings = check_panel(args.panel, args.against, n=args.ngram, fields=args.field, pack=args.pack)
        print_findings(con, findings)
        if args.json:
            Path(args.json).write_text(json.dumps(findings.to_json(), indent=2, ensure_ascii=False) + "\n")
        return 1 if findings.hits else 0
    elif args.panel_command == "encode":
        from ..panels.encoding import encode_panel

        try:
            kwargs = json.loads(args.encoder_kwargs)
        except json.JSONDecodeError as e:
            raise PanelError(f"--encoder-kwargs is not JSON: {e}") from None
        panel = encode_panel(args.panel, args.pack, args.out, trust_pack_code=args.trust_pack_code,
                             encoder_kwargs=kwargs, score_reasoning=not args.no_score_reasoning)
    else:
        old = load_panel(Path(args.folder) / "panel.jsonl")
        manifest_path = Path(args.folder) / "manifest.json"
        keep = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        extra = {
            k: v for k, v in keep.items() if k not in ("name", "description", "sources", "rows", "domains", "sha256")
        }
        panel = write_panel(args.folder, old.rows, name=keep.get("name", Path(args.folder).name),
                            description=keep.get("description", ""), sources=keep.get("sources", []), extra=extra)
    con.print(f"wrote {panel.path}: {len(panel.rows)} rows in {len(panel.domains)} domains, sha256 {panel.sha256[:12]}")
    return 0
