"""train.compile (trnrecipes/parallel/compile.py): torch.compile per block changes no number and no parameter name, does
not recompile after warm-up (one training step and one evaluation), runs through the trainer, compiles on the CPU
with inductor, is on by default for cuda only (without TP) and refused on xla/neuron and with TP."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from conftest import REPO

from recipes.common.loss import IGNORE_INDEX
from trnrecipes.backends.torch import CudaBackend, TorchBackend
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.models import build_model
from trnrecipes.parallel.activation_checkpointing import apply_activation_checkpointing
from trnrecipes.parallel.compile import compile_blocks, is_compiled
from trnrecipes.train.loop import Trainer

torch.set_num_threads(2)
SEQ = 32


def tiny_model(family: str, mode: str, backend: str | None) -> torch.nn.Module:
    model = build_model(load_recipe(f"{family}-tiny").model)
    model.init_weights(seed=0)
    apply_activation_checkpointing(model, mode)
    if backend:
        assert compile_blocks(model, backend) == model.args.num_layers
    return model.train()


def batches(model, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, model.args.vocab_size, (2, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[0, :5] = IGNORE_INDEX
        out.append((tokens[:, :-1], labels))
    return out


def train_and_eval(model, data) -> list[torch.Tensor]:
    """Per batch: a training step (SGD, so the weights move and a stale graph would show) and an eval loss."""
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for tokens, labels in data:
        model.train()
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels=labels)
        loss.backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            out += [loss.detach(), model(tokens, labels=labels)]
    return out


@pytest.mark.parametrize(
    ("family", "mode"), [("llama2", "selective"), ("neox", "full"), ("llama2", "none"), ("llama2", "elementwise")]
)
def test_compiled_blocks_give_the_eager_numbers_and_never_recompile_after_warm_up(family, mode):
    torch._dynamo.reset()
    eager, compiled = tiny_model(family, mode, None), tiny_model(family, mode, "aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    assert all(is_compiled(b) for b in compiled.layers) and not any(is_compiled(b) for b in eager.layers)
    data = batches(eager, 4)
    want = train_and_eval(eager, data)
    got = train_and_eval(compiled, data[:1])  # warm-up: a training graph and an eval graph
    with torch.compiler.set_stance("fail_on_recompile"):  # raises on any new compile from here on
        got += train_and_eval(compiled, data[1:])
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_changed_shape_after_warm_up_would_be_caught():
    # The stance above is the proof only if it does fail on a recompile: a new sequence length makes one.
    torch._dynamo.reset()
    model = tiny_model("llama2", "none", "aot_eager")
    train_and_eval(model, batches(model, 1))
    tokens, labels = batches(model, 1)[0]
    with torch.compiler.set_stance("fail_on_recompile"), pytest.raises(RuntimeError, match=r"[Rr]ecompil"):
        model(tokens[:, :16], labels=labels[:, :16])


def test_inductor_compiles_the_blocks_on_cpu():
    torch._dynamo.reset()
    eager, compiled = tiny_model("llama2", "selective", None), tiny_model("llama2", "selective", "inductor")
    data = batches(eager, 2)
    torch.testing.assert_close(
        torch.stack(train_and_eval(compiled, data)), torch.stack(train_and_eval(eager, data)), rtol=1e-4, atol=1e-5
    )


FAST = ["cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=4", "batch.micro_batch=2"]


@pytest.mark.slow
def test_the_trainer_compiles_blocks_under_train_compile_and_learns_the_same(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(TorchBackend, "compile_backend", "aot_eager")  # inductor: the test above
    torch._dynamo.reset()
    losses = {}
    for flag in ("false", "true"):
        over = [*FAST, "train.max_steps=4", "train.val_every=2", f"run_dir={tmp_path / flag}", f"train.compile={flag}"]
        trainer = Trainer(load_recipe("llama2-tiny", overrides=over))
        try:
            assert all(is_compiled(b) for b in trainer.model.layers) == (flag == "true")
            assert (trainer.optimizer.compiled_update is not None) == (flag == "true")  # the step compiles with them
            result = trainer.run()
        finally:
            trainer.close()
        losses[flag] = (result.losses, result.val_losses)
    torch.testing.assert_close(losses["true"][0], losses["false"][0], rtol=1e-5, atol=1e-6)
    assert losses["true"][1].keys() == losses["false"][1].keys() == {2, 4}
    torch.testing.assert_close(list(losses["true"][1].values()), list(losses["false"][1].values()), rtol=1e-5, atol=0)


def test_compile_defaults_on_for_cuda_only_and_is_refused_on_xla_and_neuron():
    r = load_recipe("llama2-tiny")
    assert r.train.compile is None
    assert CudaBackend("cuda", torch.device("cpu")).compiles(r)
    assert not TorchBackend("cpu", torch.device("cpu")).compiles(r)
    on = load_recipe("llama2-tiny", overrides=["train.compile=true"])
    assert TorchBackend("cpu", torch.device("cpu")).compiles(on)
    assert not CudaBackend("cuda", torch.device("cpu")).compiles(
        load_recipe("llama2-tiny", overrides=["train.compile=false"])
    )
    assert CudaBackend("cuda", torch.device("cpu")).compiles(load_recipe("llama2-tiny", overrides=["layout.tp=2"]))
    assert not CudaBackend("cuda", torch.device("cpu")).compiles(load_recipe("llama2-tiny", overrides=["layout.pp=2"]))
    with pytest.raises(RecipeError, match=re.escape("train.compile true: backend xla")):
        load_recipe("llama2-tiny", overrides=["cluster.backend=xla", "train.compile=true"])
    with pytest.raises(RecipeError, match=re.escape("train.compile true: backend neuron")):
        load_recipe("llama2-7b", overrides=["train.compile=true"])


def test_a_run_that_does_not_compile_never_imports_dynamo(tmp_path):
    """torch._dynamo costs about 1.5 s of CPU at each rank's start: a run without train.compile, TP or FSDP never
    imports it. What must run eagerly under compile is only marked (recipes/common/eager.py: the experts of a mixture
    here) and building on meta skips torch's Python fills, whose first call imports it."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['trnrecipes', 'train', '--config', 'qwen3-moe-tiny', 'cluster.workers_per_node=1',"
        " 'batch.seq_len=32', 'batch.global_batch=2', 'batch.micro_batch=2', 'train.max_steps=2',"
        f" 'train.val_every=1', 'train.compile=false', 'run_dir={tmp_path}']\n"
        "try:\n    runpy.run_module('trnrecipes', run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e\n"
        "print('dynamo imported:', 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "step 2/2" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert "dynamo imported: False" in done.stdout


