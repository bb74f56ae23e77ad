from setuptools import find_packages, setup

setup(
    name="glm53_ds",
    version="0.1.0",
    description="GLM-5.3-Flash (glm5_next) on megatron-core layer specs, trained with DeepSpeed ZeRO + expert parallelism",
    packages=find_packages(include=["glm53_ds", "glm53_ds.*"]),
    python_requires=">=3.11",
    # Everything `deepspeed launch/train.py` imports. On a CPU-only machine install the CPU torch wheel first
    # (a bare `torch` from PyPI is the multi-GB CUDA build).
    install_requires=[
        "torch==2.13.0",
        # 0.16.1 on Python 3.11 (CI); 0.17-0.19 need Python >= 3.12 (tools/megatron_compat.sh checks one)
        "megatron-core>=0.16.1,<0.20",
        "deepspeed==0.19.8",
        "transformers==5.23.0",
        # --data reads Hugging Face datasets (parquet, Arrow, shard folders, the local hub cache) through it
        "datasets==5.2.0",
        "safetensors",
        "numpy",
        "packaging",
        "tqdm",
        "matplotlib",  # loss.png (the run goes on with a notice without it)
    ],
    entry_points={"console_scripts": ["glm53-convert=glm53_ds.convert.__main__:main"]},
    extras_require={
        # triton ships with CUDA torch builds; pinned here so CPU CI can run the kernels in the interpreter.
        "triton": ["triton==3.9.0"],
        "tensorboard": ["tensorboard==2.21.0"],
        "wandb": ["wandb==0.31.0"],  # --wandb-project
        # The exact stack CI tests (README's second command installs it).
        "test": [
            "triton==3.9.0",
            "tensorboard==2.21.0",
            "safetensors==0.8.0",
            "numpy==2.4.6",
            "matplotlib==3.11.2",
            "pytest==9.0.3",
            "pytest-xdist==3.8.0",  # README's test command runs two workers
            "ruff==0.17.6",
            "mypy==2.4.1",
            # The PEFT adapter export is tested by loading it into transformers' model with PEFT.
            "peft==0.21.2",
        ],
    },
)
