#!/usr/bin/env bash
# Writes requirements/constraints-pyX.Y.txt for the given interpreter: the exact versions pip picks today for
# pyproject's `login` extra (and pip itself) on that Python, resolved in a throwaway venv (pip --dry-run: nothing is
# installed). On Python 3.11, .[train-deps]'s pins hold the packages both name, so a 3.11 login install matches .venv.
#   requirements/lock.sh /usr/bin/python3.10      (then review the diff, and run tests/test_login_python.py)
set -euo pipefail
python=${1:?usage: requirements/lock.sh PYTHON}
repo=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --upgrade pip
version=$("$tmp/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
pins=()
if [ "$version" = 3.11 ]; then
  mapfile -t pins < <("$tmp/venv/bin/python" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
extras = tomllib.load(open(sys.argv[1], "rb"))["project"]["optional-dependencies"]
print("\n".join(d for d in extras["train-deps"] if "==" in d))
PY
)
fi
printf '%s\n' "${pins[@]}" > "$tmp/train-pins.txt"
"$tmp/venv/bin/python" -m pip install --quiet --dry-run --ignore-installed --report "$tmp/report.json" \
  -c "$tmp/train-pins.txt" "${repo}[login]" pip
out="$repo/requirements/constraints-py$version.txt"
{
  echo "# The login-node tier (pyproject's login extra) on Python $version: exact versions, so that make setup and"
  echo "# tests/test_login_python.py install the same set. Made by requirements/lock.sh; pip install -c this file."
  "$tmp/venv/bin/python" - "$tmp/report.json" <<'PY'
import json, re, sys
chosen = {re.sub(r"[-_.]+", "-", i["metadata"]["name"]).lower(): i["metadata"]["version"]
          for i in json.load(open(sys.argv[1]))["install"]}
chosen.pop("trnrecipes")
print("\n".join(f"{name}=={version}" for name, version in sorted(chosen.items())))
PY
} > "$out"
echo "wrote $out ($(grep -c == "$out") pins)"
