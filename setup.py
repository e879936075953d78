"""Packaging for tfos: distributed TensorFlow on Apache Spark."""
from setuptools import find_packages, setup

setup(
    name="tfos",
    version="0.1.0",
    description="Run distributed TensorFlow training and inference on Apache Spark "
    "(a TensorFlowOnSpark successor).",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tfos", "tfos.*"]),
    python_requires=">=3.11",
    install_requires=[
        "pyspark>=3.5,<5",
        "numpy>=1.26",
        "cloudpickle>=3.0",
        "psutil>=5.9",
        "tqdm>=4.66",
        # AES-GCM encryption of every data-plane frame (tfos._common.wire.DataSession): 47
        # added AESGCM.encrypt_into / decrypt_into (no copy of a frame).
        "cryptography>=47",
    ],
    extras_require={
        # Users often bring their own TensorFlow build, so TF is an extra. Each TF extra
        # installs exactly one TensorFlow distribution (they share one 'tensorflow/' folder):
        # tf-keras requires 'tensorflow', so 'tf' pairs it with 'tensorflow'. 'tf-cpu' is the
        # CPU-only wheel without tf-keras (Keras 3 only); add Keras 2 to it with
        # `pip install --no-deps "tf-keras==2.21.*"` (tensorflow-cpu provides what it needs).
        # tests/unit/test_packaging.py checks both.
        "tf": ["tensorflow==2.21.*", "tf-keras==2.21.*", "tensorboard>=2.21"],
        "tf-cpu": ["tensorflow-cpu==2.21.*", "tensorboard>=2.21"],
        "arrow": ["pyarrow>=15", "pandas>=2.2,<3"],
        # Spark Connect clients (docs/connect.md): PySpark's own Connect client dependencies.
        "connect": ["pyspark[connect]>=4.0,<5"],
        "test": [
            "pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "mypy>=1.10",
            # examples/notebooks/*.ipynb run in the suite; nbconvert prints a run with its
            # cell outputs (README, "Running the notebook")
            "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29", "nbconvert>=7",
            "packaging>=23",  # tests/unit/test_packaging.py reads requirement strings
            "venv-pack>=0.2",  # tests/spark/test_deploy.py packs a venv (docs/deploy.md)
            # tests/unit/test_source_hygiene.py runs `ruff check tfos` (rules in ruff.toml); one
            # minor series, so a new ruff's new checks do not fail the suite unannounced.
            "ruff==0.17.*",
        ],
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
