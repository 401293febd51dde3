"""What `attnres-retrofit` optimises, and how it picks the model it keeps.

A converted checkpoint at zero pseudo-queries computes what its source did, so the model as it is
given is the source's distribution: the teacher. Training adds `kl_weight * KL(teacher || student)`,
per token, to the language-model loss, so the depth parameters learn the corpus without moving the
model away from its source where the corpus says nothing (the cost: one extra forward pass per step).
Training windows are cut both at fixed strides and at paragraph starts, so short contexts that begin
where prompts begin are trained too. The held-out set measures both, long windows and the first few
tokens after each held-out paragraph start; the Trainer keeps the best evaluated checkpoint, and the
retrofit keeps the starting model when no checkpoint beats it on both (`no_worse`).
"""

from __future__ import annotations

import copy
import re

import torch
from transformers import Trainer, TrainerCallback

PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


def paragraph_windows(tokenizer, texts: list[str], length: int, min_tokens: int = 1) -> torch.Tensor:
    """`[n, length]` windows, each starting at a paragraph start (a file's start or the text after a blank
    line) and running on into the following paragraphs; paragraphs with fewer than `min_tokens` tokens
    of their own start no window. Empty when the texts hold none."""
    windows = []
    for text in texts:
        ids: list[int] = []
        starts = []
        for paragraph in PARAGRAPH_BREAK.split(text):
            if not paragraph.strip():
                continue
            own = tokenizer(paragraph.strip() + "\n\n", add_special_tokens=False, verbose=False)["input_ids"]
            if len(own) >= min_tokens:
                starts.append(len(ids))
            ids.extend(own)
        windows += [ids[s : s + length] for s in starts if s + length <= len(ids)]
    return torch.tensor(windows, dtype=torch.long).view(-1, length)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats per predicted token) over `windows`."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(model.device)
        logits = model(input_ids=batch).logits.float()
        total += torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten(),
                                                   reduction="sum").item()
    model.train(was_training)
    return total / windows[:, 1:].numel()


def heldout_metrics(model, long: torch.Tensor, short: torch.Tensor) -> dict[str, float]:
    """`loss` over the long held-out windows, `short_loss` over the short ones (paragraph starts), and
    their sum `heldout`, by which the best checkpoint is chosen."""
    metrics = {"loss": heldout_loss(model, long), "short_loss": heldout_loss(model, short)}
    return {**metrics, "heldout": metrics["loss"] + metrics["short_loss"]}


def no_worse(after: dict[str, float], before: dict[str, float]) -> bool:
    """Whether the trained model is at least as good as the start on both held-out measures."""
    return after["loss"] <= before["loss"] and after["short_loss"] <= before["short_loss"]


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """`KL(teacher || student)` of the next-token distributions, in nats, averaged over positions
    (logits `[..., vocab]`; computed in float32)."""
    teacher = teacher_logits.float().log_softmax(-1)
    student = student_logits.float().log_softmax(-1)
    kl = torch.nn.functional.kl_div(student.flatten(0, -2), teacher.flatten(0, -2), log_target=True,
                                    reduction="sum")
    return kl / teacher[..., 0].numel()


class RetrofitTrainer(Trainer):
    """The Trainer with the distillation term in its loss and the held-out measures as its evaluation.

    `teacher` is a frozen copy of the model as it was given (made here; none when `kl_weight` is 0).
    `long`/`short` are the held-out windows that `evaluate` measures (`heldout_metrics`).
    """

    def __init__(self, *args, kl_weight: float, long: torch.Tensor, short: torch.Tensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.kl_weight, self.long, self.short = kl_weight, long, short
        self.teacher = None
        if kl_weight > 0:
            self.teacher = copy.deepcopy(self.model).eval().requires_grad_(False).to(self.args.device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # The language-model loss exactly as the Trainer computes it (its scaling across processes); the
        # KL term is a per-process mean, which DDP's gradient averaging turns into the global mean.
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(input_ids=inputs["input_ids"]).logits
            loss = loss + self.kl_weight * kl_to_teacher(outputs.logits, teacher_logits)
        return (loss, outputs) if return_outputs else loss

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        metrics = heldout_metrics(self.model, self.long, self.short)
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class EvaluateAtEnd(TrainerCallback):
    """Evaluate (and so save) at the last step too, so the final model competes for the best."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps:
            control.should_evaluate = control.should_save = True
        return control
