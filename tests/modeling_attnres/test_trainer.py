"""transformers Trainer trains an AttnRes model, pseudo-queries included, and checkpoints it."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from modeling_attnres import AttnResForCausalLM
from tests.support.models import tiny_config


class RepeatingTokens(torch.utils.data.Dataset):
    """A learnable toy task: a short cycle of tokens."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        ids = torch.tensor([(i + t) % 7 + 3 for t in range(16)])
        return {"input_ids": ids, "labels": ids.clone()}


def test_trainer_lowers_loss_and_trains_pseudo_queries(tmp_path):
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=3, attn_res_block_size=1))
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=30, learning_rate=3e-3,
        logging_steps=5, save_steps=30, report_to=[], use_cpu=True, seed=0, gradient_checkpointing=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=RepeatingTokens())
    result = trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < 0.7 * losses[0], losses
    assert result.global_step == 30
    queries = [p for n, p in model.named_parameters() if n.endswith("mlp_res_proj.weight")]
    assert all(torch.count_nonzero(q) > 0 for q in queries)          # they moved off zero
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "checkpoint-30")
    assert isinstance(reloaded, AttnResForCausalLM)
    torch.testing.assert_close(reloaded.model.output_attn_res_proj.weight, model.model.output_attn_res_proj.weight)


def test_label_smoothing_scores_each_position_against_the_next_token(tmp_path):
    """Trainer's label smoother shifts labels only for the causal LMs it knows by class name: computed here
    from the logits, the smoothed loss of next-token targets (and not of each position's own token)."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=2, attn_res_block_size=1)).eval()
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    batch = torch.utils.data.default_collate([RepeatingTokens()[i] for i in range(4)])
    with torch.no_grad():
        loss = Trainer(model=model, args=args).compute_loss(model, dict(batch))
        log_probs = model(batch["input_ids"]).logits[:, :-1].float().log_softmax(-1)
    targets = batch["labels"][:, 1:]
    nll = -log_probs.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss, 0.9 * nll - 0.1 * log_probs.mean(), rtol=1e-5, atol=1e-6)


def test_the_documented_trainer_leaves_the_pseudo_queries_out_of_weight_decay(tmp_path):
    """docs/training.md's `AttnResTrainer`, run as written: weight decay on the projections and MLPs, not on
    the pseudo-queries, which plain `Trainer` decays (the reason the docs give it)."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "training.md").read_text()
    section = docs.split("## With transformers' `Trainer`")[1].split("\n## ")[0]
    namespace = {}
    exec(section.split("```python\n")[1].split("```")[0], namespace)
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=2))
    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, report_to=[], use_cpu=True)
    queries = {name for name, _ in model.named_parameters() if name.endswith("_res_proj.weight")}
    plain = set(Trainer(model=model, args=args).get_decay_parameter_names(model))
    ours = set(namespace["AttnResTrainer"](model=model, args=args).get_decay_parameter_names(model))
    assert len(queries) == 5 and queries <= plain and not queries & ours
    assert ours == plain - queries and "model.layers.0.mlp.up_proj.weight" in ours
