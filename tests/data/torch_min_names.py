"""Write torch_2_4_names.txt: the names torch 2.4.0 defines in ``torch.distributed``, in the
``torch`` namespace's foreach functions and in ``torch.cuda``, read from the sources of a
torch 2.4.0 wheel without importing it (its CUDA build needs libraries this machine lacks).

    pip download --no-deps -d /tmp/t24 torch==2.4.0
    python tests/data/torch_min_names.py /tmp/t24/torch-2.4.0-*.whl > tests/data/torch_2_4_names.txt
"""

from __future__ import annotations

import ast
import re
import sys
import zipfile

DIST = ("torch/distributed/__init__.py", "torch/distributed/distributed_c10d.py")
CUDA = ("torch/cuda/__init__.py", "torch/cuda/streams.py")


def top_level(source: str) -> set[str]:
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom):
            names |= {a.asname or a.name for a in node.names if a.name != "*"}
        elif isinstance(node, ast.If):  # `if is_available():` blocks import most of c10d
            for sub in ast.walk(node):
                if isinstance(sub, ast.ImportFrom):
                    names |= {a.asname or a.name for a in sub.names if a.name != "*"}
    return names


def main(wheel: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        dist = set().union(*(top_level(z.read(f).decode()) for f in DIST))
        # `from .distributed_c10d import *` re-exports its public names
        cuda = set().union(*(top_level(z.read(f).decode()) for f in CUDA))
        pyi = z.read("torch/_C/_VariableFunctions.pyi").decode()
        foreach = set(re.findall(r"^def (_foreach_\w+)\(", pyi, re.M))
    print("# names torch 2.4.0 defines (tests/data/torch_min_names.py made this file)")
    for name in sorted(dist):
        print(f"torch.distributed.{name}")
    for name in sorted(cuda):
        print(f"torch.cuda.{name}")
    for name in sorted(foreach):
        print(f"torch.{name}")


if __name__ == "__main__":
    main(sys.argv[1])
