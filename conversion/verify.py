"""The verification step of `attnres-convert`: run the source and the converted model side by side.

For a standard source it reports the largest logit difference (absolute, and relative to the
largest source logit), whether the argmax token agrees at every position and whether greedy
generations agree token for token. It also reports the difference to the *spec's prediction*: the
source model, its weights rounded to the output dtype, with each RMSNorm's eps replaced by the
effective eps `(c/s)^2 * eps` of its site. That number is float noise when the converter is right,
so any real deviation is the eps effect the spec describes and nothing else; when it is not, or
greedy generation differs from the source at the output's precision, the report fails and the
converter publishes nothing (`VerifyReport.passed`).
"""

from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from modeling_attnres import AttnResConfig, AttnResForCausalLM

from .datatypes import Plan, VerifyReport
from .keymap import apply_key_map, stack_experts, target_shapes
from .standard import sources_per_site

PROMPTS = ("The capital of France is", "def fibonacci(n):", "Attention residuals let every layer")
NEW_TOKENS = 8


def prompt_ids(folder: Path | None, vocab_size: int, max_positions: int | None = None) -> list[torch.Tensor]:
    """Token ids of the verification prompts: the source's tokenizer if it has one, else fixed random ids;
    each prompt with its greedy continuation (`NEW_TOKENS`) inside `max_positions`, where the converted
    model equals its source (a window clipped by --clip-to-sliding-window).

    The tokenizer's ids are used only where every prompt holds several distinct tokens: a tokenizer that
    maps the prompts to one repeated token (every word unknown) makes every position's value the same, so
    attention's output no longer depends on its scores and the check would see nothing of the attention."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder) if folder is not None else None
    except Exception:  # no or unreadable tokenizer files: random ids still exercise every weight
        tokenizer = None
    ids = None
    if tokenizer is not None:
        ids = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
        if not all(0 < x.shape[1] and int(x.max()) < vocab_size and x.unique().numel() >= min(3, x.shape[1])
                   for x in ids):
            ids = None
    if ids is None:
        gen = torch.Generator().manual_seed(0)
        ids = [torch.randint(0, vocab_size, (1, 6 + 3 * i), generator=gen) for i in range(len(PROMPTS))]
    longest = max(1, max_positions - NEW_TOKENS) if max_positions is not None else None
    return [x[:, :longest] for x in ids]


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
    uses: `RMSNorm(s*H/c; eps) == RMSNorm(H; (c/s)^2 * eps)` (docs/spec.md, "Converting...").
    The norms read the stream in site order (each layer's attention, its MLP, then the output)."""
    for count, norm in zip(sources_per_site(config), stream_norms(model), strict=True):
        norm.variance_epsilon = config.rms_norm_eps * (count / stream_scale) ** 2


def stream_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The RMSNorms of a standard model that read the residual stream, in site order."""
    inner = model.model
    return [n for l in inner.layers for n in (l.input_layernorm, l.post_attention_layernorm)] + [inner.norm]


def load_source(path: Path, **kwargs) -> torch.nn.Module:
    """A checkpoint's transformers model in float32, eval mode (the source, or a converted output)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()



