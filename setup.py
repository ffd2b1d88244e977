from setuptools import find_packages, setup

setup(
    name="coc-overlap",
    version="0.1.0",
    description="Fused and overlapped communication-computation operators for tensor parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # configs/ (the one source of the shipped YAML files) is installed as the data package kernels._configs,
    # which kernels/paths.py finds; a top-level `configs` in site-packages could belong to anything.
    packages=find_packages(include=["kernels", "kernels.*", "autopar", "autopar.*", "bench", "bench.*"])
    + ["kernels._configs", "kernels._configs.bench", "kernels._configs.tuned"],
    package_dir={"kernels._configs": "configs"},
    package_data={"": ["*.yaml"], "kernels._configs.tuned": ["README.md"]},
    # A CPU tuning file is only ever read from COC_TUNED_DIR (kernels/fused/tuned.py).
    exclude_package_data={"kernels._configs.tuned": ["cpu.yaml"]},
    include_package_data=True,
    # Triton: CI runs the suite with the newest release and its Triton tests again with 3.6 (make
    # test-triton36), both on torch 2.13 CPU. torch 2.11 is the GPU image's (with Triton 3.6): checked
    # there by `python -m bench --mode gpu-check`, not in CI (no torch 2.11 CPU wheel on CI machines).
    # numpy: the fused kernels' runtime and interpreter repairs import it (kernels/fused/runtime.py).
    install_requires=["torch>=2.11", "triton>=3.6", "pyyaml>=5.4", "numpy>=1.22"],
    extras_require={
        "test": [
            "pytest>=7",
            "pytest-timeout>=2.1",
            "pytest-xdist>=3.5",
            "megatron-core>=0.9",
            "matplotlib>=3.5",
            "ruff==0.17.6",
            "transformers>=5,<6",
            # transformers' own tensor-parallel loading (tests/autopar/tp/test_hf_registry.py) requires it.
            "accelerate>=1.0",
        ],
        # One CuPy wheel per CUDA major, matching torch.version.cuda: two of them installed side by side
        # would share one `cupy` package. The code imports `cupy` from whichever is installed.
        "cuda12": ["cupy-cuda12x>=13"],
        "cuda13": ["cupy-cuda13x>=14"],
        "plot": ["matplotlib>=3.5"],
    },
)
