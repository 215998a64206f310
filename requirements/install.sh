#!/usr/bin/env bash
# How make installs trnrecipes into a venv (VENV, default .venv), one tier at a time:
#   core   PyYAML and Jinja2: make sbatch / plan
#   login  + pyproject's login extra at requirements/constraints-pyX.Y.txt's exact versions: what a login node runs
#          (sbatch, plan, doctor, data to-arrow, tokenizer) on Python 3.10, 3.11 or 3.12, without torch
#   full   .[train,eval,dev,tracking]: training on CPU, make eval / demo / test; its pins need Python 3.11 or 3.12
#   tier   print the tier make setup installs: full where the venv's Python is 3.11+ (a new venv's: where one is found)
#   note   the one line make setup prints after a login-tier setup
# A new venv's Python: $python (make setup python=PATH), else the first 3.11+ of python3.11, python3, python3.12,
# pyenv's 3.11.x and 3.12.x; else python3.
set -euo pipefail
what=${1:?usage: requirements/install.sh core|login|full|tier|note [VENV]}
venv=${2:-.venv}
repo=$(cd "$(dirname "$0")/.." && pwd)
FULL="training on CPU, make eval, make demo and make test"
GET="install one (Ubuntu 22.04: sudo apt install python3.11-venv; or pyenv install 3.11)"

version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
full_ok() { [ "$1" = 3.11 ] || [ "$1" = 3.12 ]; }

# The interpreter for a new venv, as its real path (not a pyenv shim).
pick() {
  local root=${PYENV_ROOT:-${HOME:-}/.pyenv} p
  if [ -n "${python:-}" ]; then
    "$python" -c 'import sys; print(sys.executable)' 2>/dev/null && return
    echo "error: python=$python is not a Python interpreter here; give a path such as /usr/bin/python3.11" >&2
    exit 2
  fi
  for p in python3.11 python3 python3.12 $(printf '%s\n' "$root"/versions/3.11.*/bin/python | sort -rV) \
    $(printf '%s\n' "$root"/versions/3.12.*/bin/python | sort -rV); do
    if full_ok "$(version_of "$p")"; then
      "$p" -c 'import sys; print(sys.executable)'
      return
    fi
  done
  python3 -c 'import sys; print(sys.executable)' 2>/dev/null || { echo "error: no python3 on PATH" >&2; exit 2; }
}

# The venv's Python, or for a new venv the one pick() makes it with; and its version.
if [ -x "$venv/bin/python" ]; then base=$venv/bin/python; named=$venv; else base=$(pick); named=$base; fi
version=$(version_of "$base") || { echo "error: $base does not run" >&2; exit 2; }

# What to do where the full install cannot go: take a 3.11+ found here, or get one.
advice() {
  local other redo="make setup"
  other=$(python='' pick)
  [ -x "$venv/bin/python" ] && redo="rm -rf $venv && make setup"
  if full_ok "$(version_of "$other")"; then
    echo ": $redo python=$other"
  else
    echo "; none is on PATH (python3.11, python3, python3.12) or in pyenv: $GET, then $redo (or add" \
      "python=/path/to/python3.11)"
  fi
}

case $what in
  tier)
    if full_ok "$version"; then echo full; else echo login; fi
    exit 0 ;;
  note)
    echo "note: $venv is Python $version: the login-node tier (sbatch, plan, doctor, data to-arrow, tokenizer);" \
      "$FULL need Python 3.11 or 3.12$(advice)"
    exit 0 ;;
  full)
    if ! full_ok "$version"; then
      echo "error: $FULL need Python 3.11 or 3.12 (the pins of torch, numpy, transformers, lm-eval), and $named is" \
        "Python $version$(advice)" >&2
      exit 2
    fi ;;
  login)
    constraints=$repo/requirements/constraints-py$version.txt
    if [ ! -f "$constraints" ]; then
      echo "error: $named is Python $version; the login-node tier is pinned for Python 3.10, 3.11 and 3.12" \
        "(requirements/constraints-py3.*.txt): make setup python=/path/to/python3.12" >&2
      exit 2
    fi ;;
  core) ;;
  *) echo "error: requirements/install.sh $what: not one of core, login, full, tier, note" >&2; exit 2 ;;
esac

if [ -x "$venv/bin/python" ]; then
  if [ -n "${python:-}" ] && [ "$(version_of "$(pick)")" != "$version" ]; then
    echo "note: python=$python is for a new venv; $venv is Python $version (rm -rf $venv to change it)" >&2
  fi
else
  "$base" -m venv "$venv"
fi
py=$venv/bin/python
echo "$venv (Python $version, $("$py" -c 'import os, sys; print(os.path.realpath(sys.executable))')): installing the $what tier"
case $what in
  core) "$py" -m pip install --quiet -e "$repo" ;;
  login)
    "$py" -m pip install --quiet --upgrade -c "$constraints" pip
    "$py" -m pip install --quiet -c "$constraints" -e "${repo}[login]" ;;
  full)
    "$py" -m pip install --quiet --upgrade pip
    "$py" -m pip install --quiet -e "${repo}[train,eval,dev,tracking]" ;;
esac
