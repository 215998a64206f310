"""eval.sbatch (and infer.sbatch) take their Slurm header from the recipe's eval section, not training's: one
process on a shared node by default, with its own partition, account, time, CPUs, memory and GPUs; on a Neuron
instance sbatch's "next:" says to score on a GPU node with `make eval` (eval.sbatch there would take days of the
training node's CPUs), and offers eval.sbatch once eval.partition names another partition."""

from __future__ import annotations

import shlex

import pytest
from golden import FAKE_REPO

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.render import render_job
from trnrecipes.plan.eval_cost import eval_estimate, eval_mem_gb, eval_next_steps


def sbatch_lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def render(name: str, nodes: int, overrides: str = "") -> dict[str, str]:
    recipe = load_recipe(name, nodes=nodes, overrides=overrides)
    return render_job(recipe, FAKE_REPO / "jobs" / "x", "cmd", FAKE_REPO).files


def test_eval_jobs_share_a_node_by_default_and_ask_for_the_models_memory():
    files = render("llama2-7b", 16, "slurm.partition=trn1 slurm.time_limit=7-00:00:00 slurm.account=ml")
    run, ev = sbatch_lines(files["run.sbatch"]), sbatch_lines(files["eval.sbatch"])
    assert "#SBATCH --exclusive" in run and "#SBATCH --exclusive" not in ev
    assert "#SBATCH --partition=trn1" in ev and "#SBATCH --account=ml" in ev  # unset: training's
    assert "#SBATCH --time=7-00:00:00" in run and not any(line.startswith("#SBATCH --time") for line in ev)
    recipe = load_recipe("llama2-7b")
    assert f"#SBATCH --mem={eval_mem_gb(recipe)}G" in ev and eval_mem_gb(recipe) == 35  # 6.74G x 4 B + 8
    assert "#SBATCH --nodes=1" in ev and "#SBATCH --nodes=16" in run


def test_the_eval_section_sets_the_eval_jobs_header_only():
    settings = ("eval.partition=gpu eval.account=evals eval.time_limit=04:00:00 eval.cpus=12 eval.mem_gb=64"
                " eval.gpus=1 eval.exclusive=true")  # fmt: skip
    files = render("llama2-7b", 16, "slurm.partition=trn1 " + settings)
    ev, run = sbatch_lines(files["eval.sbatch"]), sbatch_lines(files["run.sbatch"])
    for line in ("--partition=gpu", "--account=evals", "--time=04:00:00", "--cpus-per-task=12", "--mem=64G",
                 "--gpus-per-node=1", "--exclusive"):  # fmt: skip
        assert f"#SBATCH {line}" in ev, line
    assert "#SBATCH --partition=trn1" in run and not any("gpus" in line or "--mem" in line for line in run)
    cls = render("bert-base-cls", 1, settings)  # a classifier's infer job is scoring too
    assert "#SBATCH --partition=gpu" in sbatch_lines(cls["infer.sbatch"])


def test_a_mixture_of_experts_eval_costs_its_active_parameters_and_holds_them_all():
    """Qwen3-30B-A3B reads 3.35B of its 30.5B parameters a token: its table takes about a ninth of a dense 30B's
    time (it was priced at 30.5B: ~57 days, ~$60,657), while its memory holds every expert."""
    moe, dense = load_recipe("qwen3-30b-a3b-trn2"), load_recipe("qwen3-8b-trn2")
    ratio = eval_estimate(moe)["gpu_hours"] / eval_estimate(dense)["gpu_hours"]
    assert ratio == pytest.approx(moe.model.active_params() / dense.model.param_count())
    assert 0.35 < ratio < 0.45  # 3.35B active against 8.19B
    assert eval_mem_gb(moe) > 4 * moe.model.param_count() / 1e9


def test_on_trn1_the_next_step_is_make_eval_and_eval_sbatch_only_on_another_partition(cli, tmp_path):
    out, run = tmp_path / "job", tmp_path / "run"
    done = cli("sbatch", "--recipe", "llama2-7b", "--nodes", "16", "--out", str(out), "--no-data-check",
               "--overrides", shlex.quote(f"run_dir={run}") + " slurm.partition=trn1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    estimate = eval_estimate(load_recipe("llama2-7b"))
    days = estimate["cpu_hours"] / 24
    assert 5 < days < 30 and estimate["gpu_hours"] < 3  # lower bounds: 8e7 tokens at 1 TFLOP/s vs 300 on an H100
    steps = done.stdout[done.stdout.index("next:") :].splitlines()
    # eval.sbatch would hold a trn1 node for days, scoring on its host CPUs: it is not a step to run
    assert not [line for line in steps if line.startswith("  sbatch") and "eval.sbatch" in line]
    at = next(i for i, line in enumerate(steps) if "make eval" in line)
    assert steps[at].startswith(f"  make eval ckpt={run}   # when run.sbatch is done, on a GPU node (~1.0 h on 1 H100)")
    assert (
        f"(lm-eval has no Neuron backend), at least ~{days:,.0f} days for the whole table,"
        f" ~${estimate['cpu_cost']:,.0f} of trn1.32xlarge time" in steps[at + 1]
    )
    assert f"eval.gpus=1', then sbatch --dependency=afterok:$id {out}/eval.sbatch" in steps[at + 2]

    def next_steps(overrides: str) -> list[str]:
        return eval_next_steps(load_recipe("llama2-7b", 16, "slurm.partition=trn1 " + overrides), out, run)

    assert next_steps("eval.partition=trn1 eval.gpus=1")[0].startswith(f"  make eval ckpt={run}")  # training's
    eval_sbatch = f"  sbatch --dependency=afterok:$id {out}/eval.sbatch   # the 128-node Llama 2 post's eval table"
    assert next_steps("eval.partition=gpu eval.gpus=1") == [f"{eval_sbatch}, on partition gpu"]
    assert next_steps("eval.partition=cpu") == [
        f"{eval_sbatch}, on partition cpu",
        f"    # eval.gpus is 0: on CPUs the whole table takes at least ~{days:,.0f} days; --tasks / --limit for a"
        " subset",
    ]
    cpu = cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(tmp_path / "tiny"), "--no-data-check")
    assert cpu.returncode == 0 and f"{eval_sbatch.replace(str(out), str(tmp_path / 'tiny'))}\n" in cpu.stdout
    assert "make eval" not in cpu.stdout  # scoring on this machine's CPUs: nothing to say
