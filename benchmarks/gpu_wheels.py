"""Download the wheels that a GPU machine lacks for ppo.py and rloo.py into benchmarks/.wheels (ignored by git), so
that benchmarks/gpu_check.py runs there with no network (docs/benchmarks.md, "On a GPU").

    python benchmarks/gpu_wheels.py          # here, in the project's venv, with PyPI reachable

Which wheels: the scripts' module-level imports (tyro, datasets, torch, transformers, tokenizers, tqdm), followed
through their requirements as installed here, skipping every package the GPU machine already has (IMAGE below; a
package it has is taken with whatever it needs), but transformers, which is always carried at this project's pin: the
scripts run only on the versions of requirements.txt (torch aside: the GPU machine's own CUDA build). Each at the
version installed here, for CPython 3.12 on x86-64 Linux. Then, on the GPU machine:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site benchmarks/.wheels/*.whl &&
        PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py
"""

import argparse
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

WHEELS = Path(__file__).resolve().parent / ".wheels"
# what ppo.py and rloo.py import
ROOTS = ["tyro", "datasets", "torch", "transformers", "tokenizers", "tqdm", "peft", "safetensors"]
# the GPU machine's Python packages, as read on 2026-11-17: Python 3.12.3 with torch 2.11.0 (CUDA), transformers 5.17.0
# (older than the pin: replaced), tokenizers 0.23.2, huggingface_hub 1.33.0, peft, numpy, pandas, pyarrow; no tyro, no
# datasets
IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "os_name": "posix",
          "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
          "platform_python_implementation": "CPython", "extra": ""}  # the GPU machine, for requirements' markers
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64"]


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares names: lower case, runs of '-', '_' and '.' as one '-'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def missing(roots: list[str], replace: tuple[str, ...] = ()) -> dict[str, str]:
    """{name: version installed here} for every package the scripts need that IMAGE lacks, and for the packages in
    `replace` (taken at this project's version although the image has one)."""
    found, todo = {}, [normalize(r) for r in roots]
    while todo:
        name = todo.pop()
        if (name in IMAGE and name not in replace) or name in found:
            continue
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"error: {name} is not installed here; run this in the project's venv "
                     "(pip install -r requirements.txt)")
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(TARGET):
                todo.append(normalize(req.name))
    return dict(sorted(found.items()))


def main() -> None:
    """Download the missing wheels into WHEELS (replacing any there) and print their size and the command to run."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help, nothing else
    need = missing(ROOTS, ("transformers",))
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()  # one version of each: two would stop the install on the GPU machine
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(WHEELS),
                    *(f"{n}=={v}" for n, v in need.items())], check=True)
    wheels = sorted(WHEELS.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print("\n".join(w.name for w in wheels))
    print(f"{len(wheels)} wheels, {size:.1f} MiB in {WHEELS}; on the GPU machine, from the repository root:\n"
          "python3 -m pip install -q --no-index --no-deps --target /tmp/site benchmarks/.wheels/*.whl && "
          "PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py")


if __name__ == "__main__":
    main()
