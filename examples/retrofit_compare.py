"""Source Llama vs converted (zero queries) vs retrofitted vs a control, on the same held-out text.

    .venv/bin/python examples/retrofit_compare.py --source LLAMA_DIR --converted ATTNRES_DIR \\
        --retrofitted RETROFIT_DIR --corpus CORPUS [--control-out DIR --json FILE]

LLAMA_DIR may be the GGUF file itself (dequantised to float32 as attnres-convert does).
`RETROFIT_DIR` is the output of `attnres-retrofit ATTNRES_DIR CORPUS --out RETROFIT_DIR` (its
`retrofit.json` holds the budget). The control trains as many parameters of the source Llama, its
RMSNorm gains, with the same Trainer settings, data order, steps, batch and learning rate
(`attnres-retrofit`'s own training code, `--train norms`), and is written to `--control-out`.
Every model is measured on the same held-out windows (the corpus files the retrofit held out) and
answers the same chat question greedily. Prints a markdown table and writes it as JSON to `--json`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_attnres  # noqa: F401  (registers the architecture with the Auto classes)
from attnres.conversion import retrofit
from attnres.conversion.distill import heldout_loss
from attnres.conversion.publish import staged_folder, user_cache_dir

QUESTIONS = ("What is the capital of France?", "What is 2 + 2?")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", type=Path, required=True, help="the source Llama folder")
    p.add_argument("--converted", type=Path, required=True, help="its attnres-convert output (zero queries)")
    p.add_argument("--retrofitted", type=Path, required=True, help="attnres-retrofit's --out folder")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--control-out", type=Path, default=user_cache_dir() / "retrofit" / "control")
    p.add_argument("--control-lr", type=float, default=1e-2,
                   help="learning rate of the control's RMSNorm gains (the retrofit's own lr is in retrofit.json)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--max-new-tokens", type=int, default=24)
    return p.parse_args(argv)


@torch.no_grad()
def answer(model, tok, question: str, max_new_tokens: int) -> str:
    """The greedy chat answer to `question` (the tokenizer's chat template, generation prompt on)."""
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def measure(name: str, model, tok, windows: torch.Tensor, trained: int, max_new_tokens: int) -> dict:
    loss = heldout_loss(model.eval(), windows)
    row = {"model": name, "trained_parameters": trained, "heldout_loss": loss, "heldout_ppl": math.exp(loss),
           "answers": {q: answer(model, tok, q, max_new_tokens) for q in QUESTIONS}}
    print(json.dumps(row), file=sys.stderr)
    return row


def load_source(path: Path):
    """The source Llama: a transformers folder, or a GGUF file dequantised to float32."""
    if path.suffix == ".gguf":
        from attnres.conversion.gguf_source import load_dequantised

        return load_dequantised(path)[0].train()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def train_control(source: Path, train_windows: torch.Tensor, heldout: tuple, budget: dict, out: Path):
    """The source Llama with only its RMSNorm gains trained, on retrofit's data and budget (`budget["lr"]`
    is the control's). A control trained earlier is reused only if it was trained on this budget."""
    if (out / "config.json").is_file() and (out / "control.json").is_file():
        stored = json.loads((out / "control.json").read_text())
        if {k: v for k, v in stored.items() if k != "trained_parameters"} == budget:
            return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), stored["trained_parameters"]
    model = load_source(source)
    names = retrofit.select_trainable(model, "norms")
    args = retrofit.parse_args([str(source), "unused", "--work-dir", str(out) + "-work", "--steps",
                                str(budget["steps"]), "--batch-size", str(budget["batch_size"]), "--seq-len",
                                str(budget["seq_len"]), "--lr", str(budget["lr"]), "--warmup", str(budget["warmup"]),
                                "--seed", str(budget["seed"]), "--train", "norms",
                                "--kl-weight", str(budget.get("kl_weight", 0.0))])
    retrofit.train(model, train_windows, heldout, args)
    trained = sum(p.numel() for n, p in model.named_parameters() if n in names)
    with staged_folder(out) as tmp:                    # replaces a control of another budget whole, or nothing
        model.save_pretrained(tmp)
        (tmp / "control.json").write_text(json.dumps({"trained_parameters": trained, **budget}) + "\n")
    return model, trained


def check_control_out(out: Path) -> None:
    """Refuse, before any work, a --control-out that is not a control this script wrote (a control.json
    inside): it is replaced whole."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"error: --control-out {out} is a file; pass a folder for the control model")
    if out.is_dir() and any(out.iterdir()) and not (out / "control.json").is_file():
        raise SystemExit(f"error: --control-out {out} holds files that are not a control model written by this "
                         "script (no control.json), and the control replaces the folder whole; choose another "
                         "folder, or empty this one")


def main(argv=None) -> int:
    args = parse_args(argv)
    check_control_out(args.control_out)
    budget = {k: v for k, v in json.loads((args.retrofitted / "retrofit.json").read_text()).items()
              if k != "history"}
    tok = AutoTokenizer.from_pretrained(args.converted)
    texts = retrofit.read_corpus(args.corpus, tuple(budget["pattern"]), budget["validation_percent"])
    windows = retrofit.spread(retrofit.token_windows(tok, texts["validation"], budget["seq_len"], "held-out"),
                              budget["heldout_windows"])
    train_windows = retrofit.training_windows(tok, texts["train"], budget["seq_len"])
    heldout = retrofit.heldout_windows(tok, texts["validation"], retrofit.parse_args(
        ["unused", "unused", "--seq-len", str(budget["seq_len"]), "--eval-windows", str(budget["heldout_windows"]),
         "--short-tokens", str(budget.get("short_tokens", 16))]))
    control_budget = {**budget, "lr": args.control_lr}
    control, control_params = train_control(args.source, train_windows, heldout, control_budget, args.control_out)
    rows = [measure("source Llama", load_source(args.source), tok,
                    windows, 0, args.max_new_tokens),
            measure("converted AttnRes (zero queries)", AutoModelForCausalLM.from_pretrained(
                args.converted, dtype=torch.float32), tok, windows, 0, args.max_new_tokens),
            measure("retrofitted AttnRes (depth parameters trained)", AutoModelForCausalLM.from_pretrained(
                args.retrofitted, dtype=torch.float32), tok, windows, budget["trained_parameters"],
                args.max_new_tokens),
            measure("control: source Llama, RMSNorm gains trained", control, tok, windows, control_params,
                    args.max_new_tokens)]
    print(f"\nheld-out: {windows.shape[0]} windows of {budget['seq_len']} tokens; training: {budget['steps']} steps "
          f"of {budget['batch_size']} x {budget['seq_len']} tokens, lr {budget['lr']} (control: {args.control_lr})\n")
    print("| model | trained params | held-out loss | perplexity | " + " | ".join(QUESTIONS) + " |")
    print("|---|---:|---:|---:|" + "---|" * len(QUESTIONS))
    for r in rows:
        answers = " | ".join(r["answers"][q].replace("\n", " ").replace("|", "/") for q in QUESTIONS)
        print(f"| {r['model']} | {r['trained_parameters']:,} | {r['heldout_loss']:.4f} | {r['heldout_ppl']:.2f} | "
              f"{answers} |")
    if args.json:
        args.json.write_text(json.dumps({"budget": budget, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
