"""optim.state_dtype bf16: AdamW's moments stored in bf16 (4 bytes a parameter instead of 8), updated in fp32 and
rounded back; training follows the fp32-state run closely; checkpoints hold bf16 moments and resume bitwise; a
resume across a change of it is refused unless allowed; plan counts it; NxD's ZeRO-1 path refuses it."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_resume import config, finish, last_losses, start

from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import OptimConfig, RecipeError
from trnrecipes.optim.adamw import AdamW
from trnrecipes.plan.layout import layout_memory


def train(state_dtype: str, steps: int = 40, stochastic: bool = False) -> tuple[list[float], AdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    if stochastic:
        model = model.to(torch.bfloat16)
    cfg = OptimConfig(lr=3e-3, min_lr=0, warmup_steps=0, decay_steps=0, betas=(0.9, 0.95), state_dtype=state_dtype)
    opt = AdamW(list(model.parameters()), cfg, stochastic_rounding=stochastic, seed=1)
    opt.set_lr(cfg.lr)
    x = torch.randn(256, 32)
    y = x[:, :1] * 0.5 - x[:, 1:2]
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, opt


@pytest.mark.parametrize("stochastic", [False, True])
def test_bf16_moments_halve_the_state_and_train_like_fp32_ones(stochastic):
    fp32, opt32 = train("fp32", stochastic=stochastic)
    bf16, opt16 = train("bf16", stochastic=stochastic)
    assert all(m.dtype == torch.bfloat16 for m in opt16.exp_avg + opt16.exp_avg_sq)
    assert all(m.dtype == torch.float32 for m in opt32.exp_avg + opt32.exp_avg_sq)
    state = sum(m.numel() * m.element_size() for m in opt16.exp_avg + opt16.exp_avg_sq)
    assert 2 * state == sum(m.numel() * m.element_size() for m in opt32.exp_avg + opt32.exp_avg_sq)
    assert bf16[-1] < 0.25 * bf16[0]  # it learns
    assert abs(bf16[-1] - fp32[-1]) < 0.1 * fp32[0]  # and ends where the fp32 state does, within 10% of the start
    assert bf16 != fp32  # the state really is rounded


@pytest.mark.slow
def test_a_run_with_bf16_state_checkpoints_bf16_moments_resumes_bitwise_and_refuses_a_change(tmp_path):
    straight, stopped = tmp_path / "a", tmp_path / "b"
    for d in (straight, stopped):
        d.mkdir()
    finish(start(config(straight, "optim.state_dtype=bf16", "train.max_steps=6", "checkpoint.every_steps=3")))
    finish(start(config(stopped, "optim.state_dtype=bf16", "train.max_steps=3", "checkpoint.every_steps=3")))
    moments = load_file(stopped / "run/checkpoints/step_3/optim-tp00-of-01.safetensors")
    assert moments and all(t.dtype == torch.bfloat16 for t in moments.values())
    finish(start(config(stopped, "optim.state_dtype=bf16", "train.max_steps=6", "checkpoint.every_steps=3")))
    assert last_losses(stopped / "run") == last_losses(straight / "run")
    changed = start(config(stopped, "optim.state_dtype=fp32", "train.max_steps=9", "checkpoint.every_steps=3"))
    out, _ = changed.communicate(timeout=600)
    assert changed.returncode == 2 and "optim.state_dtype" in out, out[-2000:]


def test_plan_counts_bf16_moments_and_nxd_zero1_refuses_them():
    seven = load_recipe("llama2-7b-trn2")
    fp32, _ = layout_memory(seven)
    bf16, _ = layout_memory(load_recipe("llama2-7b-trn2", overrides="optim.state_dtype=bf16"))
    assert bf16.optimizer == pytest.approx(fp32.optimizer / 2)
    with pytest.raises(RecipeError, match=r"optim.state_dtype bf16 with layout.zero1 on torch-xla"):
        load_recipe("llama2-7b", overrides="optim.state_dtype=bf16")


def test_a_checkpoint_from_before_the_new_recipe_keys_resumes(tmp_path):
    """A checkpoint's recipe.yaml written before data.sources, optim.state_dtype, the eval section and the new
    cluster/slurm keys existed: nothing is reported as changed (legacy defaults, or free to change)."""
    import yaml

    from trnrecipes.train.resume_compat import resume_differences

    current = load_recipe("llama2-7b", nodes=16).to_dict()
    old = yaml.safe_load(yaml.safe_dump(current))
    del old["data"]["sources"], old["optim"]["state_dtype"], old["eval"]
    del old["cluster"]["tokens_per_s_per_node"], old["cluster"]["node_mtbf_hours"]
    del old["slurm"]["restart_minutes"], old["slurm"]["hyperpod"], old["monitor"]
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(old))
    assert resume_differences(tmp_path, current, None, []) == ([], [])
    profiled = load_recipe("llama2-7b", 16, ["monitor.profile_steps=[5,6]", "monitor.trackers=[]"]).to_dict()
    assert resume_differences(tmp_path, profiled, None, []) == ([], [])  # monitoring may change on resume
    old["optim"]["state_dtype"] = "bf16"  # but a real change is still refused
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(old))
    refused, _ = resume_differences(tmp_path, current, None, [])
    assert refused == ["optim.state_dtype: 'bf16' -> 'fp32'"]
