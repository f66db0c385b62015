#!/usr/bin/env bash
# The release as a user gets it: build the sdist and the wheel, check their metadata, install the
# wheel into a fresh venv (no checkout on the path) and run the README's "Use" snippet from it on
# 2 ranks under torchrun. Called by scripts/test.sh; run it alone after scripts/setup_env.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
python -m pip install -q build twine
rm -rf dist
python -m build -q --sdist --wheel --outdir dist . >/dev/null
twine check --strict dist/*
wheel=$(ls dist/commopt-*.whl)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/python" -m pip install -q -c constraints.txt "$wheel"
version=$("$work/venv/bin/commopt" --version)
[[ "$version" == "commopt $(python -c 'import commopt; print(commopt.__version__)')" ]]
# The README's "Use" block, with a tiny model and loader in front of it.
{
  printf '%s\n' "import torch" \
    "def build_model():" \
    "    torch.manual_seed(0)" \
    "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))" \
    "loader = [torch.randn(4, 8) for _ in range(4)]"
  awk '/^## Use/{f=1} f&&/^```python/{p=1;next} p&&/^```/{exit} p' README.md
  printf '%s\n' "open(f'ran-{torch.distributed.get_rank()}', 'w').close()  # one file per rank"
} > "$work/use.py"
grep -q "commopt.OnebitAdam" "$work/use.py"
(cd "$work" && OMP_NUM_THREADS=1 timeout 300 "$work/venv/bin/torchrun" --nproc_per_node 2 \
  --master_port "$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')" \
  use.py)
[[ -f "$work/ran-0" && -f "$work/ran-1" ]]  # (two ranks' stdout can interleave mid-line)
echo "release check: $version, sdist and wheel pass twine check, the README snippet ran from the wheel"
