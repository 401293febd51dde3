"""The data types of a conversion: its options, its plan, the verification report and the result.

They live apart from the code that fills them (`converter`, `verify`, `card`, `cli`), so that each of
those imports this module and none imports the orchestrator back.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch

from modeling_attnres import AttnResConfig

from .keymap import Fill, Rule, TensorSource, TransformContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ConvertOptions:
    """Knobs of a conversion; the defaults are what `attnres-convert SRC DST` does.

    block_size: layers per block (default ceil(L/8), about 8 blocks). mode: "block" or "full".
    stream_scale: residual-stream scale s for standard models (default: see `choose_stream_scale`;
    1 leaves the weights bit-identical). dtype: "auto" (the source's; float32 for a GGUF) or a name in
    `DTYPES`. verify: run both models and refuse to publish a conversion that fails the check, unless
    keep_failed. seed_block_size / config_path: for state-dict files (block size in sublayers; config json).
    """

    block_size: int | None = None
    mode: str = "block"
    stream_scale: float | None = None
    dtype: str = "auto"
    overwrite: bool = False
    verify: bool = True
    keep_failed: bool = False
    clip_to_window: bool = False
    seed_block_size: int | None = None
    config_path: Path | None = None
    revision: str | None = None
    gguf_file: str | None = None         # the .gguf to convert in a folder or Hub repo holding several
    max_shard_size: str = "5GB"
    source_label: str | None = None      # how the summary and model card name SRC (default: SRC as given)


@dataclass
class Plan:
    """What to convert and how: the tensors, the key map, the target config."""

    layout: str                      # a source architecture name, or "attnres" for other AttnRes layouts
    source: TensorSource
    rules: tuple[Rule, ...]
    fills: tuple[Fill, ...]
    config: AttnResConfig
    ctx: TransformContext
    folder: Path | None              # where side files (tokenizer, ...) and the source model live
    dtype: torch.dtype               # of the output
    scale_errors: dict[float, float] = field(default_factory=dict)   # calibration: s -> predicted error
    model: torch.nn.Module | None = None         # a standard source as loaded once (float32), for verification
    ids: list[torch.Tensor] = field(default_factory=list)           # the verification prompts' token ids


@dataclass
class VerifyReport:
    """Numbers of one verification run (float32 forward passes) and its verdict.

    The headline numbers compare with the source as given. The verdict rests on what the conversion
    must reproduce up to float noise (`prediction`: for a standard model the source with the spec's
    eps change, its weights rounded to the output dtype) and on greedy generation agreeing with
    `greedy_reference` (the source at the output's precision).
    """

    max_abs_diff: float
    max_rel_diff: float                  # max |diff| / max |source logit|
    logit_scale: float                   # max |source logit|
    argmax_agreement: float              # fraction of positions whose argmax token agrees
    greedy_agree: bool                   # all greedy continuations identical to the greedy reference
    vs_prediction: float                 # max |diff| to `prediction`
    reference: str                       # what the headline numbers compare with
    prediction: str                      # what the converted model must equal up to float noise
    explained: str                       # why a deviation from `reference` is expected, when it holds
    greedy_reference: str
    num_prompts: int
    new_tokens: int
    routing_agreement: float | None = None   # mixtures of experts: the same experts chosen as the prediction
    eps_effect: bool = True              # the prediction may differ from the source by the eps effect (eps > 0)

    @property
    def prediction_holds(self) -> bool:
        """The converted model equals the prediction up to float32 rounding (which grows with depth;
        1e-4 of the largest logit leaves room for deep models and is far below a real bug)."""
        return self.vs_prediction <= 1e-4 * self.logit_scale

    @property
    def passed(self) -> bool:
        """Whether the conversion may be published."""
        return self.prediction_holds and self.greedy_agree

    def failures(self) -> list[str]:
        """Why the verification failed (empty when it passed)."""
        out = []
        if not self.prediction_holds:
            out.append(f"max |difference| to {self.prediction} is {self.vs_prediction:.3e}, LARGER than float "
                       f"noise ({1e-4 * self.logit_scale:.1e}): the converted model is not what the spec predicts")
        if not self.greedy_agree:
            why = ("" if not self.prediction_holds else
                   ": the logits are the spec's prediction, so the eps effect itself changes the generated tokens "
                   "(a larger --stream-scale shrinks it)" if self.eps_effect else
                   ": the logits are the spec's prediction, which has no eps effect here, so float rounding flipped "
                   "a near-tie of the top logits")
            out.append(f"greedy generation differs from {self.greedy_reference}{why}")
        return out

    def lines(self) -> list[str]:
        """Human-readable summary, printed by the CLI and written into the model card."""
        verdict = (f"float noise: {self.explained}" if self.prediction_holds else
                   "LARGER than float noise: the converted model is not what the spec predicts")
        return [f"compared with: {self.reference} on {self.num_prompts} prompts (float32)",
                f"max |logit difference|: {self.max_abs_diff:.3e} (relative to max |logit|: {self.max_rel_diff:.3e})",
                f"argmax agreement: {100 * self.argmax_agreement:.1f}% of positions",
                f"greedy generation ({self.new_tokens} tokens) agrees: {'yes' if self.greedy_agree else 'NO'} "
                f"(with {self.greedy_reference})",
                f"max |difference| to {self.prediction}: {self.vs_prediction:.3e} ({verdict})",
                *([] if self.routing_agreement is None else
                  [f"routing: {100 * self.routing_agreement:.1f}% of (token, sparse layer) pairs choose the experts "
                   f"{self.prediction} chooses"]),
                "verdict: " + ("passed" if self.passed else "FAILED")]


@dataclass
class ConversionResult:
    """What `convert` did, for the CLI summary, the model card and tests."""

    src: str
    dst: Path
    layout: str
    config: AttnResConfig
    stream_scale: float
    dtype: torch.dtype
    scale_errors: dict[float, float] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    verification: VerifyReport | None = None
    origin: str | None = None        # how the source was read, when not as given (a dequantised GGUF)
    # An AttnRes source's own card (an earlier attnres-convert's): the stream scale its weights still carry
    # and its base model, carried into this card (`card.carried_from_card`).
    source_stream_scale: float | None = None
    base_model: str | None = None
    revision: str | None = None      # of a Hub source, as asked for (`--revision`)

    def calibration_summary(self) -> str:
        """`s=1: 1.4e-06, s=2: ...`: the predicted relative logit error of each candidate scale."""
        return ", ".join(f"s={s:g}: {e:.2e}" for s, e in self.scale_errors.items())
