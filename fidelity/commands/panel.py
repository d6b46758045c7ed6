"""Build a panel of native conversations: the reference pack answers each prompt greedily (`panel build`), or rewrite a
panel's manifest after editing its rows (`panel manifest`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from ..panels import PanelError, PanelRow, iter_jsonl, load_panel, write_panel


def add_arguments(p: argparse.ArgumentParser):
    sub = p.add_subparsers(dest="panel_command", metavar="ACTION", required=True)
    b = sub.add_parser("build", help="answer prompts greedily with a reference pack and write a panel folder")
    b.add_argument("--prompts", required=True, help='jsonl: {"id", "domain", "prompt"} or {"id", "domain", "messages"} per line')
    b.add_argument("--pack", required=True, help="the reference pack that answers (its oracle decides every token)")
    b.add_argument("-o", "--out", required=True, help="panel folder to write")
    b.add_argument("--name", help="panel name (default: the folder name)")
    b.add_argument("--description", default="")
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--license", default="CC0-1.0", help="license of the prompts (answers are model outputs)")
    m = sub.add_parser("manifest", help="recompute a panel folder's manifest (sha256, row counts) after editing panel.jsonl")
    m.add_argument("folder")


def read_prompts(path: str | Path) -> list[tuple[str, str, list[dict]]]:
    """(id, domain, messages ending with a user turn) per line."""
    out = []
    path = Path(path)
    for n, obj in iter_jsonl(path):
        rid, domain = obj.get("id"), obj.get("domain")
        if not isinstance(rid, str) or not isinstance(domain, str):
            raise PanelError(f"{path} line {n}: 'id' and 'domain' must be strings")
        if isinstance(obj.get("prompt"), str):
            messages = [{"role": "user", "content": obj["prompt"]}]
        elif isinstance(obj.get("messages"), list) and obj["messages"] and obj["messages"][-1].get("role") == "user":
            messages = obj["messages"]
        else:
            raise PanelError(f"{path} line {n} (row {rid!r}): needs a string 'prompt' or 'messages' ending with a user turn")
        out.append((rid, domain, messages))
    return out


class GreedyAnswerer:
    """Greedy answers that are exactly the oracle's argmax at every step.

    Decoding token by token through the oracle costs a full forward per token (it has no KV cache), so a draft comes
    from transformers' cached greedy generate on the same fp32 weights; one teacher-forced oracle pass then checks every
    drafted token, and at the first one that is not the oracle's argmax (a near tie where the two differ in the last
    bits) the oracle's token replaces it and drafting resumes from there."""

    def __init__(self, pack, device: str = "cpu", max_new_tokens: int = 64):
        import torch
        from transformers import AutoModelForCausalLM

        from ..oracle import Oracle
        from ..packs.tokenizer import load_tokenizer

        self.tok = load_tokenizer(pack)
        self.oracle = Oracle(pack, device=device, keep_weights=True)
        src = pack.tokenizer_source()
        if not pack.path.is_dir():
            raise PanelError(f"panel build drafts with transformers and needs a native pack folder, not {pack.path}")
        self.draft = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
        self.max_new = max_new_tokens
        self.stop = {t for t in (self.tok.eos_token_id, self.tok.convert_tokens_to_ids("<|im_end|>")) if t is not None and t >= 0}

    def _draft(self, ids: list[int], n: int) -> list[int]:
        import torch

        with torch.no_grad():
            out = self.draft.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=n, do_sample=False, pad_token_id=self.tok.eos_token_id)
        return out[0, len(ids):].tolist()

    def answer(self, messages: list[dict]) -> tuple[str, int, bool]:
        """(answer text, number of drafted tokens the oracle corrected, whether max_new_tokens cut it short)."""
        prompt = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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


def build_panel(prompts: str | Path, pack_path: str | Path, out: str | Path, *, name: str | None = None,
                description: str = "", max_new_tokens: int = 64, license: str = "CC0-1.0", progress: bool = True):
    from tqdm.auto import tqdm

    from ..packs import open_pack

    pack = open_pack(pack_path)
    items = read_prompts(prompts)
    answerer = GreedyAnswerer(pack, max_new_tokens=max_new_tokens)
    rows, corrected = [], 0
    for rid, domain, messages in tqdm(items, desc="answering", disable=not progress, unit="prompt"):
        text, fixed, cut_short = answerer.answer(messages)
        if not text:
            raise PanelError(f"row {rid!r}: the reference answered with nothing")
        corrected += fixed
        # an answer cut at max_new_tokens never produced the template's end-of-turn token: it is marked and not scored
        answer = {"role": "assistant", "content": text, **({"truncated": True} if cut_short else {})}
        rows.append(PanelRow(rid, domain, messages=messages + [answer]))
    sources = [{"part": "prompts", "source": str(Path(prompts).name), "license": license},
               {"part": "answers", "source": f"greedy answers of the reference pack (fingerprint {pack.fingerprint()}, "
                                             f"max {max_new_tokens} new tokens) through the fidelity oracle",
                "license": "model output"}]
    return write_panel(out, rows, name=name or Path(out).name, description=description, sources=sources,
                       extra={"answers": {"pack_fingerprint": pack.fingerprint(), "max_new_tokens": max_new_tokens,
                                          "oracle_corrections": corrected}})


def run(args) -> int:
    con = Console()
    if args.panel_command == "build":
        panel = build_panel(args.prompts, args.pack, args.out, name=args.name, description=args.description,
                            max_new_tokens=args.max_new_tokens, license=args.license)
    else:
        old = load_panel(Path(args.folder) / "panel.jsonl")
        manifest_path = Path(args.folder) / "manifest.json"
        keep = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        extra = {k: v for k, v in keep.items() if k not in ("name", "description", "sources", "rows", "domains", "sha256")}
        panel = write_panel(args.folder, old.rows, name=keep.get("name", Path(args.folder).name),
                            description=keep.get("description", ""), sources=keep.get("sources", []), extra=extra)
    con.print(f"wrote {panel.path}: {len(panel.rows)} rows in {len(panel.domains)} domains, sha256 {panel.sha256[:12]}")
    return 0
