#!/usr/bin/env bash
# Install fedmjp and its dependencies into the current Python, once.
# Idempotent: when pyproject.toml, constraints.txt and the checkout path are unchanged since the last
# successful install and the key packages import, it returns in about a second without calling pip.
# constraints.txt pins every dependency to the versions the suite last passed with, so that a fresh
# machine resolves the same packages next month as today.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp="$($PY -c 'import sys; print(sys.prefix)')/.fedmjp-install-stamp"
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16) $(pwd)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && $PY -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in
      ('fedmjp', 'torch', 'torchvision', 'timm', 'flwr', 'breaching', 'lpips', 'skimage', 'pandas', 'opacus', 'pytest', 'pytest_timeout', 'xdist', 'importlinter', 'mypy', 'sklearn', 'umap', 'imagecorruptions', 'cachetools')))" 2>/dev/null; then
  echo "fedmjp: dependencies already installed (delete $stamp to force a reinstall)"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
$PY -m pip install -q -c constraints.txt -e ".[test,analysis]"
echo "$want" > "$stamp"
echo "fedmjp: installed"