@torch.no_grad()
def round_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every weight to `dtype` (kept in float32), as the conversion did to the output."""
    for param in model.parameters():
        param.copy_(param.to(dtype).float())


def _at_precision(what: str, dtype: torch.dtype) -> str:
    return what if dtype == torch.float32 else f"{what} with weights rounded to {str(dtype).removeprefix('torch.')}"


def verify_standard(source: torch.nn.Module, ids: list[torch.Tensor], converted: Path, config: AttnResConfig,
                    stream_scale: float, dtype: torch.dtype = torch.float32, reference: str = "the source model",
                    ) -> VerifyReport:
    """Run the source model (float32, as loaded for the conversion; its weights are rounded here, so
    this is its last use) and the converted checkpoint (output dtype `dtype`) on `ids` and compare.
    The headline difference is to the source as given (it includes the rounding to `dtype`); the
    prediction and the greedy reference are made from the source weights rounded to `dtype`, so that
    they isolate the eps effect."""
    with tqdm(total=5, desc="Verifying", unit="step") as steps:     # closed (its line ended) on any exit
        ref_logits = _logits(source, ids)
        round_weights(source, dtype)
        ref_tokens = _greedy(source, ids)
        steps.update(2)
        apply_predicted_eps(source, config, stream_scale)
        predicted, predicted_routes = _logits(source, ids), _routes(source, ids, config)
        steps.update(1)
        model = load_source(converted)
        got_logits, got_tokens = _logits(model, ids), _greedy(model, ids)
        routing = routing_agreement(predicted_routes, _routes(model, ids, config))
        steps.update(2)
    diff, rel, scale, agree = compare(ref_logits, got_logits)
    greedy = all(torch.equal(a, b) for a, b in zip(ref_tokens, got_tokens))
    eps_effect = config.rms_norm_eps > 0
    explained = "the deviation above is the eps effect only" if eps_effect else "rms_norm_eps is 0: no eps effect"
    return VerifyReport(diff, rel, scale, agree, greedy, compare(predicted, got_logits)[0], reference,
                        _at_precision("the spec's eps prediction", dtype), explained,
                        _at_precision("the source", dtype), len(ids), NEW_TOKENS, routing, eps_effect)


@torch.no_grad()
def _routes(model, ids: list[torch.Tensor], config: AttnResConfig) -> list[torch.Tensor] | None:
    """The experts each token is routed to, per prompt and sparse layer (`[tokens, k]`, sorted), or
    `None` for a dense model."""
    if not config.num_experts:
        return None
    return [logits.topk(config.num_experts_per_tok, dim=-1).indices.sort(dim=-1).values
            for x in ids for logits in model(x, output_router_logits=True).router_logits]


def routing_agreement(a: list[torch.Tensor] | None, b: list[torch.Tensor] | None) -> float | None:
    """The fraction of (token, sparse layer) pairs whose chosen experts are the same set in both."""
    if a is None:
        return None
    same = torch.cat([(x == y).all(-1) for x, y in zip(a, b, strict=True)])
    return float(same.float().mean())


def calibrate_stream_scale(source: torch.nn.Module, ids: list[torch.Tensor], config: AttnResConfig,
                           candidates: list[float]) -> dict[float, float]:
    """The relative logit error each candidate scale `s` would cost, from the source model alone: the
    spec's prediction (each site's eps set to `(c/s)^2 * eps`) against the source, on `ids`. The
    source's own eps values are put back afterwards."""
    reference = _logits(source, ids)
    norms = stream_norms(source)
    original = [norm.variance_epsilon for norm in norms]
    errors = {}
    try:
        with tqdm(candidates, desc="Calibrating stream scale", unit="scale") as bar:    # closed on any exit
            for scale in bar:
                apply_predicted_eps(source, config, scale)
                errors[scale] = compare(reference, _logits(source, ids))[1]
    finally:
        for norm, eps in zip(norms, original):
            norm.variance_epsilon = eps
    return errors


def verify_attnres_layout(plan: Plan, converted: Path) -> VerifyReport:
    """For another AttnRes layout the source model *is* an AttnRes model with renamed weights: build it
    from the source tensors in float32 and compare it with the saved, reloaded checkpoint; rounded to
    the output dtype, the source must be reproduced up to float noise."""
    model = AttnResForCausalLM(plan.config).eval()
    tensors = apply_key_map(plan.source, plan.rules, plan.fills, target_shapes(model), plan.ctx, torch.float32)
    model.load_state_dict(stack_experts(tensors, model), strict=False)
    ids = prompt_ids(None, plan.config.vocab_size)
    ref_logits = _logits(model, ids)
    round_weights(model, plan.dtype)
    predicted, ref_tokens = _logits(model, ids), _greedy(model, ids)
    reloaded = load_source(converted)
    got_logits = _logits(reloaded, ids)
    diff, rel, scale, agree = compare(ref_logits, got_logits)
    greedy = all(torch.equal(a, b) for a, b in zip(ref_tokens, _greedy(reloaded, ids)))
    weights = _at_precision("the source weights", plan.dtype)
    return VerifyReport(diff, rel, scale, agree, greedy, compare(predicted, got_logits)[0],
                        "the source weights in float32 (AttnRes layout)", weights,
                        "the renamed weights are the source's", weights, len(ids), NEW_TOKENS, eps_effect=False)
