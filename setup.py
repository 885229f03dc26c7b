"""opt_serving: serve Meta's OPT models on JAX/Flax over a Ray cluster."""
import os

from setuptools import find_packages, setup

ext_modules = []
if os.environ.get("OPT_SERVING_NO_CEXT") != "1" and os.path.exists("opt_serving/_speedups.pyx"):
    try:
        import numpy
        from Cython.Build import cythonize
        from setuptools import Extension
        ext_modules = cythonize(
            [Extension("opt_serving._speedups", ["opt_serving/_speedups.pyx"],
                       include_dirs=[numpy.get_include()])],
            compiler_directives={"language_level": "3"}, quiet=True)
    except ImportError:  # no Cython: the pure-Python fallback is used
        ext_modules = []

setup(
    name="opt_serving",
    version="0.1.0",
    description="Serve OPT language models (125M-175B) on JAX/Flax with Ray Serve",
    packages=find_packages(include=["opt_serving", "opt_serving.*"]),
    package_data={"opt_serving": ["service/static/*", "*.pyx"]},
    python_requires=">=3.11",
    install_requires=[
        # tested: JAX 0.10.2 (Python 3.11, CPU; CI), 0.11.2 (Python 3.12: CPU, and an H200 with the CUDA 13
        # plugin), 0.12.0.1 (Python 3.12, CPU); JAX 0.11 and newer need Python 3.12
        "jax>=0.10,<0.13", "jaxlib>=0.10,<0.13", "flax>=0.12,<0.13",
        "ray[serve]>=2.50,<2.61", "numpy>=2.0,<2.5", "transformers>=5.0,<5.30",
        "tokenizers>=0.22,<0.24", "safetensors>=0.4", "jinja2>=3.1,<4",
        "fastapi>=0.115", "uvicorn>=0.30", "pydantic>=2.12,<3",
        "prometheus_client>=0.20", "tqdm>=4.66", "psutil>=5.9", "pyyaml>=6",
        "llguidance>=1.9,<1.10",
    ],
    # torch: the .pt checkpoint converter (opt-serving convert) and the facebook/ reference backend; serving
    # needs none of it. cuda12 / cuda13: JAX's NVIDIA GPU plugin and its CUDA libraries
    extras_require={"torch": ["torch>=2.4"],
                    "cuda12": ["jax[cuda12]>=0.10,<0.13"], "cuda13": ["jax[cuda13]>=0.10,<0.13"],
                    "test": ["pytest>=8", "pytest-xdist>=3.5", "requests>=2.31", "httpx>=0.27", "openai>=1.40",
                             "schemathesis>=4.0,<5", "selenium>=4.20,<5", "jsonschema>=4.20,<5"],
                    "bench": ["aiohttp>=3.9", "httpx>=0.27", "py-spy>=0.3.14"]},
    ext_modules=ext_modules,
    entry_points={"console_scripts": ["opt-serving=opt_serving.cli:main"]},
)
