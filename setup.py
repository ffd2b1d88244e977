from setuptools import find_packages, setup

setup(
    name="coc",
    version="0.1.0",
    description="Fused and overlapped communication-computation operators for tensor parallelism",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["kernels", "kernels.*", "autopar", "autopar.*", "bench", "bench.*"]),
    package_data={"": ["*.yaml"]},
    include_package_data=True,
    install_requires=["torch>=2.4", "triton>=3.0", "pyyaml>=5.4"],
    extras_require={
        "test": ["pytest>=7", "pytest-timeout>=2.1", "megatron-core>=0.9", "matplotlib>=3.5"],
        "cuda": ["cupy-cuda12x>=13"],
        "plot": ["matplotlib>=3.5"],
    },
)
