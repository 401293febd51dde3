"""Declarative key maps: a table of rules plus small named transforms.

A layout is described by `Rule`s (source key pattern(s) -> target key pattern, through a named
transform) and `Fill`s (target keys that have no source, created by a named filler). Patterns are
literal keys in which `{i}` stands for a layer index. `apply_key_map` is strict on purpose: a source
key no rule claims, two sources claiming one target, a target key nothing fills, or a tensor whose
shape differs from the AttnRes model's, is an error that lists every such key, never a silent drop.
"""

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from tqdm.auto import tqdm

from .errors import ConversionError, listing


@dataclass(frozen=True)
class Rule:
    """Source key pattern(s) -> target key pattern via a transform named in `TRANSFORMS`.

    `target=None` drops the matched keys; only for tensors the target recomputes (rotary tables).
    """

    sources: tuple[str, ...]
    target: str | None
    transform: str = "copy"

    def __post_init__(self):
        if self.transform not in TRANSFORMS:  # a typo in a table fails at import, not mid-conversion
            raise ValueError(f"Rule {self.sources}: unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}")


@dataclass(frozen=True)
class Fill:
    """A target key pattern that no source provides, created by a filler named in `FILLERS`."""

    target: str
    filler: str

    def __post_init__(self):
        if self.filler not in FILLERS:
            raise ValueError(f"Fill {self.target}: unknown filler {self.filler!r}; known: {sorted(FILLERS)}")


@dataclass(frozen=True)
class TransformContext:
    """What the transforms need to know. `stream_scale` multiplies the whole residual stream (see
    `scale_stream`); `tied` says whether lm_head reads the embedding matrix."""

    stream_scale: float = 1.0
    tied: bool = False


class TensorSource(Protocol):
    """Read access to a checkpoint's tensors, one at a time (so sharded checkpoints stay lazy)."""

    def keys(self) -> Iterable[str]: ...

    def get(self, key: str) -> torch.Tensor: ...

    def shape(self, key: str) -> tuple[int, ...]: ...   # without reading the data

    def dtype(self, key: str) -> torch.dtype: ...       # the stored dtype, without reading the data


