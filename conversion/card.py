"""The model card (README.md) of a converted checkpoint: what was converted, how, and what it costs."""

import re
from pathlib import Path

from .checkpoint_io import REPO_ID
from .datatypes import ConversionResult

STANDARD_HOW = """All transformer weights are carried over (scaled by a power of two where noted below);
every depth-attention pseudo-query is zero and every depth key-norm gain is one, so each site mixes
its sources uniformly and returns the ordinary residual stream divided by its number of sources `c`.
Every reader of the stream is an RMSNorm, which ignores that scale except through eps: site by site
the effective eps becomes `(c/s)^2 * rms_norm_eps`, where `s = {scale:g}` is the residual-stream
scale applied at conversion (embedding, `o_proj` and `down_proj` multiplied by `s`{tied_note};
see above for how it was chosen). With
`rms_norm_eps = 0` the model is exactly the source; otherwise it differs by this eps change only
(numbers below), which a short fine-tune heals. Training it further lets the pseudo-queries learn
where to look."""

LAYOUT_HOW = """The source already is an AttnRes model; its tensors were renamed to this project's layout
(seed pseudo-code names such as `attn_res_proj` -> `self_attention_res_proj`, block size counted in
sublayers -> layers) by a declarative key map. No value was changed except for the output dtype."""


SCALE_LINE = re.compile(r"^- residual-stream scale s: ([0-9.eE+-]+)", re.M)
BASE_MODEL_LINE = re.compile(r"^base_model: (\S+)$", re.M)


def carried_from_card(folder: Path) -> tuple[float | None, str | None]:
    """From an AttnRes folder's own model card (`README.md`, one attnres-convert wrote), if it has one: the
    residual-stream scale its weights carry and its base model, which a conversion of its layout or a
    quantization keeps (neither rescales)."""
    card = folder / "README.md"
    text = card.read_text(encoding="utf-8", errors="replace") if card.is_file() else ""
    scale, base = SCALE_LINE.search(text), BASE_MODEL_LINE.search(text.split("\n---", 1)[0])
    return (float(scale.group(1)) if scale else None), (base.group(1) if base else None)


def _front_matter(result: ConversionResult) -> str:
    lines = ["---", "library_name: transformers", "tags:", "- attnres", "- attention-residuals"]
    if REPO_ID.match(result.src) and "/" in result.src and not Path(result.src).expanduser().exists():
        lines.append(f"base_model: {result.src}")
    elif result.base_model:
        lines.append(f"base_model: {result.base_model}")
    return "\n".join(lines + ["---", ""])


def _config_lines(result: ConversionResult) -> list[str]:
    cfg = result.config
    blocks = ("Full AttnRes (every sublayer is its own source)" if cfg.attn_res_mode == "full" else
              f"Block AttnRes, {cfg.attn_res_block_size} layer(s) per block "
              f"({cfg.num_depth_sources - 1} blocks over {cfg.num_hidden_layers} layers)")
    source = (f"- source: `{result.src}`" + (f" at revision `{result.revision}`" if result.revision else "") +
              f" ({result.layout}" + (f"; {result.origin})" if result.origin else ")"))
    experts = (f"- mixture of experts: {cfg.num_experts} experts, top-{cfg.num_experts_per_tok}, on layers "
               f"{cfg.sparse_layers}" + (f", shared expert of {cfg.shared_expert_intermediate_size}"
                                         if cfg.shared_expert_intermediate_size else "") if cfg.num_experts else None)
    lines = [source, f"- depth attention: {blocks}", *([experts] if experts else []),
             f"- dtype: {str(result.dtype).removeprefix('torch.')}", f"- rms_norm_eps: {cfg.rms_norm_eps:g}",
             f"- kept from the source: {', '.join(f'`{n}`' for n in result.copied_files) or 'nothing'}"]
    if result.layout != "attnres":
        lines.append(f"- residual-stream scale s: {result.stream_scale:g}" + (
            f" (calibrated; predicted relative logit error {result.calibration_summary()})"
            if result.scale_errors else ""))
    elif result.source_stream_scale is not None:
        lines.append(f"- residual-stream scale s: {result.source_stream_scale:g} (applied when the source was "
                     "converted from its Llama-family model, and kept: from the source's model card)")
    return lines


def _verification_lines(result: ConversionResult) -> list[str]:
    report = result.verification
    if report is None:
        return ["Verification was skipped (`--no-verify`).", ""]
    warning = ([] if report.passed else
               [f"**Verification FAILED ({'; '.join(report.failures())}); published anyway with `--keep-failed`.**",
                ""])
    return ["## Verification", "", *warning, *(f"- {line}" for line in report.lines()), ""]


def model_card(result: ConversionResult) -> str:
    """The README.md text for a converted checkpoint."""
    if result.layout == "attnres":
        how = LAYOUT_HOW
    else:
        tied = ", and the final norm's gain divided by `s` because lm_head is tied to the embedding"
        tied_note = tied if result.config.tie_word_embeddings else ""
        how = STANDARD_HOW.format(scale=result.stream_scale, tied_note=tied_note)
    verify = _verification_lines(result)
    return "\n".join([
        _front_matter(result), f"# AttnRes conversion of {result.src}", "",
        "An Attention Residuals (Kimi Team, arXiv:2603.15031) model converted with `attnres-convert`.", "",
        *_config_lines(result), "", "## How", "", how, "", *verify,
        "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(PATH_OR_REPO, trust_remote_code=True)",
        "tok = AutoTokenizer.from_pretrained(PATH_OR_REPO, trust_remote_code=True)  # it reads the config too",
        "```",
        "`trust_remote_code=True` loads the modeling files shipped here; with the `attnres` package installed "
        "(`import modeling_attnres`) the installed code is used instead.", ""])


def write_model_card(folder: Path, result: ConversionResult) -> None:
    """Write README.md into the output folder."""
    (folder / "README.md").write_text(model_card(result))