def test_compile_blocks_disables_everything_marked_eager():
    """What recipes/common/eager.py marks is disabled (as torch.compiler.disable) by compile_blocks wherever the model
    holds it: a module's forward (through a mixin), a callable attribute, a functools.partial of a marked function,
    and a forward hook; nothing unmarked is touched, and compiling again changes nothing more."""
    import functools

    from recipes.common.eager import eager_under_compile

    @eager_under_compile
    def kernel(x, *, scale):
        return x * scale

    @eager_under_compile
    def hook(module, inputs, output):
        return None

    class Mixin:
        @eager_under_compile
        def forward(self, x):
            return x

    class Inner(Mixin, torch.nn.Linear):
        pass

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner(2, 2)
            self.kernel = functools.partial(kernel, scale=2.0)
            self.closure = eager_under_compile(lambda x: x)
            self.plain = lambda x: x
            self.inner.register_forward_hook(hook)

        def forward(self, x):
            return self.closure(self.kernel(self.inner(x)))

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block()])
    compile_blocks(model, "eager")
    block = model.layers[0]
    disabled = lambda f: getattr(f, "_torchdynamo_disable", False)  # noqa: E731
    assert disabled(type(block.inner).forward) and isinstance(block.inner, Inner)
    assert type(block.inner).__name__ == "Inner"
    assert disabled(block.kernel.func) and block.kernel.keywords == {"scale": 2.0}
    assert disabled(block.closure) and not disabled(block.plain)
    assert all(disabled(h) for h in block.inner._forward_hooks.values())
    assert not disabled(type(block).forward)
    before = (type(block.inner), block.kernel.func, block.closure)
    compile_blocks(model, "eager")
    assert (type(block.inner), block.kernel.func, block.closure) == before
    x = torch.ones(1, 2)
    torch.testing.assert_close(block(x), 2 * block.inner(x))
