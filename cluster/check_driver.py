"""Is this GPU node's NVIDIA driver new enough for the CUDA build of the installed torch?

A CUDA 13 build of torch on a driver older than R580 fails at its first CUDA call, with a
message that blames "a CPU build of torch"; this check fails first, with one line naming
the driver. It runs before Ray starts on a GPU node: as the init container of every GPU
worker pod (cluster/kuberay/raycluster.yaml) and in aws.yaml's setup commands.

    python cluster/check_driver.py              # exit 1, naming the driver, if too old or absent
    python cluster/check_driver.py --if-gpu     # a node without a driver passes (CPU nodes)

faiss-gpu's CUDA 12 runtime, beside torch's CUDA 13 in the same environment, needs R525 or
newer: less than torch's, so torch's build decides.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# The oldest driver each CUDA major runs on (NVIDIA's CUDA compatibility table, minor version
# compatibility within a major).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}
PROC_VERSION = Path("/proc/driver/nvidia/version")


def parse_driver(text: str) -> str | None:
    """The driver version in nvidia-smi's answer or /proc/driver/nvidia/version's text."""
    match = re.search(r"\b(\d{3,4}\.\d{1,3}(?:\.\d{1,3})?)\b", text)
    return match.group(1) if match else None


def driver_problem(driver: str | None, cuda: str | None, torch_version: str = "torch") -> str | None:
    """One line saying why this driver cannot run this CUDA build, or None when it can."""
    if not cuda:
        return None  # a CPU build needs no driver
    major = int(cuda.split(".")[0])
    needed = MIN_DRIVER.get(major, max(MIN_DRIVER.values()))
    if driver is None:
        return (
            f"error: no NVIDIA driver is visible in this container, and {torch_version} is a CUDA {cuda} "
            f"build: the pod must request nvidia.com/gpu on a node with the NVIDIA device plugin"
        )
    if int(driver.split(".")[0]) < needed:
        return (
            f"error: NVIDIA driver {driver} is older than R{needed}, which {torch_version} (CUDA {cuda}) needs: "
            f"use a GPU node image with driver {needed} or newer (cluster/guide/image.md, 'NVIDIA driver')"
        )
    return None


def installed_driver() -> str | None:
    if shutil.which("nvidia-smi"):
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        )
        if done.returncode == 0 and parse_driver(done.stdout):
            return parse_driver(done.stdout)
    if PROC_VERSION.exists():
        return parse_driver(PROC_VERSION.read_text())
    return None


def torch_cuda() -> tuple[str, str | None]:
    """torch's version and the CUDA it was built with, without importing torch (seconds)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        return "torch (not installed)", None
    spec = Path(importlib.util.find_spec("torch").origin).parent / "version.py"
    match = re.search(r"^cuda\s*(?::\s*[^=]+)?=\s*['\"]([\d.]+)['\"]", spec.read_text(), re.M)
    return f"torch {torch_version}", match.group(1) if match else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--if-gpu", action="store_true", help="pass on a node with no NVIDIA driver")
    parser.add_argument("--driver", help="check this driver version instead of the installed one")
    args = parser.parse_args(argv)
    torch_version, cuda = torch_cuda()
    if not cuda:
        print(f"{torch_version} is a CPU build: no driver to check")
        return 0
    driver = args.driver or installed_driver()
    if driver is None and args.if_gpu:
        print(f"no NVIDIA driver on this node: nothing to check for {torch_version}")
        return 0
    problem = driver_problem(driver, cuda, torch_version)
    if problem:
        print(problem, file=sys.stderr)
        return 1
    print(f"NVIDIA driver {driver}: runs {torch_version} (CUDA {cuda})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
