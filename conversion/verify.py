"""The verification step of `attnres-convert`: run the source and the converted model side by side.

For a standard source it reports the largest logit difference (absolute, and relative to the
largest source logit), whether the argmax token agrees at every position and whether greedy
generations agree token for token. It also reports the difference to the *spec's prediction*: the
source model with each RMSNorm's eps replaced by the effective eps `(c/s)^2 * eps` of its site.
That number is float noise when the converter is right, so any real deviation is the eps effect
the spec describes and nothing else.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_attnres import AttnResConfig, AttnResForCausalLM

from .keymap import apply_key_map, target_shapes
from .standard import sources_per_site

if TYPE_CHECKING:
    from .converter import Plan

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Attention residuals let every layer")
NEW_TOKENS = 8


@dataclass
class VerifyReport:
    """Numbers of one verification run (float32 forward passes)."""

    max_abs_diff: float
    max_rel_diff: float                  # max |diff| / max |source logit|
    logit_scale: float                   # max |source logit|
    argmax_agreement: float              # fraction of positions whose argmax token agrees
    greedy_agree: bool                   # all greedy continuations identical
    vs_prediction: Optional[float]       # max |diff| to the eps-adjusted source (spec prediction)
    reference: str                       # what the converted model was compared with
    num_prompts: int

    def lines(self) -> list[str]:
        """Human-readable summary, printed by the CLI and written into the model card."""
        out = [f"compared with: {self.reference} on {self.num_prompts} prompts (float32)",
               f"max |logit difference|: {self.max_abs_diff:.3e} (relative to max |logit|: {self.max_rel_diff:.3e})",
               f"argmax agreement: {100 * self.argmax_agreement:.1f}% of positions",
               f"greedy generation ({NEW_TOKENS} tokens) agrees: {'yes' if self.greedy_agree else 'NO'}"]
        if self.vs_prediction is not None:
            verdict = ("float noise: the deviation above is the eps effect only" if self.prediction_holds else
                       "LARGER than float noise: the converted model is not what the spec predicts")
            out.append(f"max |difference| to the spec's eps prediction: {self.vs_prediction:.3e} ({verdict})")
        return out

    @property
    def prediction_holds(self) -> bool:
        """The converted model equals the eps-adjusted source up to float32 rounding (which grows with
        depth; 1e-4 of the largest logit leaves room for deep models and is far below a real bug)."""
        return self.vs_prediction is not None and self.vs_prediction <= 1e-4 * self.logit_scale


def prompt_ids(folder: Optional[Path], vocab_size: int) -> list[torch.Tensor]:
    """Token ids of the verification prompts: the source's tokenizer if it has one, else fixed random ids."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder) if folder is not None else None
    except Exception:  # no or unreadable tokenizer files: random ids still exercise every weight
        tokenizer = None
    if tokenizer is not None:
        ids = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
        if all(0 < x.shape[1] and int(x.max()) < vocab_size for x in ids):
            return ids
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (1, 6 + 3 * i), generator=gen) for i in range(len(PROMPTS))]


@torch.no_grad()
def _logits(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    return [model(x).logits.float() for x in ids]


@torch.no_grad()
def _greedy(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    return [model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                           min_new_tokens=NEW_TOKENS, pad_token_id=0) for x in ids]


def compare(reference: list[torch.Tensor], converted: list[torch.Tensor]) -> tuple[float, float, float, float]:
    """Max absolute difference, max relative difference, max |reference logit| and argmax agreement."""
    diff = max(float((a - b).abs().max()) for a, b in zip(reference, converted))
    scale = max(float(a.abs().max()) for a in reference)
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).flatten() for a, b in zip(reference, converted)])
    return diff, diff / max(scale, 1e-30), scale, float(agree.float().mean())


def apply_predicted_eps(model: torch.nn.Module, config: AttnResConfig, stream_scale: float) -> None:
    """Set every stream-reading RMSNorm of a standard model to the eps the converted site effectively
    uses: `RMSNorm(s*H/c; eps) == RMSNorm(H; (c/s)^2 * eps)` (spec, "Converting...")."""
    counts = sources_per_site(config)
    inner = model.model
    for layer, norm_pair in enumerate((l.input_layernorm, l.post_attention_layernorm) for l in inner.layers):
        for site, norm in zip((2 * layer, 2 * layer + 1), norm_pair):
            norm.variance_epsilon = config.rms_norm_eps * (counts[site] / stream_scale) ** 2
    inner.norm.variance_epsilon = config.rms_norm_eps * (counts[-1] / stream_scale) ** 2


def _load(path: Path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every weight to `dtype` (kept in float32), as the conversion did to the output."""
    for param in model.parameters():
        param.copy_(param.to(dtype).float())


def verify_standard(src: Path, converted: Path, config: AttnResConfig, stream_scale: float,
                    dtype: torch.dtype = torch.float32, reference: str | None = None) -> VerifyReport:
    """Run the source and the converted checkpoint (output dtype `dtype`) on the prompts and compare.
    The spec's prediction is made from the source weights rounded to `dtype`, so that it isolates
    the eps effect; the headline difference includes the rounding."""
    steps = tqdm(total=5, desc="Verifying", unit="step")
    ids = prompt_ids(src, config.vocab_size)
    source = _load(src)
    ref_logits, ref_tokens = _logits(source, ids), _greedy(source, ids)
    steps.update(2)
    round_weights(source, dtype)
    apply_predicted_eps(source, config, stream_scale)
    predicted = _logits(source, ids)
    del source
    steps.update(1)
    model = _load(converted)
    got_logits, got_tokens = _logits(model, ids), _greedy(model, ids)
    steps.update(2)
    steps.close()
    diff, rel, scale, agree = compare(ref_logits, got_logits)
    greedy = all(torch.equal(a, b) for a, b in zip(ref_tokens, got_tokens))
    vs_pred = compare(predicted, got_logits)[0]
    reference = reference or f"source model ({src.name})"
    return VerifyReport(diff, rel, scale, agree, greedy, vs_pred, reference, len(ids))


def calibrate_stream_scale(src: Path, config: AttnResConfig, candidates: list[float]) -> dict[float, float]:
    """The relative logit error each candidate scale `s` would cost, from the source model alone: the
    spec's prediction (each site's eps set to `(c/s)^2 * eps`) against the source, on the prompts."""
    ids = prompt_ids(src, config.vocab_size)
    source = _load(src)
    reference = _logits(source, ids)
    errors = {}
    for scale in tqdm(candidates, desc="Calibrating stream scale", unit="scale"):
        apply_predicted_eps(source, config, scale)
        errors[scale] = compare(reference, _logits(source, ids))[1]
    return errors


def verify_attnres_layout(plan: "Plan", converted: Path) -> VerifyReport:
    """For another AttnRes layout the source model *is* an AttnRes model with renamed weights: build it
    from the source tensors in float32 and compare it with the saved, reloaded checkpoint."""
    model = AttnResForCausalLM(plan.config).eval()
    tensors = apply_key_map(plan.source, plan.rules, plan.fills, target_shapes(model), plan.ctx, torch.float32)
    model.load_state_dict(tensors, strict=False)
    ids = prompt_ids(None, plan.config.vocab_size)
    reloaded = _load(converted)
    diff, rel, scale, agree = compare(_logits(model, ids), _logits(reloaded, ids))
    greedy = all(torch.equal(a, b) for a, b in zip(_greedy(model, ids), _greedy(reloaded, ids)))
    reference = "the source weights in float32 (AttnRes layout)"
    return VerifyReport(diff, rel, scale, agree, greedy, None, reference, len(ids))
