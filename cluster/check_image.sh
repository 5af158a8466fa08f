#!/usr/bin/env bash
# The cluster's Python environment, installed and checked without a GPU.
#
#   cluster/check_image.sh gpu    # what cluster/Dockerfile installs: the `gpu` extra (CUDA torch, faiss-gpu)
#   cluster/check_image.sh cpu    # the same install with faiss-cpu and CPU torch (CI runs this)
#
# A fresh virtualenv gets raydense (not editable) with the extra, every version as
# constraints.txt pins it. Then, from outside the checkout, each step exits non-zero on failure:
#   1. `pip check`;
#   2. torch, faiss and deepspeed import together in one process; their versions;
#   3. every shared library that libfaiss and torch's libraries need resolves (`ldd`), CUDA
#      libraries inside the environment, with libcuda.so.1 (the driver's, mounted into a
#      GPU container) the only one allowed to be absent; then the CUDA libraries that
#      importing torch and faiss together maps into the process, and from where;
#   4. every job imports and prints its --help;
#   5. the environment's size, largest packages first.
# For the `gpu` extra, pip must reach PyPI's CUDA builds of torch: a pip configuration whose
# find-links holds a CPU torch wheel of the pinned version would be taken instead, and step 2
# says so. KEEP=1 keeps the environment (its path is printed); ENV_DIR=<it> checks it again.
set -euo pipefail
EXTRA="${1:-cpu}"
case "$EXTRA" in cpu | gpu) ;; *) echo "usage: $0 cpu|gpu" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
REPO="$PWD"
if [ -n "${ENV_DIR:-}" ]; then # an environment this script installed and kept: check it again
  VENV="$ENV_DIR"
else
  VENV="$(mktemp -d "${TMPDIR:-/tmp}/raydense-$EXTRA-env-XXXXXX")"
  [ "${KEEP:-0}" = 1 ] && echo "environment: $VENV (ENV_DIR=$VENV checks it again)" || trap 'rm -rf "$VENV"' EXIT
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The cpu extra names torch first so that a CPU wheel of the pinned version is taken where
  # one is offered (CI); PyPI's Linux torch of that version is the CUDA build the image gets.
  if [ "$EXTRA" = cpu ]; then
    "$VENV/bin/python" -m pip install -q -c constraints.txt torch==2.13.0 "$REPO[cpu]"
  else
    "$VENV/bin/python" -m pip install -q -c constraints.txt "$REPO[gpu]"
  fi
fi
PY="$VENV/bin/python"

echo "== 1. pip check"
"$PY" -m pip check

cd "$VENV" # not the checkout: imports must come from the installed package
echo "== 2. import torch, faiss, deepspeed"
"$PY" - "$EXTRA" <<'PY'
import sys

import deepspeed
import faiss
import torch

extra = sys.argv[1]
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()})")
print(f"faiss {faiss.__version__} (GPU support: {hasattr(faiss, 'StandardGpuResources')})")
print(f"deepspeed {deepspeed.__version__}")
if extra == "gpu":
    assert torch.version.cuda, f"torch {torch.__version__} is a CPU build: pip took it from a local wheel"
    assert hasattr(faiss, "StandardGpuResources"), "faiss has no GPU support"
else:
    assert not torch.version.cuda, f"the cpu extra pulled CUDA torch {torch.__version__}"
PY

echo "== 3. shared libraries"
"$PY" - "$VENV" <<'PY'
import importlib.util
import pathlib
import re
import subprocess
import sys

venv = pathlib.Path(sys.argv[1]).resolve()
site = pathlib.Path(importlib.util.find_spec("torch").origin).parents[1]
DRIVER = {"libcuda.so.1", "libnvidia-ml.so.1"}  # the driver's: mounted into GPU containers
CUDA = re.compile(r"^lib(cu|nv|nccl)")


def short(path) -> str:
    return str(path).replace(str(site), "<site-packages>")


# What the process really binds: torch and faiss each preload CUDA libraries from the
# nvidia-* wheels by path (off ld.so's search path), so this, not ldd, is the ground truth.
code = "import torch, faiss, deepspeed; print(open('/proc/self/maps').read())"
maps = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
mapped = sorted({line.split()[-1] for line in maps.splitlines() if "/" in line and ".so" in line})
cuda = {}
for path in mapped:
    if CUDA.match(pathlib.Path(path).name):
        cuda.setdefault(pathlib.Path(path).name, []).append(path)
print(f"import torch, faiss, deepspeed: {len(mapped)} shared objects mapped, {len(cuda)} CUDA libraries:")
for name, paths in sorted(cuda.items()):
    print(f"  {name:30} {', '.join(short(p) for p in paths)}")
outside = [p for paths in cuda.values() for p in paths if venv not in pathlib.Path(p).resolve().parents]
assert not outside, f"CUDA libraries mapped from outside the environment: {outside}"
clashes = {name: paths for name, paths in cuda.items() if len(paths) > 1}
assert not clashes, f"one soname mapped from two files: {clashes}"

# Then every library file of torch and faiss: each dependency resolves, inside the
# environment for CUDA's; one ld.so cannot find is allowed only if the import above
# preloaded it from the environment, or it is the driver's.
libraries = [p for pattern in ("faiss/*.so*", "torch/lib/*.so*") for p in sorted(site.glob(pattern))]
problems, preloaded = [], set()
for library in libraries:
    for line in subprocess.run(["ldd", str(library)], capture_output=True, text=True).stdout.splitlines():
        match = re.match(r"\s*(\S+) => (not found|\S+)", line)
        if not match:
            continue
        name, path = match.groups()
        if path == "not found":
            if name in cuda:
                preloaded.add(name)
            elif name not in DRIVER:
                problems.append(f"{library.name}: {name} not found")
        elif CUDA.match(name) and venv not in pathlib.Path(path).resolve().parents:
            problems.append(f"{library.name}: {name} resolves outside the environment, to {path}")
assert not problems, "\n".join(problems)
print(f"ldd: {len(libraries)} library files of torch and faiss; every dependency resolves inside the environment")
if preloaded:
    print(f"  found by the import's preload, not by ld.so: {', '.join(sorted(preloaded))}")
PY

echo "== 4. jobs"
"$PY" - "$REPO" <<'PY'
import importlib.util
import pathlib
import subprocess
import sys

import pipeline

repo = pathlib.Path(sys.argv[1])
assert not pipeline.__file__.startswith(str(repo)), f"imported from the checkout: {pipeline.__file__}"
jobs = sorted(p for p in (repo / "jobs").glob("*.py") if p.name != "__init__.py")
for job in jobs:
    spec = importlib.util.spec_from_file_location(f"job_{job.stem}", job)
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    done = subprocess.run([sys.executable, str(job), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "usage:" in done.stdout, f"{job.name} --help:\n{done.stdout}{done.stderr}"
print(f"{len(jobs)} jobs import and print --help")
PY

echo "== 5. size"
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "environment: $(du -sh "$VENV" | cut -f1)"
du -s "$SITE"/* 2>/dev/null | sort -rn | awk "NR <= 8" | while read -r kb path; do
  awk -v kb="$kb" -v name="${path#"$SITE"/}" 'BEGIN { printf "  %6.2f GiB  %s\n", kb / 1048576, name }'
done
echo "image check ($EXTRA): passed"