def _copy(t: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
    return t


def _scale_stream(t: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
    # Every tensor that *writes* into the residual stream (embedding, o_proj, down_proj and their
    # biases) is scaled by s, so the whole stream becomes s*H; every reader applies RMSNorm first.
    return t if ctx.stream_scale == 1 else (t.double() * ctx.stream_scale).to(t.dtype)


def _unscale_tied_head(t: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
    # A tied lm_head reads the *scaled* embedding matrix; dividing the final norm's gain by s keeps
    # the logits unchanged without untying (no extra vocab x d matrix).
    if not ctx.tied or ctx.stream_scale == 1:
        return t
    return (t.double() / ctx.stream_scale).to(t.dtype)


def _as_query(t: torch.Tensor, ctx: TransformContext) -> torch.Tensor:
    # Training scripts store a pseudo-query either as Linear(d, 1).weight [1, d] or as a bare [d].
    return t.reshape(1, -1) if t.dim() == 1 else t


TRANSFORMS: dict[str, Callable[[torch.Tensor, TransformContext], torch.Tensor]] = {
    "copy": _copy,
    "scale_stream": _scale_stream,
    "unscale_tied_head": _unscale_tied_head,
    "as_query": _as_query,
}

# How a transform changes a shape, so that shapes are checked before any tensor is read.
TRANSFORM_SHAPES: dict[str, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    "as_query": lambda shape: (1, *shape) if len(shape) == 1 else shape,
}

FILLERS: dict[str, Callable[[torch.Size, torch.dtype], torch.Tensor]] = {
    "zeros": lambda shape, dtype: torch.zeros(shape, dtype=dtype),   # pseudo-queries, absent biases
    "ones": lambda shape, dtype: torch.ones(shape, dtype=dtype),     # depth key-norm gains
}


# Placeholders of key patterns: `{i}` a layer index, `{e}` an expert index.
PLACEHOLDERS = ("i", "e")


def _compile(pattern: str) -> re.Pattern:
    regex = re.escape(pattern)
    for name in PLACEHOLDERS:
        regex = regex.replace(rf"\{{{name}\}}", rf"(?P<{name}>\d+)")
    return re.compile(regex + r"\Z")


def _render(pattern: str, match: re.Match) -> str:
    for name in PLACEHOLDERS:
        pattern = pattern.replace("{" + name + "}", match.group(name)) if "{" + name + "}" in pattern else pattern
    return pattern


def plan_key_map(source_keys: Iterable[str], rules: Iterable[Rule]) -> dict[str, tuple[str, str]]:
    """`{target_key: (source_key, transform)}` for every source key; raises listing unmapped keys
    and targets claimed twice."""
    compiled = [(rule, [_compile(p) for p in rule.sources]) for rule in rules]
    plan, unmapped, claims = {}, [], {}
    for key in source_keys:
        hit = next(((rule, m) for rule, pats in compiled for p in pats if (m := p.match(key))), None)
        if hit is None:
            unmapped.append(key)
            continue
        rule, match = hit
        if rule.target is None:
            continue
        target = _render(rule.target, match)
        claims.setdefault(target, []).append(key)
        plan[target] = (key, rule.transform)
    if unmapped:
        raise ConversionError(
            f"{len(unmapped)} source key(s) match no rule of the key map: {listing(unmapped)}. "
            "The checkpoint has tensors this layout does not know; check that SRC is the architecture "
            "it claims to be (config.json `architectures`), or extend the key map in attnres.conversion."
        )
    twice = {t: ks for t, ks in claims.items() if len(ks) > 1}
    if twice:
        pairs = [f"{t} <- {' and '.join(ks)}" for t, ks in twice.items()]
        raise ConversionError(f"Several source keys map to one target key: {listing(pairs)}. "
                              "Keep only one naming variant in the checkpoint.")
    return plan


def _fill_targets(missing: Iterable[str], fills: Iterable[Fill]) -> dict[str, str]:
    compiled = [(fill, _compile(fill.target)) for fill in fills]
    found = {}
    for key in missing:
        filler = next((fill.filler for fill, pat in compiled if pat.match(key)), None)
        if filler is not None:
            found[key] = filler
    return found


def target_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """Shape of every tensor a checkpoint of `model` must provide, in the layout on disk: one tensor per
    routed expert and projection (transformers keeps them stacked in memory; `unstack_experts`), and no
    tied lm_head."""
    shapes = {}
    for key, tensor in model.state_dict().items():
        if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            shapes.update({k: torch.Size(v) for k, v in expert_shapes(key, tuple(tensor.shape)).items()})
        else:
            shapes[key] = tensor.shape
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    return shapes


def expert_shapes(key: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The per-expert checkpoint keys and shapes of a stacked expert tensor (`[E, 2I, d]` gate/up,
    `[E, d, I]` down)."""
    block, kind = key.rsplit(".experts.", 1)
    experts = shape[0]
    if kind == "down_proj":
        return {f"{block}.experts.{e}.down_proj.weight": shape[1:] for e in range(experts)}
    half = (shape[1] // 2, shape[2])
    return {f"{block}.experts.{e}.{p}_proj.weight": half for e in range(experts) for p in ("gate", "up")}


def stack_experts(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint-layout tensors with each MoE block's per-expert tensors stacked as `model` holds them."""
    out = dict(tensors)
    for key, param in model.state_dict().items():
        if not key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            continue
        block, kind = key.rsplit(".experts.", 1)
        parts = [(f"{block}.experts.{e}.down_proj.weight",) if kind == "down_proj" else
                 (f"{block}.experts.{e}.gate_proj.weight", f"{block}.experts.{e}.up_proj.weight")
                 for e in range(param.shape[0])]
        out[key] = torch.stack([torch.cat([out.pop(name) for name in names], dim=0) for names in parts])
    return out


@dataclass
class KeyMapPlan:
    """A checked key map: `{target: (source key, transform)}` and `{target: filler}`."""

    mapped: dict[str, tuple[str, str]]
    filled: dict[str, str]


def resolve_key_map(source: TensorSource, rules: Iterable[Rule], fills: Iterable[Fill],
                    shapes: Mapping[str, torch.Size]) -> KeyMapPlan:
    """Check the whole map against the target `shapes` from keys and shapes alone (no tensor data):
    raises listing leftover, unfilled or misshapen keys."""
    plan = plan_key_map(list(source.keys()), rules)
    foreign = [f"{src} -> {tgt}" for tgt, (src, _) in plan.items() if tgt not in shapes]
    if foreign:
        raise ConversionError(
            f"Source key(s) map to target keys the AttnRes model does not have: {listing(foreign)}. "
            "The target config disagrees with the checkpoint (e.g. a bias or q/k norm the config turns off)."
        )
    fillers = _fill_targets([k for k in shapes if k not in plan], fills)
    unfilled = [k for k in shapes if k not in plan and k not in fillers]
    if unfilled:
        raise ConversionError(
            f"{len(unfilled)} AttnRes parameter(s) have no source tensor and no filler: {listing(unfilled)}. "
            "The checkpoint is missing tensors (a truncated or partial export?) or its config asks for "
            "more layers/biases than it stores."
        )
    bad = []
    for target, (key, transform) in sorted(plan.items()):
        shape = TRANSFORM_SHAPES.get(transform, lambda s: s)(tuple(source.shape(key)))
        if shape != tuple(shapes[target]):
            bad.append(f"{key}: {shape} (expected {tuple(shapes[target])} for {target})")
    if bad:
        raise ConversionError(
            f"Shape mismatch for {len(bad)} tensor(s): {listing(bad, limit=8)}. The config (hidden_size, "
            "intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size) does not "
            "describe these weights; fix the config or pass the checkpoint it belongs to."
        )
    return KeyMapPlan(plan, fillers)


def apply_key_map(source: TensorSource, rules: Iterable[Rule], fills: Iterable[Fill],
                  shapes: Mapping[str, torch.Size], ctx: TransformContext,
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every target tensor, converted to `dtype` (the map is checked first, see `resolve_key_map`)."""
    plan = resolve_key_map(source, rules, fills, shapes)
    out, damaged, overflowed = {}, [], []
    with tqdm(sorted(plan.mapped.items()), desc="Converting tensors", unit="tensor") as bar:   # closed on any exit
        for target, (key, transform) in bar:
            tensor = source.get(key)
            out[target] = TRANSFORMS[transform](tensor, ctx).to(dtype).contiguous()
            if not torch.isfinite(tensor).all():
                damaged.append(key)
            elif not torch.isfinite(out[target]).all():
                overflowed.append(key)
    if damaged:               # the calibration and verification would only say NaN, or blame the converter
        raise ConversionError(f"The source holds NaN or infinite values in {listing(damaged)}; the checkpoint is "
                              "damaged (a diverged training run, a bad download?): convert an intact one.")
    if overflowed:
        raise ConversionError(f"{listing(overflowed)} overflow {str(dtype).removeprefix('torch.')} (values past its "
                              "range once converted); convert with --dtype bfloat16 or float32.")
    for key, filler in plan.filled.items():
        out[key] = FILLERS[filler](shapes[key], dtype)
    return out
